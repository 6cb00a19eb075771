"""TraceLens-compatible `gpu_timeline` and `kernel_summary` tables, computed in pure Python.

Owns: the interval arithmetic that splits a trace's GPU time into computation / exposed
communication / exposed memcpy / idle (`gpu_timeline`), the same breakdown over host
spans for CPU-only traces (`host_timeline`), the per-kernel aggregate table
(`kernel_summary`), and reading/writing both tables as CSV with TraceLens's column and
row names. The algorithm follows shared/reference/tracelens-gpu-timeline.md §3-§4 and
reproduces TraceLens's numbers on the golden fixtures (times to 1e-9 relative).

Reads: a `Trace` from `distanom.analysis.trace_io`. Hands on: a frozen `Timeline` (µs)
and a list of row dicts, to `distanom.analysis.engine`, the report, and to
`rank<R>.gpu_timeline.csv` / `rank<R>.kernel_summary.csv` in the run directory (written
atomically: temp file in the same directory, then `os.replace`).

Missing values: a kernel without `args.stream` has stream None, an unlinked kernel has
category None, and an undefined percentage (0/0) is `float("nan")`. In CSV both None
and NaN are an empty cell (as pandas writes them); in JSON (`jsonable`) both are null.
A text cell starting with = + - @ (a spreadsheet formula) is written with a leading `'`
and read back without it (`distanom.sanitize`); numbers and ordinary names are as
TraceLens writes them.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distanom.analysis.trace_io import Trace
from distanom.errors import TraceFormatError
from distanom.rundir import write_bytes_atomic
from distanom.sanitize import spreadsheet_safe, spreadsheet_text

__all__ = [
    "HOST_COMM_KEYWORDS",
    "HOST_LOCAL_OP_PREFIXES",
    "KERNEL_SUMMARY_COLUMNS",
    "TIMELINE_COLUMNS",
    "TIMELINE_ROWS",
    "Timeline",
    "gpu_timeline",
    "host_timeline",
    "interval_length",
    "jsonable",
    "kernel_summary",
    "read_gpu_timeline_csv",
    "read_kernel_summary_csv",
    "subtract_intervals",
    "timeline_from_buckets",
    "union_intervals",
    "write_gpu_timeline_csv",
    "write_kernel_summary_csv",
]

TIMELINE_ROWS = (
    "computation_time",
    "exposed_comm_time",
    "exposed_memcpy_time",
    "busy_time",
    "idle_time",
    "total_time",
    "total_comm_time",
    "total_memcpy_time",
)
"""Row names (`type` column) of gpu_timeline, in TraceLens's order."""

TIMELINE_COLUMNS = ("type", "time ms", "percent")

_US = "Kernel duration (\u00b5s)"
KERNEL_SUMMARY_COLUMNS = (
    "Parent op category",
    "Kernel name",
    "Kernel stream",
    f"{_US}_sum",
    f"{_US}_count",
    f"{_US}_mean",
    f"{_US}_min",
    f"{_US}_max",
    "Percent of kernels time (%)",
    "Percent of total time (%)",
)
"""kernel_summary columns of a GPU-only trace, exactly as TraceLens names them (µ = U+00B5)."""

HOST_COMM_KEYWORDS = (
    "gloo",
    "nccl",
    "c10d::",
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "broadcast",
    "reduce_scatter",
    "barrier",
    "alltoall",
)
"""A host span whose lower-cased name contains one of these is communication."""

HOST_LOCAL_OP_PREFIXES = ("aten::broadcast_",)
"""Host spans starting with these are local tensor ops despite a keyword above
(`aten::broadcast_tensors` / `aten::broadcast_to` run inside e.g. mse_loss): computation."""

_PROFILER_STEP = re.compile(r"ProfilerStep#\d+")
_OWN_MARKER_PREFIX = "distanom"

