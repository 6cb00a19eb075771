"""One entry point for a trace's tables: TraceLens when wanted and importable, else built-in.

Owns: choosing the engine (`analysis.engine` in the config: auto | builtin | tracelens),
calling TraceLens safely (CSV output into a private temporary directory, so it never
writes beside the trace and never asks on stdin; its progress prints kept out of the
user's stdout and the Python warnings it raises (dozens per call, some with whole
events pretty-printed) kept out of the user's stderr: both go to this module's DEBUG
log), converting its DataFrames into distanom's types, and the CPU-only
fallback (`host_timeline`) for traces without GPU events.

Reads: one trace file. Hands on: a `TraceTables` (timeline + kernel_summary rows +
which engine and which kind of timeline) to the capture worker and the report, which
write it as `rank<R>.gpu_timeline.csv` / `rank<R>.kernel_summary.csv` / summary.json.
TraceLens is imported lazily and duck-typed; pandas is never imported here.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TextIO

from distanom.analysis.tables import (
    KERNEL_SUMMARY_COLUMNS,
    Timeline,
    gpu_timeline,
    host_timeline,
    jsonable,
    kernel_summary,
)
from distanom.analysis.trace_io import DEFAULT_MAX_BYTES, Trace, load_trace
from distanom.errors import AnalysisEngineError, TraceFormatError

__all__ = ["ENGINES", "TraceTables", "analyze_trace", "tables_from_trace", "tracelens_available"]

logger = logging.getLogger(__name__)

ENGINES = ("auto", "builtin", "tracelens")
"""Accepted values of `engine` (the config key `analysis.engine`)."""

EngineName = Literal["builtin", "tracelens"]
TimelineKind = Literal["gpu", "cpu"]

STEP_SPAN = re.compile(r"distanom step \d+")  # the step annotation every capture carries
_TRACELENS_MODULE = "TraceLens.Reporting.generate_perf_report_pytorch"
_TRACELENS_FUNCTION = "generate_perf_report_pytorch"
_NUMERIC_COLUMNS = frozenset(KERNEL_SUMMARY_COLUMNS[3:])


@dataclass(frozen=True)
class TraceTables:
    """The analysis of one trace file."""

    source: str
    """The trace file analysed."""
    timeline: Timeline
    """gpu_timeline (kind "gpu") or the host breakdown (kind "cpu"), in µs."""
    kernel_summary: list[dict[str, Any]] = field(default_factory=list)
    """kernel_summary rows (columns `KERNEL_SUMMARY_COLUMNS`, plus `Parent cpu_op` from
    TraceLens on traces with CPU ops); empty for kind "cpu"."""
    engine: EngineName = "builtin"
    """Who computed the tables."""
    kind: TimelineKind = "gpu"
    """"gpu": GPU events; "cpu": CPU-only trace, host spans (`host_timeline`)."""
    step_window_us: float | None = None
    """The step's host interval (its `distanom step N` annotation), None without one."""

    @property
    def outside_ops_ms(self) -> float | None:
        """The part of the step window the timeline does not cover (ms): a stall before
        the first or after the last operation shows here, never in the timeline's idle."""
        if self.step_window_us is None:
            return None
        return max(0.0, self.step_window_us - self.timeline.total_time_us) / 1000

    def to_jsonable(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN and None both become null)."""
        result: dict[str, Any] = jsonable(
            {
                "source": self.source,
                "engine": self.engine,
                "kind": self.kind,
                "gpu_timeline": self.timeline.rows(),
                "kernel_summary": self.kernel_summary,
            }
        )
        return result


def tables_from_trace(trace: Trace) -> TraceTables:
    """Built-in tables of an already loaded trace: GPU tables when it has GPU events,
    else the host breakdown; `TraceFormatError` when it has neither."""
    if trace.gpu_events:
        timeline = gpu_timeline(trace)
        rows = kernel_summary(trace, timeline.total_time_us)
        return TraceTables(trace.source, timeline, rows, "builtin", "gpu")
    if not trace.host_events:
        raise TraceFormatError(
            f"{trace.source}: no GPU events (kernel/gpu_memcpy/gpu_memset) "
            "and no CPU spans (cpu_op/user_annotation)"
        )
    return TraceTables(trace.source, host_timeline(trace), [], "builtin", "cpu")


def analyze_trace(
    path: str | os.PathLike[str],
    engine: str = "auto",
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> TraceTables:
    """gpu_timeline and kernel_summary of one trace file.

    engine "builtin": distanom's implementation; "tracelens": TraceLens (an
    `AnalysisEngineError` when it is not importable or fails); "auto": TraceLens when
    importable (falling back to built-in, with a warning, if it fails), else built-in.
    A trace without GPU events but with CPU spans gets the built-in host breakdown
    (kind "cpu") whatever the engine, since TraceLens has no table for it. Bad files
    raise `TraceFormatError` (the trace is always loaded and checked by distanom first).
    """
    if engine not in ENGINES:
        raise AnalysisEngineError(
            f"unknown analysis engine {engine!r} (choose from {', '.join(ENGINES)})"
        )
    return tables_of(load_trace(path, max_bytes=max_bytes), path, engine)


def step_window_us(trace: Trace) -> float | None:
    """The duration of the trace's `distanom step N` annotation (µs), None without one."""
    for event in trace.host_events:
        if event.cat == "user_annotation" and STEP_SPAN.fullmatch(event.name):
            return event.dur
    return None


