"""Write what a report leaves in its run directory: table CSVs, merged traces, summaries.

Reads the model only (`distanom.analysis.model.Report`). Writes, per capture, the tables
computed from a trace that had none cached (`rank<R>.gpu_timeline.csv` ...), the merged
trace when it is stale, and `summary.json` (refreshed by every report). A read-only run
directory still gets its report: a table or summary that cannot be written is skipped,
a merged trace that cannot be written becomes a problem and its path is dropped.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

from distanom.analysis.model import Capture, Report
from distanom.analysis.render_json import summary_json
from distanom.analysis.run import RunData
from distanom.analysis.tables_io import write_tables
from distanom.rundir import RunDir, write_bytes_atomic, write_json_atomic

__all__ = ["write_outputs"]


def write_outputs(data: RunData | RunDir, report: Report) -> Report:
    """Write the report's files into the run directory; the report with any failure to
    write a merged trace among its problems (and that trace's path dropped)."""
    run = data.run if isinstance(data, RunData) else data
    for capture in report.captures:
        for rank, entry in capture.ranks.items():
            if entry.computed is not None:
                # beside the trace, in its node's copy of the run where it came from one
                where = RunDir(Path(entry.run_dir)) if entry.run_dir else run
                with contextlib.suppress(OSError):  # the report does not need the cache
                    write_tables(where, capture.step, rank, entry.computed)
    captures: list[Capture] = []
    failures: list[tuple[int, str]] = []
    for capture in report.captures:
        merged = capture.merged
        if merged is not None and merged.content is not None:
            try:
                write_bytes_atomic(merged.path, merged.content)
            except OSError as err:
                problem = f"step {capture.step}: merged trace not written: {err.strerror or err}"
                failures.append((merged.problem_at, problem))
                capture = replace(capture, merged=None)
        captures.append(capture)
    for capture in captures:
        with contextlib.suppress(OSError):  # a read-only run directory still gets its report
            write_json_atomic(run.summary_json(capture.step), summary_json(capture))
    problems = list(report.problems)
    for at, problem in reversed(failures):
        problems.insert(at, problem)
    return replace(report, captures=captures, problems=problems)
