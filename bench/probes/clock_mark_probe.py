"""c60ff5f's record-only StepClock.mark against bare pooled event records, same loop;
`bare_poolN`: N timing events re-recorded round robin (is it the live event count?)."""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "workloads"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _clock_c60ff5f import StepClock
from loops import build_loop

loop = build_loop("resnet18", "cuda:0", small=False)
for _ in range(30):
    loop.step()
stream = torch.cuda.current_stream()
for _ in range(2):
    for kind in ("bare_pool8", "bare_pool64", "bare_pool256", "c60ff5f_mark"):
        clock = StepClock("cuda_event")
        size = int(kind[9:]) if kind.startswith("bare_pool") else 8
        pool = [torch.cuda.Event(enable_timing=True) for _ in range(size)]
        cpus = []
        for i in range(300):
            loop.step()
            cpu = time.thread_time_ns()
            if kind.startswith("bare_pool"):
                pool[i % size].record(stream)
            else:
                clock.mark(i)
            cpus.append(time.thread_time_ns() - cpu)
            if kind == "c60ff5f_mark" and i % 32 == 0:
                clock.poll()
        torch.cuda.synchronize()
        line = {"kind": kind, "cpu_us_median": round(statistics.median(cpus) / 1e3, 2)}
        print(json.dumps(line), flush=True)
