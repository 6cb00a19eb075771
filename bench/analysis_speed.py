"""Benchmark of the built-in analysis: load a trace + gpu_timeline + kernel_summary.

Owns: timing `distanom.analysis.engine.analyze_trace(path, "builtin")` (load, checks,
both tables; the host timeline for CPU-only traces) on every trace in tests/data and on
a synthetic 16-step CUDA-only trace of ~40k events that it generates (Kineto layout:
per kernel a runtime launch, an ac2g flow pair and the kernel; NCCL kernels on a second
stream, memcpy and memset). Also times a cold process (interpreter start + import +
analysis of the H200 fixture), the figure comparable to TraceLens's ~0.67 s.

Writes bench/results/analysis_speed.json (machine info + per-file medians) and prints a
table. Run: `python bench/analysis_speed.py [--runs N] [--out PATH]`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distanom.analysis.engine import analyze_trace  # noqa: E402
from distanom.analysis.tables import gpu_timeline, kernel_summary  # noqa: E402
from distanom.analysis.trace_io import load_trace, read_trace_document  # noqa: E402

DATA = ROOT / "tests" / "data"
DEFAULT_OUT = ROOT / "bench" / "results" / "analysis_speed.json"

# TraceLens's own timings, as measured for the issue (seconds, whole call).
TRACELENS_REFERENCE = {
    "h200_2.5k_events_s": 0.67,
    "h200_import_share_s": 0.4,
    "13.6k_events_s": 1.0,
}

_KERNELS = [
    "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float>>",
    "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT",
    "void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16, float>",
    "void at::native::batch_norm_backward_kernel<c10::BFloat16, float, int>",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>",
]


def synthetic_trace(steps: int = 16, events_per_step: int = 2500, seed: int = 0) -> dict[str, Any]:
    """A CUDA-only Kineto-like trace: `steps` steps of about `events_per_step` events."""
    rng = random.Random(seed)
    events: list[dict[str, Any]] = []
    t = 1_000_000.0
    corr = 1
    per_step_kernels = events_per_step // 4
    for _ in range(steps):
        host_t = t
        gpu_t = t + 50.0
        for i in range(per_step_kernels):
            nccl = i % 50 == 49
            memcpy = i % 97 == 0
            memset = i % 89 == 0
            stream = 13 if nccl else 7
            cat = "gpu_memcpy" if memcpy else "gpu_memset" if memset else "kernel"
            name = (
                "Memcpy HtoD (Pageable -> Device)"
                if memcpy
                else "Memset (Device)"
                if memset
                else "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
                if nccl
                else rng.choice(_KERNELS)
            )
            launcher = (
                "cudaMemcpyAsync" if memcpy else "cudaMemsetAsync" if memset else "cudaLaunchKernel"
            )
            dur = round(rng.uniform(1.5, 60.0), 3)
            start = round(max(gpu_t, host_t + 5.0), 3)
            events.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": launcher,
                    "pid": 4242,
                    "tid": 4242,
                    "ts": round(host_t, 3),
                    "dur": 4.2,
                    "args": {"cbid": 211, "correlation": corr},
                }
            )
            events.append(
                {
                    "ph": "s",
                    "id": corr,
                    "pid": 4242,
                    "tid": 4242,
                    "ts": round(host_t, 3),
                    "cat": "ac2g",
                    "name": "ac2g",
                }
            )
            events.append(
                {
                    "ph": "f",
                    "id": corr,
                    "pid": 0,
                    "tid": stream,
                    "ts": start,
                    "cat": "ac2g",
                    "name": "ac2g",
                    "bp": "e",
                }
            )
            args: dict[str, Any] = {
                "device": 0,
                "context": 1,
                "stream": stream,
                "correlation": corr,
            }
            if cat == "kernel":
                args.update(
                    {
                        "queued": 0,
                        "registers per thread": 32,
                        "shared memory": 2112,
                        "blocks per SM": 59.4,
                        "warps per SM": 475.2,
                        "grid": [1568, 1, 5],
                        "block": [256, 1, 1],
                        "est. achieved occupancy %": 100,
                    }
                )
            events.append(
                {
                    "ph": "X",
                    "cat": cat,
                    "name": name,
                    "pid": 0,
                    "tid": stream,
                    "ts": start,
                    "dur": dur,
                    "args": args,
                }
            )
            host_t += rng.uniform(3.0, 9.0)
            if not nccl:
                gpu_t = start + dur + rng.uniform(0.5, 3.0)
            corr += 1
        t = max(host_t, gpu_t) + 500.0
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": "synthetic"}],
        "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2},
        "baseTimeNanoseconds": 1_700_000_000_000_000_000,
        "traceEvents": events,
    }


def _median_time(fn: Any, runs: int) -> tuple[float, float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def measure(path: Path, runs: int) -> dict[str, Any]:
    """Median/min seconds of analyze_trace(builtin), and of its load and table parts."""
    doc = read_trace_document(path)
    n_events = len(doc["traceEvents"])
    del doc
    analyze_trace(path, "builtin")  # warm the page cache and imports
    total, fastest = _median_time(lambda: analyze_trace(path, "builtin"), runs)
    load, _ = _median_time(lambda: load_trace(path), runs)
    trace = load_trace(path)
    kind = "gpu" if trace.gpu_events else "cpu"

    def both_tables() -> None:
        timeline = gpu_timeline(trace)
        kernel_summary(trace, timeline.total_time_us)

    tables = _median_time(both_tables, runs)[0] if kind == "gpu" else None
    return {
        "file": path.name,
        "bytes": path.stat().st_size,
        "events": n_events,
        "gpu_events": len(trace.gpu_events),
        "kind": kind,
        "runs": runs,
        "analyze_median_s": total,
        "analyze_min_s": fastest,
        "load_median_s": load,
        "tables_median_s": tables,
    }


def cold_process(path: Path, runs: int) -> dict[str, float]:
    """Fresh interpreters importing distanom and analysing `path`: median wall seconds of
    the whole process, and of import + analysis as timed inside it (what TraceLens's
    0.67 s measures: its call including its 0.4 s import)."""
    code = (
        "import sys, time; t = time.perf_counter(); sys.path.insert(0, sys.argv[1]);"
        "from distanom.analysis.engine import analyze_trace;"
        "analyze_trace(sys.argv[2], 'builtin'); print(time.perf_counter() - t)"
    )
    walls, inside = [], []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", code, str(ROOT), str(path)],
            check=True,
            capture_output=True,
            text=True,
        )
        walls.append(time.perf_counter() - start)
        inside.append(float(done.stdout))
    return {
        "process_wall_median_s": statistics.median(walls),
        "import_and_analysis_median_s": statistics.median(inside),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per file (median)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    args = parser.parse_args(argv)

    results = [measure(p, args.runs) for p in sorted(DATA.glob("*.json.gz"))]
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = Path(tmp) / "synthetic_16step_40k.json.gz"
        with gzip.open(synthetic, "wt", encoding="utf-8", compresslevel=6) as handle:
            json.dump(synthetic_trace(), handle)
        results.append(measure(synthetic, args.runs))
    h200 = DATA / "h200_resnet18_b5_anomalous_step.json.gz"
    cold = cold_process(h200, args.runs)
    h200_row = next(r for r in results if r["file"] == h200.name)

    report = {
        "benchmark": "analyze_trace(path, 'builtin'): load + gpu_timeline + kernel_summary",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
        },
        "runs_per_file": args.runs,
        "files": results,
        "cold_process_h200": cold,
        "tracelens_reference_s": TRACELENS_REFERENCE,
        "speedup_vs_tracelens_h200": {
            "warm": TRACELENS_REFERENCE["h200_2.5k_events_s"] / h200_row["analyze_median_s"],
            "import_and_analysis": TRACELENS_REFERENCE["h200_2.5k_events_s"]
            / cold["import_and_analysis_median_s"],
            "process_wall": TRACELENS_REFERENCE["h200_2.5k_events_s"]
            / cold["process_wall_median_s"],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    print(
        f"{'file':42} {'events':>7} {'gpu ev':>7} {'kind':>4} {'median ms':>10} "
        f"{'load ms':>8} {'tables ms':>9}"
    )
    for r in results:
        tables = "-" if r["tables_median_s"] is None else f"{r['tables_median_s'] * 1e3:.1f}"
        print(
            f"{r['file']:42} {r['events']:>7} {r['gpu_events']:>7} {r['kind']:>4} "
            f"{r['analyze_median_s'] * 1e3:>10.1f} {r['load_median_s'] * 1e3:>8.1f} "
            f"{tables:>9}"
        )
    speed = report["speedup_vs_tracelens_h200"]
    inside = cold["import_and_analysis_median_s"]
    print(
        f"fresh process, H200: import + analysis {inside * 1e3:.0f} ms, "
        f"whole process {cold['process_wall_median_s'] * 1e3:.0f} ms"
    )
    print(
        f"vs TraceLens 0.67 s on H200: {speed['warm']:.0f}x warm, "
        f"{speed['import_and_analysis']:.1f}x import + analysis, "
        f"{speed['process_wall']:.1f}x whole process"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
