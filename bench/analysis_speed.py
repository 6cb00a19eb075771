"""Benchmark of the built-in analysis (load a trace + gpu_timeline + kernel_summary),
side by side with TraceLens in the same run when TraceLens is importable.

Owns: timing `distanom.analysis.engine.analyze_trace(path, "builtin")` (load, checks,
both tables; the host timeline for CPU-only traces) on every trace in tests/data and on
a synthetic 16-step CUDA-only trace of ~40k events that it generates (Kineto layout:
per kernel a runtime launch, an ac2g flow pair and the kernel; NCCL kernels on a second
stream, memcpy and memset); fresh processes (interpreter start + import + analysis) per
file. When `TraceLens.Reporting.generate_perf_report_pytorch` is importable (and
`--no-tracelens` is not given), on every file with GPU events: TraceLens's whole call
(load + tables: `generate_perf_report_pytorch(profile_json_path=...,
include_unlinked_kernels=True, kernel_summary=True, output_csvs_dir=<temp dir>)`, its
stdout, warnings and log below ERROR suppressed) in process, and its import + call in
fresh processes, each paired with the same built-in measurement and taken in turns (a
shared VM's speed drifts by tens of percent within minutes; pairs keep the ratios
fair); its import alone in fresh processes; whether its gpu_timeline equals the
built-in one; and the per-file ratios TraceLens / built-in. The built-in-only block of
each file (the fields the file had before TraceLens was measured) is timed before
TraceLens (and pandas) are imported here.

Writes bench/results/analysis_speed.json (machine info, package versions, per-file
medians) and prints a table. Run: `python bench/analysis_speed.py [--runs N] [--out PATH]
[--tracelens-src CHECKOUT] [--no-tracelens]` (CHECKOUT: the TraceLens git checkout it
was installed from, to record its commit).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib
import importlib.metadata
import io
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distanom.analysis.engine import analyze_trace  # noqa: E402
from distanom.analysis.tables import TIMELINE_ROWS, gpu_timeline, kernel_summary  # noqa: E402
from distanom.analysis.trace_io import load_trace, read_trace_document  # noqa: E402

DATA = ROOT / "tests" / "data"
DEFAULT_OUT = ROOT / "bench" / "results" / "analysis_speed.json"

# TraceLens's timings as measured elsewhere for the issue (seconds): kept for the record;
# the figures to compare with are the ones this script measures side by side.
TRACELENS_REFERENCE = {
    "h200_2.5k_events_s": 0.67,
    "h200_import_share_s": 0.4,
    "13.6k_events_s": 1.0,
}

_TRACELENS_MODULE = "TraceLens.Reporting.generate_perf_report_pytorch"
_TRACELENS_FUNCTION = "generate_perf_report_pytorch"

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


def _fresh_once(code: str, argv: Sequence[str]) -> tuple[float, list[float]]:
    """Run `python -c code *argv` once: wall seconds of the whole process, and the numbers
    it prints (one line of space-separated floats)."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, *argv],
        check=True,
        capture_output=True,
        text=True,
    )
    return time.perf_counter() - start, [float(x) for x in done.stdout.split()]


def _fresh(code: str, argv: Sequence[str], runs: int) -> tuple[float, list[float]]:
    """`_fresh_once` `runs` times: median wall seconds, medians of the printed numbers."""
    walls: list[float] = []
    printed: list[list[float]] = []
    for _ in range(runs):
        wall, numbers = _fresh_once(code, argv)
        walls.append(wall)
        printed.append(numbers)
    return statistics.median(walls), [statistics.median(col) for col in zip(*printed, strict=True)]