_ROCM_COPY_KERNEL = re.compile(
    r"(?:MEMORY_COPY_(?:HOST_TO_DEVICE|DEVICE_TO_HOST|DEVICE_TO_DEVICE)"
    r"|__amd_rocclr_copyBuffer(?:Rect)?(?:Aligned)?)(?:\.kd)?"
)
_ROCM_FILL_KERNEL = re.compile(r"__amd_rocclr_fillBuffer(?:Aligned)?(?:\.kd)?")
_GPU_COMM = re.compile(r"nccl|rccl|cross_device_reduce", re.IGNORECASE)

_COMPUTATION, _COMM, _MEMCPY = 0, 1, 2

Interval = tuple[float, float]


# --------------------------------------------------------------------------- intervals


def union_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge intervals, sorted by start; an interval starting at or before the previous
    end (touching included) extends it."""
    merged: list[Interval] = []
    cur_start = cur_end = 0.0
    started = False
    for start, end in sorted(intervals):
        if not started:
            cur_start, cur_end, started = start, end, True
        elif start <= cur_end:
            if end > cur_end:
                cur_end = end
        else:
            merged.append((cur_start, cur_end))
            cur_start, cur_end = start, end
    if started:
        merged.append((cur_start, cur_end))
    return merged


def subtract_intervals(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The parts of `a` not covered by `b` (both merged and sorted, as from
    `union_intervals`), in start order."""
    out: list[Interval] = []
    j = 0
    nb = len(b)
    for start, end in a:
        while j < nb and b[j][1] <= start:
            j += 1
        cur = start
        k = j
        while k < nb and b[k][0] < end:
            b_start, b_end = b[k]
            if b_start > cur:
                out.append((cur, b_start))
            if b_end > cur:
                cur = b_end
            if cur >= end:
                break
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def interval_length(intervals: Iterable[Interval]) -> float:
    """Sum of `end - start`, added in the given order with plain float addition
    (as TraceLens does, so the rounding matches)."""
    total = 0.0
    for start, end in intervals:
        total += end - start
    return total


# --------------------------------------------------------------------------- timeline


@dataclass(frozen=True)
class Timeline:
    """One gpu_timeline (or host timeline) table; every field in microseconds.

    Field `<row>_us` holds row `<row>` of `TIMELINE_ROWS`. `ms(row)` and `percent(row)`
    give the table's `time ms` and `percent` columns exactly as TraceLens computes them
    (`µs / 1000`, `µs / total_time_us * 100`, NaN when total_time is 0).
    """

    computation_time_us: float
    exposed_comm_time_us: float
    exposed_memcpy_time_us: float
    busy_time_us: float
    idle_time_us: float
    total_time_us: float
    total_comm_time_us: float
    total_memcpy_time_us: float

    def us(self, row: str) -> float:
        """The row's time in µs; KeyError for a name not in `TIMELINE_ROWS`."""
        if row not in TIMELINE_ROWS:
            raise KeyError(f"unknown gpu_timeline row {row!r}")
        value: float = getattr(self, f"{row}_us")
        return value

    def ms(self, row: str) -> float:
        """The row's `time ms` value."""
        return self.us(row) / 1000

    def percent(self, row: str) -> float:
        """The row's `percent` value; NaN when total_time is 0."""
        total = self.total_time_us
        if total == 0:
            return math.nan
        return self.us(row) / total * 100

    def rows(self) -> list[dict[str, Any]]:
        """The table as TraceLens shows it: `{"type", "time ms", "percent"}` per row, in order."""
        return [
            {"type": row, "time ms": self.ms(row), "percent": self.percent(row)}
            for row in TIMELINE_ROWS
        ]

    @classmethod
    def from_us(cls, values: Mapping[str, float]) -> Timeline:
        """Build from a `{row name: µs}` mapping holding every row of `TIMELINE_ROWS`."""
        missing = [row for row in TIMELINE_ROWS if row not in values]
        if missing:
            raise KeyError(f"missing gpu_timeline rows: {', '.join(missing)}")
        return cls(**{f"{row}_us": float(values[row]) for row in TIMELINE_ROWS})


