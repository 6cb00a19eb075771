"""The report's anomalies, stragglers and drift sections (JSON, text, HTML), from the
files rank 0 wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distanom.analysis.html_report import render_html
from distanom.analysis.render_json import report_json
from distanom.analysis.render_text import render_text
from distanom.analysis.report import build_report
from distanom.analysis.run import load_run
from distanom.records.anomalies import AnomalyRecord, AnomalyWriter, StepEvidence, write_stragglers
from distanom.rundir import RunDir
from tests.unit.rungen import make_run


def write_anomaly(run: RunDir, evidence: tuple[StepEvidence, ...], **fields: Any) -> None:
    """Rank 0's record of one anomalous step 40 of a two-rank run; `fields` change it."""
    record: dict[str, Any] = dict(
        step=40, step_ms=300.0, median_ms=15.0, threshold_ms=22.5, traced=False,
        judged_by="condition", slowest_rank=0, durations_ms=(300.0, 299.0),
        evidence=evidence, arrive_median_ms=(10.0, 10.0), cpu_median_ms=(1.0, 1.0),
    )  # fmt: skip
    record.update(fields)
    writer = AnomalyWriter(run)
    writer.write(AnomalyRecord(**record))
    writer.close()


def test_untraced_anomalies_and_stragglers_in_every_rendering(tmp_path: Path) -> None:
    run = make_run(tmp_path, [], hosts=["a", "a"])
    late = (StepEvidence(10.0, 1, 1.0, 0.0), StepEvidence(290.0, 1, 1.0, 0.0))
    write_anomaly(run, late, judged_by="all_conditions")
    straggler = {"rank": 1, "score": 0.4, "since_step": 50, "evidence": {"late_steps": 60}}
    drift = {"first_ms": 10.0, "last_ms": 20.0, "ratio": 2.0}
    write_stragglers(run, {"stragglers": [straggler], "drift": drift})
    report = build_report(load_run(run.path))
    body = report_json(report)
    (anomaly,) = body["anomalies"]
    assert anomaly["step"] == 40 and anomaly["traced"] is False
    assert anomaly["judged_by"] == "all_conditions" and anomaly["ratio"] == 20.0
    assert anomaly["verdict"]["culprit_rank"] == 1 and anomaly["verdict"]["cause"] == "host_stall"
    assert body["stragglers"][0]["rank"] == 1 and body["drift"]["ratio"] == 2.0
    text = render_text(report)
    assert "anomalies (1):" in text and "all_conditions" in text
    assert "rank 1: the typical rank waited for it 0.40" in text and "drift:" in text
    html = render_html(report, use_matplotlib=False).html
    assert "<h2>Anomalies (1)</h2>" in html and "<h2>Stragglers (1)</h2>" in html
    assert "host_stall" in html


def test_a_straggler_that_caught_up_is_still_in_the_report(tmp_path: Path) -> None:
    # the job's log named it (and traced a step on every rank): the report must say so
    run = make_run(tmp_path, [], hosts=["a", "a"])
    earlier = {"rank": 1, "since_step": 1, "until_step": 20, "peak_score": 0.12}
    write_stragglers(run, {"stragglers": [], "drift": None, "earlier": [earlier]})
    report = build_report(load_run(run.path))
    assert report_json(report)["earlier_stragglers"] == [{**earlier, "phase": None}]
    text = render_text(report)
    assert "rank 1: a straggler from step 1 to step 20, then it kept up" in text
    assert "no straggler" not in text
    assert "a straggler from step 1 to step 20" in render_html(report, use_matplotlib=False).html


def test_an_anomaly_without_a_culprit_shows_a_dash_in_text_and_html(tmp_path: Path) -> None:
    # both ranks late to the collective together: no culprit, and no "None" on the page
    run = make_run(tmp_path, [], hosts=["a", "a"])
    write_anomaly(run, (StepEvidence(290.0, 1, 1.0, 0.0), StepEvidence(290.1, 1, 1.0, 0.0)))
    report = build_report(load_run(run.path))
    (anomaly,) = report.anomalies
    assert anomaly.verdict.culprit_rank is None and anomaly.verdict.cause == "host_stall"
    html = render_html(report, use_matplotlib=False).html
    row = html[html.index("<tr><td>40</td>") :]
    row = row[: row.index("</tr>")]
    assert "<td>-</td><td>host_stall</td>" in row and "None" not in row
    assert "every rank reached the step's last collective" in render_text(report)


