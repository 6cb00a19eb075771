"""Does re-recording a pooled CUDA event cost more than recording a fresh one? (H200 VM)

    python3 bench/probes/event_reuse_probe.py

Seed ResNet18 loop; per block one way of recording a timing event per step on a cached
stream, timed per call (thread CPU): `fresh` (a new Event each step), `pool` (8 events
reused round robin, never read), `pool_read` (8 reused, each read with elapsed_time
before its reuse, as the step clock does). Prints one JSON line per block.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "workloads"))
from loops import build_loop

loop = build_loop("resnet18", "cuda:0", small=False)
for _ in range(30):
    loop.step()
stream = torch.cuda.current_stream()
for _ in range(2):
    for kind in ("fresh", "pool", "pool_read"):
        pool = [torch.cuda.Event(enable_timing=True) for _ in range(8)]
        for e in pool:
            e.record(stream)
        torch.cuda.synchronize()
        cpus = []
        for i in range(300):
            loop.step()
            if kind == "pool_read" and i >= 9 and pool[(i + 1) % 8].query():
                pool[i % 8].elapsed_time(pool[(i + 1) % 8])  # both recorded 7-8 steps ago
            event = torch.cuda.Event(enable_timing=True) if kind == "fresh" else pool[i % 8]
            cpu = time.thread_time_ns()
            event.record(stream)
            cpus.append(time.thread_time_ns() - cpu)
        torch.cuda.synchronize()
        print(
            json.dumps(
                {
                    "kind": kind,
                    "record_cpu_us_median": round(statistics.median(cpus) / 1e3, 2),
                    "mean": round(statistics.fmean(cpus) / 1e3, 2),
                }
            ),
            flush=True,
        )
