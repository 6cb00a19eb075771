"""The kineto backend on a real GPU (skipped without CUDA): steps cut out of windows.

Run on the device machine (`python3 -m pytest tests/gpu -q -m gpu -s`). A failing test
prints, per window export, where its host launch calls and kernels lie against the
step boundaries, which is what the cut depends on.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

REPO = Path(__file__).resolve().parents[2]

# Each scenario runs in its own process: torch.profiler and CUPTI keep process state.
SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    sys.path.insert(0, {repo!r})
    from distanom.config import TracerConfig
    from distanom.tracers.base import Availability
    from distanom.tracers.kineto import KinetoTracer

    window = int(sys.argv[1])
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512, device="cuda")
    tracer = KinetoTracer(TracerConfig(kineto_window_steps=window, history_steps=40), use_cuda=True)
    for step in range(30):
        model(x).sum().backward()
        if step == 17:
            torch.cuda._sleep(20_000_000)
        opt.step()
        opt.zero_grad()
        tracer.mark_step(step, time.time_ns())
        if step == 0:
            tracer.start()
    tracer.set_tracing(False)
    torch.cuda.synchronize()
    out = {{}}
    for step in range(2, 29):
        if tracer.availability(step) is not Availability.READY:
            out[step] = None
            continue
        trace = tracer.step_trace(step)
        kernels = [e["name"] for e in trace.events if e.get("cat") == "kernel"]
        out[step] = {{"kernels": len(kernels), "spins": sum("spin_kernel" in k for k in kernels),
                     "stats": trace.stats}}
    diagnosis = []
    for w in tracer._windows:
        doc = w.document
        if doc is None:
            from distanom.tracers.kineto import _load
            doc = _load(w, tracer._scratch())
        base = doc.get("baseTimeNanoseconds", 0)
        def span(cat):
            ts = [base + e["ts"] * 1000 for e in doc["traceEvents"] if e.get("cat") == cat]
            return (min(ts), max(ts), len(ts)) if ts else None
        diagnosis.append({{"steps": [w.first_step, w.last_step],
                          "runtime": span("cuda_runtime"), "kernel": span("kernel")}})
    bounds = {{s: b[0] for s, b in tracer._boundaries.items()}}
    print(json.dumps({{"steps": out, "windows": diagnosis, "bounds": bounds}}))
    tracer.close()
    """
)


@pytest.mark.parametrize("window", [1, 4])
def test_each_step_holds_its_own_kernels(window: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(repo=str(REPO)), str(window)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=None)[:6000])
    steps = {int(k): v for k, v in result["steps"].items()}
    ready = {s: v for s, v in steps.items() if v is not None}
    assert len(ready) >= 20, f"only {sorted(ready)} ready"
    assert ready[17]["spins"] == 1
    assert all(v["spins"] == 0 for s, v in ready.items() if s != 17)
    counts = [v["kernels"] - v["spins"] for v in ready.values()]
    assert max(counts) == min(counts) > 0, counts  # every step launches the same kernels
