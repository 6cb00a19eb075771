"""The run report: `build_report` (the typed model), `write_outputs` (its files), renderings.

One import for the CLI and the benches: `build_report(data)` computes a
`model.Report` from a loaded run without writing anything; `write_outputs(data,
report)` writes summary.json, merged traces and cached tables into the run directory;
`report_json` and `render_text` render it (the HTML page is `html_report`).
"""

from __future__ import annotations

from distanom.analysis.build import build_report, capture_cost, rolling_threshold
from distanom.analysis.model import Report
from distanom.analysis.outputs import write_outputs
from distanom.analysis.render_json import report_json, summary_json
from distanom.analysis.render_text import render_text

__all__ = [
    "Report",
    "build_report",
    "capture_cost",
    "render_text",
    "report_json",
    "rolling_threshold",
    "summary_json",
    "write_outputs",
]