def timeline_from_buckets(
    computation: Sequence[Interval],
    communication: Sequence[Interval],
    memcpy: Sequence[Interval],
) -> Timeline:
    """The eight rows from the intervals of each bucket (µs), as TraceLens defines them.

    At least one interval must be given in total (else there is no span).
    """
    comp = union_intervals(computation)
    comm = union_intervals(communication)
    mem = union_intervals(memcpy)
    everything = union_intervals([*computation, *communication, *memcpy])
    if not everything:
        raise ValueError("no intervals")
    total = everything[-1][1] - everything[0][0]
    busy = interval_length(everything)
    return Timeline(
        computation_time_us=interval_length(comp),
        exposed_comm_time_us=interval_length(subtract_intervals(comm, comp)),
        exposed_memcpy_time_us=interval_length(
            subtract_intervals(subtract_intervals(mem, comp), comm)
        ),
        busy_time_us=busy,
        idle_time_us=total - busy,
        total_time_us=total,
        total_comm_time_us=interval_length(comm),
        total_memcpy_time_us=interval_length(mem),
    )


def _gpu_bucket(cat: str, name: str) -> int:
    if cat == "gpu_memcpy":
        return _MEMCPY
    if cat == "kernel":
        if _ROCM_COPY_KERNEL.fullmatch(name):
            return _MEMCPY
        if _ROCM_FILL_KERNEL.fullmatch(name):
            return _COMPUTATION
    if _GPU_COMM.search(name):
        return _COMM
    return _COMPUTATION


def gpu_timeline(trace: Trace) -> Timeline:
    """TraceLens's gpu_timeline over every kernel/gpu_memcpy/gpu_memset event of the trace
    (all devices and streams merged into one timeline).

    Raises `TraceFormatError` when the trace has no GPU event.
    """
    if not trace.gpu_events:
        raise TraceFormatError(f"{trace.source}: no GPU events (kernel/gpu_memcpy/gpu_memset)")
    buckets: tuple[list[Interval], list[Interval], list[Interval]] = ([], [], [])
    seen: dict[tuple[str, str], int] = {}
    for ev in trace.gpu_events:
        kind = seen.get((ev.cat, ev.name))
        if kind is None:
            kind = seen[(ev.cat, ev.name)] = _gpu_bucket(ev.cat, ev.name)
        buckets[kind].append((ev.ts, ev.ts + ev.dur))
    return timeline_from_buckets(*buckets)


def _host_bucket(name: str) -> int | None:
    """Bucket of a host span, None when it is left out (step markers, distanom's own)."""
    if name.startswith(_OWN_MARKER_PREFIX) or _PROFILER_STEP.fullmatch(name):
        return None
    lowered = name.lower()
    if name.startswith(HOST_LOCAL_OP_PREFIXES):
        return _COMPUTATION
    if any(word in lowered for word in HOST_COMM_KEYWORDS):
        return _COMM
    return _COMPUTATION


def host_timeline(trace: Trace) -> Timeline:
    """The same eight rows over host spans, for CPU-only traces (no GPU events).

    Spans: `cpu_op` and `user_annotation` events (`ph` X) of every thread, except
    `ProfilerStep#<n>` annotations and names starting with `distanom`. Communication:
    names containing a `HOST_COMM_KEYWORDS` word (case-insensitive), unless they start
    with a `HOST_LOCAL_OP_PREFIXES` prefix; memcpy: none; everything else computation.
    Raises `TraceFormatError` when no span is left.
    """
    buckets: tuple[list[Interval], list[Interval], list[Interval]] = ([], [], [])
    seen: dict[str, int | None] = {}
    for ev in trace.host_events:
        if ev.name in seen:
            kind = seen[ev.name]
        else:
            kind = seen[ev.name] = _host_bucket(ev.name)
        if kind is not None:
            buckets[kind].append((ev.ts, ev.ts + ev.dur))
    if not any(buckets):
        raise TraceFormatError(f"{trace.source}: no host spans (cpu_op/user_annotation)")
    return timeline_from_buckets(*buckets)