def tables_of(trace: Trace, path: str | os.PathLike[str], engine: str = "auto") -> TraceTables:
    """The tables of a trace already loaded from `path`, by `engine` (see `analyze_trace`),
    with the step window when the trace has one; TraceLens, when it runs, reads the file
    itself."""
    return replace(_tables_of(trace, path, engine), step_window_us=step_window_us(trace))


def _tables_of(trace: Trace, path: str | os.PathLike[str], engine: str) -> TraceTables:
    if engine == "tracelens" and (trace.gpu_events or trace.host_events):
        _import_tracelens(required=True)  # asked for by name: never a silent fallback
    if not trace.gpu_events or engine == "builtin":
        return tables_from_trace(trace)
    generate = _import_tracelens(required=engine == "tracelens")
    if generate is None:
        return tables_from_trace(trace)
    try:
        return _run_tracelens(generate, Path(path))
    except Exception as err:
        if engine == "tracelens":
            raise AnalysisEngineError(
                f"{os.fspath(path)}: TraceLens failed: {type(err).__name__}: {err}"
            ) from err
        logger.warning(
            "TraceLens failed on %s (%s: %s); using the built-in tables",
            os.fspath(path),
            type(err).__name__,
            err,
        )
        return tables_from_trace(trace)


def tracelens_available() -> bool:
    """Whether TraceLens's report function can be imported here."""
    return _import_tracelens(required=False) is not None


def _import_tracelens(*, required: bool) -> Callable[..., Any] | None:
    try:
        module = importlib.import_module(_TRACELENS_MODULE)
        function = getattr(module, _TRACELENS_FUNCTION, None)
        if not callable(function):
            function = getattr(importlib.import_module("TraceLens.Reporting"), _TRACELENS_FUNCTION)
        if not callable(function):
            raise ImportError(f"{_TRACELENS_MODULE}.{_TRACELENS_FUNCTION} is not callable")
    except Exception as err:
        if required:
            raise AnalysisEngineError(
                "analysis.engine is 'tracelens' but TraceLens cannot be imported "
                f"({type(err).__name__}: {err}); install it from "
                "https://github.com/AMD-AGI/TraceLens or use engine 'auto'/'builtin'"
            ) from err
        if not isinstance(err, ModuleNotFoundError):
            logger.warning("TraceLens is installed but cannot be imported: %s", err)
        return None
    result: Callable[..., Any] = function
    return result


class _ThreadStdout(io.TextIOBase):
    """sys.stdout stand-in: writes from one thread go to a buffer, all others pass through.

    `contextlib.redirect_stdout` swaps the process-wide sys.stdout; with this proxy the
    training script's own prints from other threads still reach the real stdout while
    TraceLens runs in a background worker.
    """

    def __init__(self, original: TextIO, sink: io.StringIO) -> None:
        super().__init__()
        self._original = original
        self._sink = sink
        self._thread = threading.get_ident()

    def write(self, text: str) -> int:
        if threading.get_ident() == self._thread:
            return self._sink.write(text)
        return self._original.write(text)

    def flush(self) -> None:
        self._original.flush()

    def writable(self) -> bool:
        return True


