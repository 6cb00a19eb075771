"""Correctness demo of the cupti backend on a real training loop (device machine).

    python3 bench/cupti_demo.py --out $OUT

ResNet18 (bf16, batch 5, SGD) for 60 steps under CuptiTracer, started at the end of the
first step as the agent does, with torch.cuda._sleep(10_000_000) (~5 ms of GPU time)
injected into step 40. Then, as the capture worker would, it fetches steps 39, 40, 41,
checks the sleep is in step 40 only, and writes step 40 as a Kineto-format chrome trace
($OUT/cupti_demo_step40.json.gz: open it in Perfetto) plus a JSON summary. Exit code 1
if a check fails.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from distanom.tracers.base import Availability, StepTrace
from distanom.tracers.cupti import CuptiTracer

INJECT_STEP = 40
STEPS = 60


def tracer_config() -> Any:
    fields = {"backend": "cupti", "history_steps": 32, "ring_mb": 256, "overhead_budget_pct": None}
    try:
        from distanom.config import TracerConfig

        return TracerConfig(**fields)
    except ImportError:  # no pydantic on the device image
        return SimpleNamespace(**fields)


def fetch(tracer: CuptiTracer, step: int) -> StepTrace:
    deadline = time.monotonic() + 10
    while True:
        state, why = tracer.explain(step)
        if state is Availability.READY:
            return tracer.step_trace(step)
        if state is Availability.GONE or time.monotonic() > deadline:
            raise SystemExit(f"step {step}: {state.value} ({why})")
        time.sleep(0.005)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    import torchvision

    torch.manual_seed(0)
    bf16 = torch.bfloat16
    with torch.device("cuda"):
        model = torchvision.models.resnet18().to(bf16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(5, 3, 224, 224, device="cuda", dtype=bf16)
    y = torch.randn(5, 1000, device="cuda", dtype=bf16)

    def step(sleep: bool) -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if sleep:
            torch.cuda._sleep(10_000_000)
        opt.step()

    step(False)
    torch.cuda.synchronize()
    tracer = CuptiTracer(tracer_config(), rank=0)
    t0 = time.perf_counter()
    tracer.start()
    print(f"start(): {(time.perf_counter() - t0) * 1000:.0f} ms; calibration {tracer.calibration}")
    tracer.mark_step(0, time.time_ns())
    host_ms: dict[int, float] = {}
    mark_us: list[float] = []
    last = time.perf_counter()
    for i in range(1, STEPS + 1):
        step(i == INJECT_STEP)
        torch.cuda.synchronize()  # host step times for the printout only
        now = time.perf_counter()
        host_ms[i] = (now - last) * 1000
        last = now
        t = time.perf_counter_ns()
        tracer.mark_step(i, time.time_ns())
        mark_us.append((time.perf_counter_ns() - t) / 1000)
    torch.cuda.synchronize()

    traces = {s: fetch(tracer, s) for s in (INJECT_STEP - 1, INJECT_STEP, INJECT_STEP + 1)}
    failures: list[str] = []
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "mark_step_us": {"median": statistics.median(mark_us), "max": max(mark_us)},
        "median_host_step_ms": statistics.median(host_ms.values()),
        "steps": {},
    }
    for s, tr in traces.items():
        spans = [e for e in tr.events if e["ph"] == "X"]
        spin = [e for e in spans if "spin_kernel" in e["name"]]
        busy_ms = sum(e["dur"] for e in spans) / 1000
        window = tr.metadata["distanom"]["marker_gpu_ns"]
        summary["steps"][s] = {
            "host_ms": round(host_ms[s], 3),
            "gpu_busy_ms": round(busy_ms, 3),
            "marker_window_ms": round((window[1] - window[0]) / 1e6, 3),
            "events_by_cat": {
                c: sum(1 for e in spans if e["cat"] == c) for c in {e["cat"] for e in spans}
            },
            "spin_kernels": len(spin),
            "spin_ms": round(spin[0]["dur"] / 1000, 3) if spin else None,
            "stats": tr.stats,
        }
        print(f"step {s}: {json.dumps(summary['steps'][s])}")
        want = 1 if s == INJECT_STEP else 0
        if len(spin) != want:
            failures.append(f"step {s}: {len(spin)} spin kernels, expected {want}")
        if tr.stats["marker_verified"] != 1 or tr.stats["zero_timestamp_dropped"]:
            failures.append(f"step {s}: stats {tr.stats}")
        for e in spans:
            start = tr.base_time_ns + round(e["ts"] * 1000)
            if not window[0] - 1000 <= start <= window[1] + 1000 and e["cat"] == "kernel":
                failures.append(f"step {s}: kernel {e['name'][:60]} starts outside its markers")
                break
    t40 = traces[INJECT_STEP]
    doc = {
        "schemaVersion": 1,
        "deviceProperties": t40.metadata.get("deviceProperties", []),
        "distributedInfo": {"backend": "none", "rank": 0, "world_size": 1},
        "baseTimeNanoseconds": t40.base_time_ns,
        "distanom": t40.metadata.get("distanom"),
        "traceEvents": t40.events,
    }
    trace_path = out / f"cupti_demo_step{INJECT_STEP}.json.gz"
    with gzip.open(trace_path, "wt") as fh:
        json.dump(doc, fh)
    with gzip.open(trace_path, "rt") as fh:
        json.load(fh)  # round-trips as JSON
    summary["tracer_stats"] = tracer.stats()
    tracer.close()
    summary["failures"] = failures
    (out / "cupti_demo_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(
        f"mark_step: median {summary['mark_step_us']['median']:.1f} µs, max {max(mark_us):.1f} µs"
    )
    print(f"tracer stats: {summary['tracer_stats']}")
    print(f"wrote {trace_path} and {out / 'cupti_demo_summary.json'}")
    print("DEMO " + ("FAILED: " + "; ".join(failures) if failures else "OK"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