# --------------------------------------------------------------------------- kernels


def _sort_key(key: tuple[str | None, str, int | None]) -> tuple[Any, ...]:
    category, name, stream = key
    return (category is None, category or "", name, stream is None, stream or 0)


def kernel_summary(trace: Trace, total_time_us: float) -> list[dict[str, Any]]:
    """TraceLens's kernel_summary of a GPU-only trace: one row per (Parent op category,
    Kernel name, Kernel stream), over every `kernel` event (linked or not).

    Category is the launch link ("runtime", "graph", None when unlinked); stream is
    `args.stream` or None. Percentages are NaN when their denominator (sum of all
    kernel durations; `total_time_us`, gpu_timeline's total_time) is 0. Rows are
    ordered by `_sum` descending; ties by (category, name, stream) ascending with None
    last (TraceLens's own tie order is not stable: compare rows as a set).
    Sums use `math.fsum` (TraceLens/pandas use compensated sums: equal within rounding).
    """
    groups: dict[tuple[str | None, str, int | None], list[float]] = {}
    for ev in trace.gpu_events:
        if ev.cat == "kernel":
            groups.setdefault((ev.link, ev.name, ev.stream), []).append(ev.dur)
    kernels_total = math.fsum(d for durs in groups.values() for d in durs)
    rows: list[dict[str, Any]] = []
    for key in sorted(groups, key=_sort_key):
        category, name, stream = key
        durs = groups[key]
        total = math.fsum(durs)
        rows.append(
            {
                "Parent op category": category,
                "Kernel name": name,
                "Kernel stream": stream,
                f"{_US}_sum": total,
                f"{_US}_count": len(durs),
                f"{_US}_mean": total / len(durs),
                f"{_US}_min": min(durs),
                f"{_US}_max": max(durs),
                "Percent of kernels time (%)": _percent(total, kernels_total),
                "Percent of total time (%)": _percent(total, total_time_us),
            }
        )
    rows.sort(key=lambda row: -row[f"{_US}_sum"])
    return rows


def _percent(part: float, whole: float) -> float:
    return math.nan if whole == 0 else part / whole * 100


# --------------------------------------------------------------------------- JSON / CSV