_DISTANOM_FRESH = (
    "import sys, time; t = time.perf_counter(); sys.path.insert(0, sys.argv[1]);"
    "from distanom.analysis.engine import analyze_trace;"
    "i = time.perf_counter() - t;"
    "analyze_trace(sys.argv[2], 'builtin'); print(i, time.perf_counter() - t)"
)
_DISTANOM_IMPORT = (
    "import sys, time; t = time.perf_counter(); sys.path.insert(0, sys.argv[1]);"
    "from distanom.analysis.engine import analyze_trace; print(time.perf_counter() - t)"
)
# The harness's own stdlib imports and output suppression come before the clock starts.
_TRACELENS_FRESH = (
    "import contextlib, io, logging, sys, tempfile, time, warnings;"
    "warnings.simplefilter('ignore'); logging.getLogger('TraceLens').setLevel(logging.ERROR);"
    "t = time.perf_counter();"
    f"from {_TRACELENS_MODULE} import {_TRACELENS_FUNCTION} as generate;"
    "i = time.perf_counter() - t; out = io.StringIO()\n"
    "with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(out):\n"
    "    generate(profile_json_path=sys.argv[1], include_unlinked_kernels=True,"
    " kernel_summary=True, output_csvs_dir=d)\n"
    "print(i, time.perf_counter() - t)"
)
_TRACELENS_IMPORT = (
    "import time; t = time.perf_counter();"
    f"from {_TRACELENS_MODULE} import {_TRACELENS_FUNCTION};"
    "print(time.perf_counter() - t)"
)


def cold_process(path: Path, runs: int) -> dict[str, float]:
    """Fresh interpreters importing distanom and analysing `path`: median wall seconds of
    the whole process, and of import + analysis as timed inside it (the shape of
    TraceLens's fresh-process figure: its import + its call)."""
    wall, (imported, inside) = _fresh(_DISTANOM_FRESH, [str(ROOT), str(path)], runs)
    return {
        "process_wall_median_s": wall,
        "import_and_analysis_median_s": inside,
        "import_median_s": imported,
    }


