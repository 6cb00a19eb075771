"""Where does a duty-cycle switch of the cupti backend spend its time?

    python3 bench/probes/cupti_switch_cost_probe.py --cycles 30 --out "$OUT"

Device probe for the overhead governor (issue 4). The 1% budget on the launch-bound
ResNet18 step measured several percent in-process (bench/overhead.py budget blocks)
while the governor, which compares median step times of traced and untraced windows,
estimated under 1%. A median ignores a cost paid once per window, so this probe looks at
the switches themselves. One process, CuptiTracer driven as the agent drives it (switch
at the boundary just marked), cycles of `window` traced steps then `window` untraced
steps. Recorded:

- per step: host time from the end of one boundary (switch included) to the end of the
  next, by position in the cycle: position k < `window` is traced; the detach runs at
  the end of position `window - 1`, the attach at the end of the last position;
- per CUPTI call made by a switch: its duration (subscriber check, register, enable,
  disable, forced flush, finalize, the synchronize before the detach);
- odd cycles skip the subscriber check on re-attach, to see its share.

Writes cupti_switch_cost_probe.json under --out, a summary on stdout.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()

    import torch
    from overhead import _tracer_config, build_workload

    from distanom.tracers.cupti import CuptiTracer

    work = build_workload("resnet18", 10)
    for _ in range(args.warmup):
        work.step(0)
    torch.cuda.synchronize()

    tracer = CuptiTracer(_tracer_config(None), rank=0)
    tracer.mark_step(0, time.time_ns())
    tracer.start()
    session = tracer._session
    assert session is not None
    lib = session.lib
    calls: dict[str, list[float]] = collections.defaultdict(list)
    skip_check = {"on": False}

    def timed(owner: Any, name: str, label: str, skippable: bool = False) -> None:
        inner = getattr(owner, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            if skippable and skip_check["on"]:
                return None
            t0 = time.perf_counter_ns()
            try:
                return inner(*a, **kw)
            finally:
                calls[label].append((time.perf_counter_ns() - t0) / 1e6)

        setattr(owner, name, wrapper)

    timed(lib, "subscriber_check", "subscriber_check", skippable=True)
    timed(lib, "register_callbacks", "register_callbacks")
    timed(lib, "finalize", "finalize")
    timed(session, "enable", "enable")
    timed(session, "disable", "disable")
    timed(session, "flush", "flush")
    sync = torch.cuda.synchronize
    timed(torch.cuda, "synchronize", "synchronize")

    step = 1
    period = 2 * args.window
    times: dict[bool, list[list[float]]] = {False: [], True: []}  # by skip_check
    last = time.perf_counter()
    for cycle in range(args.cycles):
        skip_check["on"] = cycle % 2 == 1
        row: list[float] = []
        for pos in range(period):
            work.step(0)
            tracer.mark_step(step, time.time_ns())
            # the next step is traced in the first half of the cycle (after wrap-around)
            nxt = (pos + 1) % period < args.window
            tracer.set_tracing(nxt)
            now = time.perf_counter()
            row.append((now - last) * 1000.0)
            last = now
            step += 1
        times[skip_check["on"]].append(row)
    sync()
    stats = tracer.stats()
    tracer.close()

    # the first cycle starts from the state start() left: left out
    def by_position(rows: list[list[float]]) -> list[float]:
        return [statistics.mean(r[k] for r in rows[1:]) for k in range(period)]

    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "window": args.window,
        "cycles": args.cycles,
        "calls_ms": {
            k: {
                "n": len(v),
                "median": round(statistics.median(v), 4),
                "mean": round(statistics.mean(v), 4),
                "max": round(max(v), 4),
            }
            for k, v in calls.items()
        },
        "tracer_stats": {
            k: stats[k]
            for k in ("enables", "detaches", "toggle_ns_total", "toggle_ns_max", "markers_launched")
            if k in stats
        },
    }
    for skip, rows in times.items():
        pos = by_position(rows)
        w = args.window
        traced_steady = statistics.median(pos[2 : w - 1])
        untraced_steady = statistics.median(pos[w + 2 : period - 1])
        cycle_total = sum(pos)
        summary["skip_subscriber_check" if skip else "with_subscriber_check"] = {
            "mean_ms_by_position": [round(x, 4) for x in pos],
            "traced_steady_ms": round(traced_steady, 4),
            "untraced_steady_ms": round(untraced_steady, 4),
            "cycle_ms": round(cycle_total, 3),
            "cycle_excess_ms": round(cycle_total - period * untraced_steady, 3),
            "excess_by_part_ms": {
                "traced_steps_at_steady_cost": round(w * (traced_steady - untraced_steady), 3),
                "rest (switch steps, first steps)": round(
                    cycle_total - period * untraced_steady - w * (traced_steady - untraced_steady),
                    3,
                ),
            },
        }
    out = Path(args.out) / "cupti_switch_cost_probe.json"
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
