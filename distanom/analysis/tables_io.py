"""Per-rank tables of a capture on disk, and the `distanom analyze` output.

The capture worker calls `write_rank_tables` right after a trace is written; the report
reads the CSVs (`cached_tables`) when they are there and computes them from the trace
when they are not (e.g. after `analysis.on_capture: report`, or when the job ended
before its worker got to them), then caches them with `write_tables`.
A CPU-only trace gets the host breakdown, written as `rank<R>.cpu_timeline.csv` so its
name never claims GPU time it does not hold.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distanom.analysis.engine import TraceTables, analyze_trace
from distanom.analysis.tables import (
    TIMELINE_ROWS,
    Timeline,
    jsonable,
    read_gpu_timeline_csv,
    write_gpu_timeline_csv,
    write_kernel_summary_csv,
)
from distanom.analysis.text import short, table
from distanom.errors import DistanomError
from distanom.rundir import RunDir


def write_rank_tables(run: RunDir, step: int, rank: int, trace: Path, engine: str) -> TraceTables:
    """Analyse one rank's trace of a capture and write its tables beside it."""
    tables = analyze_trace(trace, engine)
    write_tables(run, step, rank, tables)
    return tables


def write_tables(run: RunDir, step: int, rank: int, tables: TraceTables) -> None:
    """A GPU trace's timeline and kernel summary, or a CPU-only trace's timeline."""
    if tables.kind == "gpu":
        write_gpu_timeline_csv(run.timeline_csv(step, rank), tables.timeline)
        write_kernel_summary_csv(run.kernel_csv(step, rank), tables.kernel_summary)
    else:
        write_gpu_timeline_csv(run.cpu_timeline_csv(step, rank), tables.timeline)


@dataclass(frozen=True)
class RankTables:
    """A rank's timeline of a capture and its kind ("gpu" or "cpu")."""

    timeline: Timeline
    kind: str


def cached_tables(run: RunDir, step: int, rank: int) -> RankTables | None:
    """The rank's timeline for a capture from its CSV beside the trace; None when there
    is none or it cannot be read (then the report computes it from the trace)."""
    for kind, path in (
        ("gpu", run.timeline_csv(step, rank)),
        ("cpu", run.cpu_timeline_csv(step, rank)),
    ):
        if path.exists():
            with contextlib.suppress(DistanomError, OSError, ValueError):
                return RankTables(read_gpu_timeline_csv(path), kind)
    return None


def timeline_json(timeline: Timeline) -> dict[str, dict[str, float | None]]:
    """{"<row>": {"time_ms": x, "percent": y}} (NaN as null)."""
    out: dict[str, dict[str, float | None]] = {}
    for row in TIMELINE_ROWS:
        percent = timeline.percent(row)
        out[row] = {
            "time_ms": timeline.ms(row),
            "percent": percent if math.isfinite(percent) else None,
        }
    return out


@dataclass(frozen=True)
class AnalyzeOutput:
    """What `distanom analyze` prints for one trace."""

    tables: TraceTables

    def as_json(self) -> dict[str, Any]:
        """The tables as JSON: trace, engine, kind, timeline rows and kernel summary."""
        key = "gpu_timeline" if self.tables.kind == "gpu" else "host_timeline"
        body: dict[str, Any] = {
            "trace": self.tables.source,
            "engine": self.tables.engine,
            "kind": self.tables.kind,
            key: timeline_json(self.tables.timeline),
            "kernel_summary": jsonable(self.tables.kernel_summary),
        }
        if self.tables.step_window_us is not None:
            body["step_window_ms"] = self.tables.step_window_us / 1000
            body["outside_ops_ms"] = self.tables.outside_ops_ms
        return body

    def as_text(self) -> str:
        """The tables as text: the timeline, then the top 20 kernel summary rows."""
        tables = self.tables
        title = "gpu_timeline" if tables.kind == "gpu" else "host timeline (CPU-only trace)"
        lines = [f"{tables.source}  (engine: {tables.engine})", "", f"{title}:"]
        rows = []
        for row in TIMELINE_ROWS:
            percent = tables.timeline.percent(row)
            rows.append(
                [
                    row,
                    f"{tables.timeline.ms(row):.3f}",
                    f"{percent:.2f}" if math.isfinite(percent) else "-",
                ]
            )
        lines += ["  " + line for line in table(["type", "time ms", "percent"], rows)]
        lines += outside_ops_lines(tables)
        if tables.kernel_summary:
            lines += ["", f"kernel_summary (top 20 of {len(tables.kernel_summary)} rows):"]
            krows = []
            for entry in tables.kernel_summary[:20]:
                name = str(entry.get("Kernel name"))
                krows.append(
                    [
                        short(name, 70),
                        str(entry.get("Kernel stream")),
                        str(entry.get("Kernel duration (\u00b5s)_count")),
                        f"{float(entry.get('Kernel duration (µs)_sum') or 0):.1f}",
                        _pct(entry.get("Percent of total time (%)")),
                    ]
                )
            lines += [
                "  " + line
                for line in table(["kernel", "stream", "count", "sum µs", "% total"], krows)
            ]
        return "\n".join(lines) + "\n"


def outside_ops_lines(tables: TraceTables) -> list[str]:
    """The step window and the part of it outside the trace's ops, when the trace has
    distanom's step annotation (a stall there is invisible in the timeline above)."""
    outside = tables.outside_ops_ms
    if outside is None or tables.step_window_us is None:
        return []
    return [
        f"  step window {tables.step_window_us / 1000:.3f} ms; outside the trace's ops "
        f"{outside:.3f} ms (host time before the first or after the last op: see "
        "'outside ops' in docs/glossary.md)"
    ]


def _pct(value: Any) -> str:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return f"{value:.2f}"
    return "-"


def analyze_for_cli(path: str, engine: str) -> AnalyzeOutput:
    """The `distanom analyze` output of one trace file."""
    return AnalyzeOutput(analyze_trace(Path(path), engine))