def tracelens_function() -> Callable[..., Any] | None:
    """TraceLens's report function, or None when it is not importable here."""
    try:
        module = importlib.import_module(_TRACELENS_MODULE)
    except ImportError:
        return None
    function = getattr(module, _TRACELENS_FUNCTION, None)
    return function if callable(function) else None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def packages(tracelens_src: Path | None) -> dict[str, Any]:
    """Versions of what the timed code runs on (None: not installed here)."""
    info: dict[str, Any] = {
        name: _version(name)
        for name in ("TraceLens", "pandas", "numpy", "orjson", "openpyxl", "pydantic")
    }
    commit = None
    if tracelens_src is not None:
        done = subprocess.run(
            ["git", "-C", str(tracelens_src), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
        )
        commit = done.stdout.strip() or None
    info["TraceLens_commit"] = commit
    return info


def _call_tracelens(generate: Callable[..., Any], path: Path) -> Any:
    """One whole TraceLens call as a user would make it, output kept quiet."""
    with (
        tempfile.TemporaryDirectory(prefix="bench-tracelens-") as out_dir,
        contextlib.redirect_stdout(io.StringIO()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        return generate(
            profile_json_path=str(path),
            include_unlinked_kernels=True,
            kernel_summary=True,
            output_csvs_dir=out_dir,
        )


def _agreement(result: Any, path: Path) -> dict[str, Any]:
    """How TraceLens's tables compare with the built-in ones on `path`."""
    builtin = analyze_trace(path, "builtin")
    records = {r["type"]: r for r in result["gpu_timeline"].to_dict(orient="records")}
    worst = 0.0
    for row in TIMELINE_ROWS:
        theirs, mine = float(records[row]["time ms"]), builtin.timeline.ms(row)
        if theirs != mine:
            worst = max(worst, abs(theirs - mine) / max(abs(theirs), abs(mine)))
    sheet = result.get("kernel_summary")
    columns = [] if sheet is None else [str(c) for c in sheet.columns]
    return {
        "gpu_timeline_rows_equal": set(records) == set(TIMELINE_ROWS),
        "gpu_timeline_max_rel_diff": worst,
        "kernel_summary_rows": {
            "tracelens": 0 if sheet is None else len(sheet),
            "builtin": len(builtin.kernel_summary),
        },
        # GPU-only traces: the same table. With CPU ops TraceLens builds its call tree,
        # runs its perf models and splits kernel rows per parent cpu_op (more work, and
        # more sheets, than the built-in's GPU-only tables).
        "tracelens_path": "cpu_ops" if "Parent cpu_op" in columns else "gpu_only",
        "tracelens_sheets": len(result),
    }


def _paired(
    ours: Callable[[], tuple[float, ...]], theirs: Callable[[], tuple[float, ...]], runs: int
) -> tuple[list[float], list[float]]:
    """Medians of `runs` paired measurements, taken in turns (who goes first alternates),
    so that a machine getting slower or faster during the run shifts both alike."""
    mine: list[tuple[float, ...]] = []
    other: list[tuple[float, ...]] = []
    for i in range(runs):
        if i % 2:
            other.append(theirs())
            mine.append(ours())
        else:
            mine.append(ours())
            other.append(theirs())
    return (
        [statistics.median(col) for col in zip(*mine, strict=True)],
        [statistics.median(col) for col in zip(*other, strict=True)],
    )


def _timed(fn: Callable[[], Any]) -> Callable[[], tuple[float]]:
    def run() -> tuple[float]:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start,)

    return run


def _fresh_timed(code: str, argv: Sequence[str]) -> Callable[[], tuple[float, ...]]:
    def run() -> tuple[float, ...]:
        wall, numbers = _fresh_once(code, argv)
        return (wall, *numbers)

    return run


def measure_tracelens(generate: Callable[..., Any], path: Path, runs: int) -> dict[str, Any]:
    """TraceLens against the built-in analysis on `path`, in pairs taken in turns: the
    warm in-process call (after one warm-up of each), import + call in fresh processes;
    agreement of the tables; ratios TraceLens / built-in (how many times slower)."""
    result = _call_tracelens(generate, path)
    agreement = _agreement(result, path)
    del result
    (builtin_warm,), (warm,) = _paired(
        _timed(lambda: analyze_trace(path, "builtin")),
        _timed(lambda: _call_tracelens(generate, path)),
        runs,
    )
    (our_wall, our_import, our_inside), (wall, imported, inside) = _paired(
        _fresh_timed(_DISTANOM_FRESH, [str(ROOT), str(path)]),
        _fresh_timed(_TRACELENS_FRESH, [str(path)]),
        runs,
    )
    return {
        "call_median_s": warm,
        "builtin_paired_median_s": builtin_warm,
        "fresh_process": {
            "process_wall_median_s": wall,
            "import_and_call_median_s": inside,
            "import_median_s": imported,
        },
        "builtin_fresh_process_paired": {
            "process_wall_median_s": our_wall,
            "import_and_analysis_median_s": our_inside,
            "import_median_s": our_import,
        },
        "agreement": agreement,
        "ratio_tracelens_over_builtin": {
            "warm_in_process": warm / builtin_warm,
            "fresh_import_and_analysis": inside / our_inside,
            "fresh_process_wall": wall / our_wall,
        },
    }


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per file (median)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument(
        "--tracelens-src",
        type=Path,
        default=None,
        help="git checkout TraceLens was installed from (its commit is recorded)",
    )
    parser.add_argument(
        "--no-tracelens", action="store_true", help="time the built-in analysis only"
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        synthetic = Path(tmp) / "synthetic_16step_40k.json.gz"
        with gzip.open(synthetic, "wt", encoding="utf-8", compresslevel=6) as handle:
            json.dump(synthetic_trace(), handle)
        paths = [*sorted(DATA.glob("*.json.gz")), synthetic]
        # Built-in first, before TraceLens (and pandas) are imported into this process.
        results = [measure(p, args.runs) for p in paths]
        for path, row in zip(paths, results, strict=True):
            row["fresh_process"] = cold_process(path, args.runs)
        generate = None if args.no_tracelens else tracelens_function()
        tracelens: dict[str, Any] | None = None
        if generate is not None:
            logging.getLogger("TraceLens").setLevel(logging.ERROR)
            (_, ours_import), (_, import_only) = _paired(
                _fresh_timed(_DISTANOM_IMPORT, [str(ROOT)]),
                _fresh_timed(_TRACELENS_IMPORT, []),
                args.runs,
            )
            tracelens = {
                "call": f"{_TRACELENS_MODULE}.{_TRACELENS_FUNCTION}(profile_json_path=PATH, "
                "include_unlinked_kernels=True, kernel_summary=True, output_csvs_dir=TMPDIR)",
                "fresh_import_median_s": import_only,
                "distanom_fresh_import_median_s": ours_import,
            }
            for path, row in zip(paths, results, strict=True):
                if row["kind"] == "gpu":
                    row["tracelens"] = measure_tracelens(generate, path, args.runs)
                else:
                    row["tracelens"] = None
                    row["tracelens_skipped"] = (
                        "CPU-only trace: distanom gives its host breakdown whatever the "
                        "engine; TraceLens has no table for it"
                    )
    h200 = DATA / "h200_resnet18_b5_anomalous_step.json.gz"
    h200_row = next(r for r in results if r["file"] == h200.name)
    cold = dict(h200_row["fresh_process"])

    report: dict[str, Any] = {
        "benchmark": "analyze_trace(path, 'builtin'): load + gpu_timeline + kernel_summary"
        + ("; TraceLens's whole call on the same files, same run" if tracelens else ""),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "executable": sys.executable,
        },
        "packages": packages(args.tracelens_src),
        "runs_per_file": args.runs,
        "files": results,
        "cold_process_h200": cold,
        "tracelens_measured": tracelens,
        "tracelens_reference_s": TRACELENS_REFERENCE,
        "speedup_vs_tracelens_h200": {
            "basis": "tracelens_reference_s (measured elsewhere), not this run",
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
        f"{'file':40} {'events':>6} {'gpu ev':>6} {'kind':>4} {'median ms':>9} "
        f"{'load ms':>8} {'tables ms':>9} {'fresh ms':>8}"
    )
    for r in results:
        print(
            f"{r['file']:40} {r['events']:>6} {r['gpu_events']:>6} {r['kind']:>4} "
            f"{_fmt_ms(r['analyze_median_s']):>9} {_fmt_ms(r['load_median_s']):>8} "
            f"{_fmt_ms(r['tables_median_s']):>9} "
            f"{_fmt_ms(r['fresh_process']['import_and_analysis_median_s']):>8}"
        )
    if tracelens is None:
        print("TraceLens: not measured (not importable here, or --no-tracelens)")
    else:
        print(
            f"\nTraceLens {report['packages']['TraceLens']}, pandas "
            f"{report['packages']['pandas']}: fresh import "
            f"{tracelens['fresh_import_median_s'] * 1e3:.0f} ms "
            f"(distanom's: {tracelens['distanom_fresh_import_median_s'] * 1e3:.0f} ms)"
        )
        print(
            f"{'file':40} {'ours ms':>8} {'TL ms':>8} {'x warm':>6} {'ours fresh':>10} "
            f"{'TL fresh':>8} {'x fresh':>7} {'timeline diff':>13} {'TL path':>8}"
        )
        for r in results:
            tl = r.get("tracelens")
            if tl is None:
                continue
            ratio = tl["ratio_tracelens_over_builtin"]
            ours_fresh = tl["builtin_fresh_process_paired"]["import_and_analysis_median_s"]
            print(
                f"{r['file']:40} {_fmt_ms(tl['builtin_paired_median_s']):>8} "
                f"{_fmt_ms(tl['call_median_s']):>8} {ratio['warm_in_process']:>6.1f} "
                f"{_fmt_ms(ours_fresh):>10} "
                f"{_fmt_ms(tl['fresh_process']['import_and_call_median_s']):>8} "
                f"{ratio['fresh_import_and_analysis']:>7.1f} "
                f"{tl['agreement']['gpu_timeline_max_rel_diff']:>13.1e} "
                f"{tl['agreement']['tracelens_path']:>8}"
            )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