@contextlib.contextmanager
def _thread_warnings_to(sink: list[str]) -> Iterator[None]:
    """Warnings shown by this thread while inside are appended to `sink` as text instead
    of being printed to stderr; other threads' warnings are shown as before.

    Replaces `warnings.showwarning` (what `warnings.warn` calls once the filters let a
    warning through) rather than using `warnings.catch_warnings`, which would change the
    filters of every thread while TraceLens runs in a background worker.
    """
    original = warnings.showwarning
    thread = threading.get_ident()

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if threading.get_ident() == thread:
            sink.append(f"{filename}:{lineno}: {category.__name__}: {message}")
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:  # unless someone replaced it meanwhile
            warnings.showwarning = original


def _tracelens_input(path: Path, workdir: Path) -> Path:
    """A path TraceLens accepts: it picks the format by suffix (.json / .json.gz)."""
    with path.open("rb") as handle:
        is_gzip = handle.read(2) == b"\x1f\x8b"
    suffix = ".json.gz" if is_gzip else ".json"
    if path.name.endswith(suffix):
        return path
    alias = workdir / f"trace{suffix}"
    try:
        alias.symlink_to(path.resolve())
    except OSError:
        shutil.copyfile(path, alias)
    return alias


def _run_tracelens(generate: Callable[..., Any], path: Path) -> TraceTables:
    captured = io.StringIO()
    shown: list[str] = []
    with tempfile.TemporaryDirectory(prefix="distanom-tracelens-") as tmp:
        workdir = Path(tmp)
        source = _tracelens_input(path, workdir)
        out_dir = workdir / "csv"
        out_dir.mkdir()
        proxy = _ThreadStdout(sys.stdout, captured)
        with contextlib.redirect_stdout(proxy), _thread_warnings_to(shown):
            result = generate(
                profile_json_path=str(source),
                include_unlinked_kernels=True,
                kernel_summary=True,
                output_csvs_dir=str(out_dir),
            )
    if captured.getvalue():
        logger.debug("TraceLens output for %s:\n%s", path, captured.getvalue().rstrip())
    if shown:
        logger.debug("TraceLens warnings for %s:\n%s", path, "\n".join(shown))
    if not isinstance(result, Mapping) or result.get("gpu_timeline") is None:
        raise ValueError(f"unexpected TraceLens result {type(result).__name__}")
    timeline = _timeline_from_records(_records(result["gpu_timeline"]))
    sheet = result.get("kernel_summary")
    rows = [] if sheet is None else [_kernel_row(r) for r in _records(sheet)]
    return TraceTables(os.fspath(path), timeline, rows, "tracelens", "gpu")


def _records(frame: Any) -> list[dict[str, Any]]:
    """DataFrame-like → list of row dicts (pandas' `to_dict(orient="records")`)."""
    records = frame.to_dict(orient="records")
    return [dict(r) for r in records]


def _native(value: Any) -> Any:
    """numpy scalar → Python scalar; other values unchanged."""
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (str, bytes)):
        return item()
    return value


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _timeline_from_records(records: list[dict[str, Any]]) -> Timeline:
    values: dict[str, float] = {}
    for record in records:
        row = _native(record.get("type"))
        ms = _native(record.get("time ms"))
        if isinstance(row, str) and isinstance(ms, (int, float)):
            values[row] = float(ms) * 1000
    try:
        return Timeline.from_us(values)
    except KeyError as err:
        raise ValueError(f"TraceLens gpu_timeline lacks rows: {err}") from None


def _kernel_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """A TraceLens kernel_summary record in `kernel_summary`'s types: stream int or None,
    count int, other numbers float (NaN kept), text columns str or None."""
    row: dict[str, Any] = {}
    for column, raw in record.items():
        value = _native(raw)
        if column == "Kernel stream":
            value = None if _is_missing(value) else int(value)
        elif column in _NUMERIC_COLUMNS:
            if column.endswith("_count"):
                value = int(value)
            else:
                value = math.nan if value is None else float(value)
        elif _is_missing(value):
            value = None
        row[str(column)] = value
    return row
