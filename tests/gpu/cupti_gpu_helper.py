"""Subprocess side of tests/gpu/test_cupti_gpu.py: runs that need a fresh CUDA process.

CUPTI state is process-wide, so comparing distanom's records with Kineto's, or trying
the backend after torch.profiler, each needs its own process. Prints one JSON object
on its last stdout line.

    python tests/gpu/cupti_gpu_helper.py --mode cupti|kineto|conflict|kineto_after --steps N
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from distanom.errors import TracerUnavailableError
from distanom.tracers.cupti import CuptiTracer, probe_cupti
from distanom.tracers.cupti.marker import MARKER_SOURCE, marker_length

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def tracer_config(**kw: Any) -> Any:
    fields = {"backend": "cupti", "history_steps": 16, "ring_mb": 256, "overhead_budget_pct": None}
    fields.update(kw)
    try:
        from distanom.config import TracerConfig

        return TracerConfig(**fields)
    except ImportError:  # no pydantic on the device image
        return SimpleNamespace(**fields)


class Work:
    """A small deterministic step: gemm, elementwise, reduction, H2D and D2H copies."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.x = torch.randn(256, 256, device="cuda")
        self.w = torch.randn(256, 256, device="cuda")
        self.host = torch.arange(1024, dtype=torch.float32)
        self.dev = torch.empty(1024, device="cuda")

    def step(self) -> float:
        self.dev.copy_(self.host)  # Memcpy HtoD (Pageable -> Device)
        y = torch.relu(self.x @ self.w) + self.dev[:256]
        z = torch.zeros(64, device="cuda")
        z += y[:64, 0]
        return float(y.sum().item())  # reduction + Memcpy DtoH


def fetch(tracer: CuptiTracer, step: int, timeout: float = 10.0) -> Any:
    """step_trace once READY: right after a synchronize CUPTI may still be completing."""
    from distanom.tracers.base import Availability

    deadline = time.monotonic() + timeout
    while True:
        state, why = tracer.explain(step)
        if state is Availability.READY:
            return tracer.step_trace(step)
        if state is Availability.GONE or time.monotonic() > deadline:
            raise RuntimeError(f"step {step}: {state.value} ({why}); {tracer.stats()}")
        time.sleep(0.01)


def run_cupti(steps: int) -> dict[str, Any]:
    work = Work()
    work.step()
    torch.cuda.synchronize()
    tracer = CuptiTracer(tracer_config(), rank=0)
    tracer.start()
    tracer.mark_step(0, time.time_ns())
    for s in range(1, steps + 1):
        work.step()
        tracer.mark_step(s, time.time_ns())
    torch.cuda.synchronize()
    out: dict[str, Any] = {"steps": {}, "stats": {}}
    for s in range(1, steps + 1):
        trace = fetch(tracer, s)
        out["steps"][str(s)] = [
            [e["cat"], e["name"]] for e in trace.events if e.get("cat") in GPU_CATS
        ]
        out["stats"][str(s)] = trace.stats
    tracer.close()
    return out


def run_kineto(steps: int) -> dict[str, Any]:
    from torch.cuda import jiterator
    from torch.profiler import ProfilerActivity, profile

    work = Work()
    marker = jiterator._create_jit_fn(MARKER_SOURCE)
    inputs = [torch.zeros(marker_length(c), dtype=torch.int32, device="cuda") for c in range(16)]
    for x in inputs:
        marker(x)
    work.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        marker(inputs[0])
        for s in range(1, steps + 1):
            work.step()
            marker(inputs[s % 16])
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    markers = sorted(
        e["args"]["correlation"] for e in gpu if e["name"].startswith("distanom_step_marker")
    )
    out: dict[str, Any] = {"steps": {}, "markers": len(markers)}
    for s in range(1, min(steps, len(markers) - 1) + 1):
        lo, hi = markers[s - 1], markers[s]
        sel = [e for e in gpu if lo < e["args"].get("correlation", -1) < hi]
        sel.sort(key=lambda e: e["ts"])
        out["steps"][str(s)] = [[e["cat"], e["name"]] for e in sel]
    return out


def run_conflict(steps: int) -> dict[str, Any]:
    """torch.profiler first, then distanom's backend in the same process."""
    from torch.profiler import ProfilerActivity, profile

    work = Work()
    with profile(activities=[ProfilerActivity.CUDA]):
        for _ in range(3):
            work.step()
        torch.cuda.synchronize()
    out: dict[str, Any] = {"probe": probe_cupti()}
    tracer = CuptiTracer(tracer_config(), rank=0)
    try:
        tracer.start()
    except TracerUnavailableError as err:
        out["start"] = f"unavailable: {err}"
        return out
    out["start"] = "ok"
    tracer.mark_step(0, time.time_ns())
    for s in range(1, steps + 1):
        work.step()
        tracer.mark_step(s, time.time_ns())
    torch.cuda.synchronize()
    out["kernels"] = [fetch(tracer, s).stats["kernels"] for s in range(1, steps + 1)]
    tracer.close()
    return out


def run_kineto_after(steps: int) -> dict[str, Any]:
    """distanom's backend started and closed, then torch.profiler must still work."""
    from torch.profiler import ProfilerActivity, profile

    work = Work()
    tracer = CuptiTracer(tracer_config(), rank=0)
    tracer.start()
    for s in range(steps):
        work.step()
        tracer.mark_step(s, time.time_ns())
    tracer.close()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            work.step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    return {"kineto_kernels": sum(1 for e in events if e.get("cat") == "kernel")}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode", required=True, choices=["cupti", "kineto", "conflict", "kineto_after"]
    )
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    runner = {
        "cupti": run_cupti,
        "kineto": run_kineto,
        "conflict": run_conflict,
        "kineto_after": run_kineto_after,
    }[args.mode]
    result = runner(args.steps)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
