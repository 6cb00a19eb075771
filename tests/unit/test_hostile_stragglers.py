"""A planted stragglers.json (issue 37's probes): evidence that is not an object, a score
of 1e999, a "nan" time, an oversized list. The report renders in text, JSON and HTML,
with the damaged entries dropped or their damaged details left out."""

from __future__ import annotations

import json
from pathlib import Path

from distanom.analysis.html_report import render_html
from distanom.analysis.report import build_report, render_text, report_json
from distanom.analysis.run import load_run
from distanom.records.anomalies import MAX_STRAGGLER_ENTRIES, read_stragglers, stragglers_path
from tests.unit.rungen import make_run


def test_damaged_straggler_entries_never_reach_a_renderer(tmp_path: Path) -> None:
    run = make_run(tmp_path, [], hosts=["a", "a"])
    good = {"rank": 1, "score": 0.4, "since_step": 50, "evidence": {"late_steps": 60}}
    body = {
        "stragglers": [
            {**good, "evidence": "x"},  # kept, without its evidence
            {**good, "score": "__INF__"},  # dropped: 1e999 reads as inf
            {**good, "detected_at": "nan"},  # an unknown field: left out
            *[good] * 5000,  # capped
        ],
        "earlier": [{"rank": 1, "since_step": 1, "until_step": True, "peak_score": 0.1}],
        "drift": {"ratio": "__INF__", "first_ms": 1.0},
        "scored_steps": 10**400,
    }
    stragglers_path(run).write_text(json.dumps(body).replace('"__INF__"', "1e999"))
    read = read_stragglers(run)
    assert len(read["stragglers"]) == MAX_STRAGGLER_ENTRIES - 1
    assert read["stragglers"][0] == {**good, "evidence": {}}
    assert read["earlier"] == [{"rank": 1, "since_step": 1, "peak_score": 0.1}]
    assert read["drift"] is None and read["scored_steps"] is None
    report = build_report(load_run(run.path))
    assert "rank 1: the typical rank waited" in render_text(report)
    json.dumps(report_json(report), allow_nan=False)  # no non-finite number reaches JSON
    assert "Stragglers" in render_html(report, use_matplotlib=False).html


def test_status_with_a_huge_integer_score_and_a_huge_step_time_renders(tmp_path: Path) -> None:
    """Issue 37: a 400-digit integer score in status.json crashed `distanom status`
    (OverflowError); a finite 1.7e308 step time crashed the SVG chart."""
    from distanom.live import render_status
    from distanom.rundir import RunDir

    status = {
        "state": "running",
        "stragglers": {"stragglers": [{"rank": 1, "score": 10**400, "since_step": 4}]},
    }
    assert "straggler: rank 1 since step 4: ranks wait for it -" in render_status(
        RunDir(tmp_path), status
    )
    run = make_run(tmp_path / "r", [], hosts=["a", "a"])
    rows = run.steps_csv(0).read_text().splitlines()
    rows[5] = "5,1.7e308,0,0,0.0"
    run.steps_csv(0).write_text("\n".join(rows) + "\n")
    report = build_report(load_run(run.path), step_times=True)
    assert "steps/rank0.csv: 1 unreadable row(s) skipped" in report.problems
    assert "<svg" in render_html(report, use_matplotlib=False).html
