"""What each CUDA event call costs the training thread, inside a real loop.

    python3 bench/probes/event_clock_probe.py --out $OUT/event_clock.json [--steps 400]

The step clock (distanom/clock.py) records a timing event per step and reads durations
with `query()` and `elapsed_time()`. On the H200 VM the clock alone measured 65-90 us of
CPU per step (bench/results/boundary_probe_h200_1e073eb.json), far above what these
calls cost on bare metal. This probe runs the seed's ResNet18 loop and, per block, makes
one kind of call once per step, timing each call's wall clock and the thread's CPU time:

- `current_stream`: `torch.cuda.current_stream()`
- `record`: `Event(enable_timing=True).record()` (events reused from a pool)
- `record_no_timing`: the same with `enable_timing=False`
- `query_done`: `query()` of an event recorded 64 steps earlier (long complete)
- `query_recent`: `query()` of the event recorded at the previous step
- `elapsed_done`: `elapsed_time()` between two events recorded 64 and 63 steps earlier
- `synchronize_done`: `synchronize()` of an event recorded 64 steps earlier

Every block records a timing event per step (so the queried events exist), except
`none`. Per block: ms per step, and per call median and mean wall / CPU microseconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "workloads"))

from loops import build_loop  # noqa: E402

KINDS = [
    "none",
    "record",
    "current_stream",
    "record_no_timing",
    "query_done",
    "query_recent",
    "elapsed_done",
    "synchronize_done",
]
AGE = 64


def block(kind: str, loop: Any, steps: int) -> dict[str, Any]:
    events = [torch.cuda.Event(enable_timing=True) for _ in range(AGE + 2)]
    plain = torch.cuda.Event(enable_timing=False)
    walls: list[int] = []
    cpus: list[int] = []
    for i in range(AGE + 2):  # fill the ring
        loop.step()
        events[i % len(events)].record()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(AGE + 2, AGE + 2 + steps):
        loop.step()
        n = len(events)
        this = events[i % n]
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        if kind == "record":
            this.record()
        elif kind == "current_stream":
            torch.cuda.current_stream()
        elif kind == "record_no_timing":
            plain.record()
        elif kind == "query_done":
            events[(i - AGE) % n].query()
        elif kind == "query_recent":
            events[(i - 1) % n].query()
        elif kind == "elapsed_done":
            events[(i - AGE) % n].elapsed_time(events[(i - AGE + 1) % n])
        elif kind == "synchronize_done":
            events[(i - AGE) % n].synchronize()
        cpu_ns, wall_ns = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
        if kind not in ("none", "record"):
            this.record()
        walls.append(wall_ns)
        cpus.append(cpu_ns)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - started) * 1000 / steps
    return {
        "kind": kind,
        "ms_per_step": round(ms, 4),
        "wall_us_median": round(statistics.median(walls) / 1e3, 2),
        "wall_us_mean": round(statistics.fmean(walls) / 1e3, 2),
        "cpu_us_median": round(statistics.median(cpus) / 1e3, 2),
        "cpu_us_mean": round(statistics.fmean(cpus) / 1e3, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", default="resnet18")
    args = parser.parse_args()
    out: dict[str, Any] = {
        "facts": {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0),
            "python": platform.python_version(),
        },
        "workloads": {},
    }
    for workload in args.workloads.split(","):
        loop = build_loop(workload, "cuda:0", small=False)
        for _ in range(50):
            loop.step()
        rows = []
        for _ in range(args.repeats):
            for kind in KINDS:
                rows.append(block(kind, loop, args.steps))
                print(workload, json.dumps(rows[-1]), flush=True)
        out["workloads"][workload] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