def jsonable(value: Any) -> Any:
    """`value` with every non-finite float (NaN, ±inf) replaced by None, recursively
    through dicts, lists and tuples, so `json.dumps(..., allow_nan=False)` accepts it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("" if math.isnan(value) else repr(value))
    if isinstance(value, str):  # names come from the trace: never a live formula
        return spreadsheet_safe(value)
    return str(value)


def _atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    write_bytes_atomic(Path(path), text.encode("utf-8"))


def _csv_text(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow([_cell(v) for v in row])
    return buffer.getvalue()


def write_gpu_timeline_csv(path: str | os.PathLike[str], timeline: Timeline) -> None:
    """Write the table as TraceLens's `gpu_timeline.csv` (columns type,time ms,percent;
    NaN percent as an empty cell), atomically."""
    text = _csv_text(
        TIMELINE_COLUMNS,
        ([r["type"], r["time ms"], r["percent"]] for r in timeline.rows()),
    )
    _atomic_write_text(path, text)


def write_kernel_summary_csv(
    path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]]
) -> None:
    """Write kernel_summary rows as CSV, atomically: `KERNEL_SUMMARY_COLUMNS` then any
    extra column found in the rows (e.g. TraceLens's `Parent cpu_op`), None/NaN empty."""
    columns = list(KERNEL_SUMMARY_COLUMNS)
    for row in rows:
        columns.extend(c for c in row if c not in columns)
    text = _csv_text(columns, ([row.get(c) for c in columns] for row in rows))
    _atomic_write_text(path, text)


def _read_csv(path: str | os.PathLike[str]) -> tuple[list[str], list[list[str]]]:
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            table = list(csv.reader(handle))
    except FileNotFoundError:
        raise TraceFormatError(f"{os.fspath(path)}: no such file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise TraceFormatError(f"{os.fspath(path)}: cannot be read as CSV ({err})") from None
    if not table:
        raise TraceFormatError(f"{os.fspath(path)}: empty CSV file")
    return table[0], table[1:]


def _float_cell(path: str | os.PathLike[str], text: str, what: str) -> float:
    if text == "":
        return math.nan
    try:
        return float(text)
    except ValueError:
        raise TraceFormatError(f"{os.fspath(path)}: {what} is not a number: {text!r}") from None


def read_gpu_timeline_csv(path: str | os.PathLike[str]) -> Timeline:
    """Read a gpu_timeline CSV (ours or TraceLens's) back into a `Timeline`.

    Uses the `time ms` column (µs = ms * 1000; the percent column is recomputed).
    Raises `TraceFormatError` unless it has the columns type/time ms and exactly the
    eight rows of `TIMELINE_ROWS`, each with a finite time.
    """
    header, body = _read_csv(path)
    try:
        type_col, ms_col = header.index("type"), header.index("time ms")
    except ValueError:
        raise TraceFormatError(
            f"{os.fspath(path)}: not a gpu_timeline CSV (header {','.join(header)!r})"
        ) from None
    values: dict[str, float] = {}
    for line in body:
        if not line:
            continue
        if len(line) <= max(type_col, ms_col):
            raise TraceFormatError(f"{os.fspath(path)}: short row {line!r}")
        row = line[type_col]
        if row not in TIMELINE_ROWS or row in values:
            raise TraceFormatError(f"{os.fspath(path)}: unexpected or repeated row {row!r}")
        ms = _float_cell(path, line[ms_col], f"time ms of {row}")
        if not math.isfinite(ms):
            raise TraceFormatError(f"{os.fspath(path)}: time ms of {row} is {line[ms_col]!r}")
        values[row] = ms * 1000
    missing = [row for row in TIMELINE_ROWS if row not in values]
    if missing:
        raise TraceFormatError(f"{os.fspath(path)}: missing rows {', '.join(missing)}")
    return Timeline.from_us(values)


_INT_COLUMNS = frozenset((f"{_US}_count",))
_FLOAT_COLUMNS = frozenset(c for c in KERNEL_SUMMARY_COLUMNS[3:] if c not in _INT_COLUMNS)


def read_kernel_summary_csv(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a kernel_summary CSV back into row dicts typed as `kernel_summary` returns
    them (empty category/stream → None, empty number → NaN, other columns as text)."""
    header, body = _read_csv(path)
    missing = [c for c in KERNEL_SUMMARY_COLUMNS if c not in header]
    if missing:
        raise TraceFormatError(
            f"{os.fspath(path)}: not a kernel_summary CSV (missing {', '.join(missing)})"
        )
    rows: list[dict[str, Any]] = []
    for line in body:
        if not line:
            continue
        if len(line) != len(header):
            raise TraceFormatError(
                f"{os.fspath(path)}: row has {len(line)} cells, not {len(header)}"
            )
        row: dict[str, Any] = {}
        for column, text in zip(header, line, strict=True):
            if column == "Kernel stream":
                stream = _float_cell(path, text, column)
                row[column] = None if math.isnan(stream) else int(stream)
            elif column in _INT_COLUMNS:
                count = _float_cell(path, text, column)
                if not math.isfinite(count):
                    raise TraceFormatError(f"{os.fspath(path)}: {column} is empty")
                row[column] = int(count)
            elif column in _FLOAT_COLUMNS:
                row[column] = _float_cell(path, text, column)
            elif column == "Kernel name":
                row[column] = spreadsheet_text(text)
            else:
                row[column] = spreadsheet_text(text) or None
        rows.append(row)
    return rows
