"""Where does the cupti backend's per-step cost go beyond raw CUPTI's?

    python3 bench/probes/cupti_tracer_cost_probe.py --out "$OUT"

Device probe (issue 4). In one process, on the launch-bound ResNet18 step (bf16,
batch 5), windows of 8 steps alternate "on" and "off" in pairs (order alternating), each
window timed between two synchronizes, switches done on an untimed step. Phases:

- tracer:      CuptiTracer.set_tracing on / off (CUPTI attached + markers / detached);
- raw:         the same ActivitySession attached / detached by hand, no mark_step at all;
- marks_only:  CUPTI detached throughout; "on" windows launch the step marker and record
               the lag-probe event per step (mark_step's GPU work without CUPTI);
- no_probe:    as `tracer`, with the lag probe (CUDA event per step) switched off;
- tracer again, last, to see drift.

Reports per phase the median on/off ratio, and the median mark_step time in on windows.
Writes cupti_tracer_cost_probe.json under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PAIRS, WINDOW = 12, 8


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cupti_attach_probe import build_step

    from distanom.tracers.cupti import CuptiTracer

    step_fn = build_step()
    for _ in range(20):
        step_fn()
    torch.cuda.synchronize()
    cfg = SimpleNamespace(history_steps=16, ring_mb=256, overhead_budget_pct=None)
    tracer = CuptiTracer(cfg, rank=0)  # type: ignore[arg-type]
    tracer.start()
    counter = {"step": 0}
    mark_ns: list[int] = []

    def marked() -> None:
        step_fn()
        t0 = time.perf_counter_ns()
        tracer.mark_step(counter["step"], time.time_ns())
        mark_ns.append(time.perf_counter_ns() - t0)
        counter["step"] += 1

    def window(fn: Any) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(WINDOW):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1000 / WINDOW

    def ab(name: str, switch: Any, on_fn: Any, off_fn: Any) -> dict[str, Any]:
        ratios: list[float] = []
        mark_ns.clear()
        for p in range(PAIRS):
            got: dict[bool, float] = {}
            for on in (True, False) if p % 2 == 0 else (False, True):
                switch(on)
                (on_fn if on else off_fn)()  # untimed step after the switch
                n0 = len(mark_ns)
                got[on] = window(on_fn if on else off_fn)
                if not on:
                    del mark_ns[n0:]
            ratios.append(got[True] / got[False])
        out = {
            "phase": name,
            "ratio_median": round(statistics.median(ratios), 4),
            "ratios": [round(r, 4) for r in ratios],
            "mark_step_us_median": round(statistics.median(mark_ns) / 1000, 1) if mark_ns else None,
        }
        print(json.dumps(out), flush=True)
        return out

    def per_call_us(fn: Any, n: int = 2000) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        took = (time.perf_counter_ns() - t0) / n / 1000
        torch.cuda.synchronize()
        return round(took, 2)

    from distanom.tracers.cupti.marker import DriverMarker, JiteratorMarker

    driver, jit = DriverMarker(torch, 16), JiteratorMarker(torch, 16)
    event = torch.cuda.Event()
    ops_us = {
        "driver_marker_launch": per_call_us(lambda: driver.launch(3)),
        "jiterator_marker_launch": per_call_us(lambda: jit.launch(3)),
        "event_record": per_call_us(event.record),
        "event_query": per_call_us(event.query),
        "current_stream_handle": per_call_us(lambda: torch.cuda.current_stream().cuda_stream),
        "time_ns_x2": per_call_us(lambda: (time.time_ns(), time.monotonic_ns())),
    }
    print(json.dumps({"ops_us_cupti_attached": ops_us}), flush=True)
    driver.close()
    jit.close()

    phases: list[dict[str, Any]] = []
    phases.append(ab("tracer", tracer.set_tracing, marked, marked))
    tracer.set_tracing(False)
    session = tracer._session
    assert session is not None

    def raw_switch(on: bool) -> None:
        if on:
            session.attach()
        else:
            torch.cuda.synchronize()
            session.detach()

    phases.append(ab("raw", raw_switch, step_fn, step_fn))
    raw_switch(False)

    def marks_only() -> None:
        step_fn()
        t0 = time.perf_counter_ns()
        code = counter["step"] % 16
        assert tracer._marker is not None
        tracer._marker.launch(code)
        tracer._events[counter["step"] % len(tracer._events)].record()
        tracer._events[(counter["step"] + 20) % len(tracer._events)].query()
        mark_ns.append(time.perf_counter_ns() - t0)
        counter["step"] += 1

    phases.append(ab("marks_only", lambda on: None, marks_only, step_fn))
    tracer.mark_step(counter["step"], time.time_ns())  # keep the tracer's steps increasing
    counter["step"] += 1
    probe = tracer._probe_lag
    tracer._probe_lag = lambda step: None  # type: ignore[method-assign]
    phases.append(ab("no_probe", tracer.set_tracing, marked, marked))
    tracer._probe_lag = probe  # type: ignore[method-assign]
    phases.append(ab("tracer_again", tracer.set_tracing, marked, marked))
    tracer.close()
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "pairs": PAIRS,
        "window_steps": WINDOW,
        "ops_us_cupti_attached": ops_us,
        "marker": tracer.calibration.marker if tracer.calibration else None,
        "phases": phases,
        "tracer_stats": tracer.stats(),
    }
    out = Path(args.out) / "cupti_tracer_cost_probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