def test_a_capture_whose_trace_names_no_cause_points_to_the_evidence_verdict(
    tmp_path: Path,
) -> None:
    # the capture section shows the trace's verdict; where the evidence replaced it in
    # the anomalies list, the section says so instead of contradicting the list
    from tests.unit.rungen import Capture
    from tests.unit.stepgen import gpu_job

    run = make_run(
        tmp_path,
        [
            Capture(20, "reference", gpu_job(world=2), 1.1, 1.2),
            Capture(40, "anomaly", gpu_job(world=2), 3.0, 1.2),  # its trace explains nothing
        ],
        hosts=["a", "a"],
    )
    write_anomaly(
        run, (StepEvidence(2.9, 1, 1.0, 0.0), StepEvidence(1.0, 1, 1.0, 0.0)),
        step_ms=3.0, median_ms=1.2, threshold_ms=1.8, traced=True, durations_ms=(3.0, 3.0),
        arrive_median_ms=(1.0, 1.0),
    )  # fmt: skip
    report = build_report(load_run(run.path))
    (anomaly,) = report.anomalies
    assert (anomaly.verdict.culprit_rank, anomaly.verdict.cause) == (0, "host_stall")
    text = render_text(report)
    section = text[text.index("step 40 (anomaly)") :]
    assert "verdict: no single rank — unknown" in section
    assert "the step's evidence does (as in the anomalies list): rank 0 — host stall" in section
    # a capture whose trace verdict stands gets no such line
    assert text.count("the step's evidence does") == 1
    html = render_html(report, use_matplotlib=False).html
    section = html[html.index('id="step-40"') :]
    assert "The trace names no cause; the step&#x27;s evidence does" in section
    assert "rank 0 — host stall" in section[: section.index("</p>", section.index("The trace"))]


def test_evidence_that_points_elsewhere_than_the_trace_is_said_under_its_verdict() -> None:
    from distanom.analysis.anomalies import Anomaly, AnomalyVerdict, evidence_notes

    def traced(step: int, rank: int | None, cause: str, other: dict[str, Any]) -> Anomaly:
        verdict = AnomalyVerdict(rank, cause, "...", "trace", {"evidence_verdict": other})
        return Anomaly(step, 30.0, 15.0, 2.0, True, "condition", verdict)

    elsewhere = {"culprit_rank": 1, "cause": "host_stall"}
    notes = evidence_notes(
        [
            traced(5, None, "global", elsewhere),  # "every rank slowed together"
            traced(6, 1, "host_stall", elsewhere),  # they agree: nothing to add
            traced(7, 0, "compute", {"culprit_rank": None, "cause": "unknown"}),  # no answer
            traced(8, 1, "compute", elsewhere),  # the same rank: the trace names the cause
            traced(9, 0, "host_stall", elsewhere),  # another rank
        ]
    )
    assert notes == {
        5: "the step's evidence (arrival, host signals) points elsewhere: rank 1 — host "
        "stall; the trace's verdict stands",
        9: "the step's evidence (arrival, host signals) points elsewhere: rank 1 — host "
        "stall; the trace's verdict stands",
    }


def test_past_twenty_anomalies_the_text_gives_the_slowest_ones_evidence(tmp_path: Path) -> None:
    # 30 mild anomalies around one 60x step late in the run: its evidence is printed,
    # the cut is said, and the evidence lines stay in step order
    run = make_run(tmp_path, [], hosts=["a", "a"])
    late = (StepEvidence(10.0, 1, 1.0, 0.0), StepEvidence(40.0, 1, 1.0, 0.0))
    writer = AnomalyWriter(run)
    for step in range(10, 40):
        slow = step == 35
        writer.write(
            AnomalyRecord(
                step=step, step_ms=900.0 if slow else 25.0 + step / 10, median_ms=15.0,
                threshold_ms=22.5, traced=False, judged_by="condition", slowest_rank=1,
                durations_ms=(15.0, 900.0 if slow else 25.0), evidence=late,
                arrive_median_ms=(10.0, 10.0), cpu_median_ms=(1.0, 1.0),
            )
        )  # fmt: skip
    writer.close()
    text = render_text(build_report(load_run(run.path)))
    evidence_steps = [int(line.split()[1][:-1]) for line in text.splitlines()
                      if line.startswith("  step ") and line.split()[1][:-1].isdigit()]  # fmt: skip
    assert 35 in evidence_steps and len(evidence_steps) == 20
    assert evidence_steps == sorted(evidence_steps)
    # the 19 others are the slowest of the mild ones: steps 20-39 but 35
    assert set(evidence_steps) == set(range(20, 40))
    assert "(evidence of the 20 slowest of 30 shown; all in --json)" in text
