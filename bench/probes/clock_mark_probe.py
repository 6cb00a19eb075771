"""Bisect what a step clock's mark costs on the training thread (seed ResNet18 loop).

    python3 bench/probes/clock_mark_probe.py [--steps 300] [--repeats 2]

On the H200 VM a bare `Event.record(stream)` on a cached stream cost 11-30 us of CPU
right after a step, but c60ff5f's `StepClock.mark`, which does little more, 64-83 us
(bench/results/clock_mark_probe_h200.json), and the clock in use (distanom/clock.py:
`record()` with `current_stream()`, then `query()` and `elapsed_time()`) 63-96 us. Each
block times one way of marking a step (thread CPU time per call, median):

- `bare_pool8`: `Event.record(stream)` on 8 pooled events, stream cached;
- `bare_fresh`: the same on a new Event each step;
- `bare_pool_read`: on 8 pooled events, each read with `elapsed_time` before its reuse
  (untimed), as the step clock's events are;
- `bare_in_function`: the same through one Python function call;
- `c_record`: `torch._C._CudaEventBase.record(event, stream)`, no Python wrapper;
- `c60ff5f_mark`: c60ff5f's record-only mark (bench/probes/_clock_c60ff5f.py), its
  `poll()` every 32 steps (untimed);
- `clock_mark`: distanom.clock.StepClock.mark as it is;
- `clock_record_only`: the current clock's `_new_event()` + `record()` alone.
Prints one JSON line per block.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "workloads"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _clock_c60ff5f import StepClock as C60Clock
from loops import build_loop

from distanom.clock import StepClock

KINDS = [
    "bare_pool8",
    "bare_fresh",
    "bare_pool_read",
    "bare_in_function",
    "c_record",
    "c60ff5f_mark",
    "clock_mark",
    "clock_record_only",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    loop = build_loop("resnet18", "cuda:0", small=False)
    for _ in range(30):
        loop.step()
    stream = torch.cuda.current_stream()
    c_record = torch._C._CudaEventBase.record

    def in_function(event: torch.cuda.Event) -> None:
        event.record(stream)

    for _ in range(args.repeats):
        for kind in KINDS:
            pool = [torch.cuda.Event(enable_timing=True) for _ in range(8)]
            c60, clock = C60Clock("cuda_event"), StepClock("cuda_event")
            cpus = []
            for i in range(args.steps):
                loop.step()
                event = pool[i % 8]
                if kind == "bare_fresh":
                    event = torch.cuda.Event(enable_timing=True)
                elif kind == "bare_pool_read" and i >= 9 and pool[(i + 1) % 8].query():
                    event.elapsed_time(pool[(i + 1) % 8])  # both recorded 7-8 steps ago
                cpu = time.thread_time_ns()
                if kind in ("bare_pool8", "bare_fresh", "bare_pool_read"):
                    event.record(stream)
                elif kind == "bare_in_function":
                    in_function(event)
                elif kind == "c_record":
                    c_record(event, stream)
                elif kind == "c60ff5f_mark":
                    c60.mark(i)
                elif kind == "clock_mark":
                    clock.mark(i)
                else:
                    clock._new_event().record()
                cpus.append(time.thread_time_ns() - cpu)
                if kind == "c60ff5f_mark" and i % 32 == 0:
                    c60.poll()
            torch.cuda.synchronize()
            line = {"kind": kind, "cpu_us_median": round(statistics.median(cpus) / 1e3, 2)}
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
