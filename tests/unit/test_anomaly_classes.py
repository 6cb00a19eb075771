"""The report's anomaly classes: periodic, lasting slowdown and one-off episodes counted as
detected, traced and explained, in the JSON, the text and the HTML page."""

from __future__ import annotations

from pathlib import Path

from distanom.analysis.anomalies import Anomaly, AnomalyVerdict
from distanom.analysis.anomaly_classes import anomaly_classes
from distanom.analysis.html_report import render_html
from distanom.analysis.report import build_report, render_text, report_json
from distanom.analysis.run import load_run
from distanom.records.anomalies import AnomalyRecord, AnomalyWriter, StepEvidence
from tests.unit.rungen import make_run

PERIODIC = list(range(100, 801, 100))
LASTING = list(range(1050, 1058))  # off the periodic ones' phase (a start at 1000 would hit)
ONE_OFF = [1530, 2270]


def record(step: int, ratio: float, traced: bool, culprit: bool) -> AnomalyRecord:
    """Two ranks: rank 1 alone slow (a culprit from durations), or both alike (unknown)."""
    slow = 1.5 * ratio
    times = (1.5, slow) if culprit else (slow, slow)
    return AnomalyRecord(
        step=step, step_ms=slow, median_ms=1.5, threshold_ms=2.25, traced=traced,
        judged_by="condition", slowest_rank=1, durations_ms=times,
        evidence=(StepEvidence(cpu_ms=1.0), StepEvidence(cpu_ms=1.0)),
        cpu_median_ms=(1.0, 1.0),
    )  # fmt: skip


def test_each_class_is_counted_in_every_rendering(tmp_path: Path) -> None:
    run = make_run(tmp_path, [], hosts=["a", "a"], steps=2500)
    writer = AnomalyWriter(run)
    for step in PERIODIC:
        writer.write(record(step, 6.0, traced=step >= 400, culprit=True))
    for step in LASTING:
        writer.write(record(step, 1.7, traced=False, culprit=False))
    for step in ONE_OFF:
        writer.write(record(step, 3.0, traced=False, culprit=step == 1530))
    writer.close()
    report = build_report(load_run(str(run.path)))
    body = report_json(report)
    assert body["anomaly_classes"] == [
        {"class": "periodic", "detected": 8, "traced": 5, "explained": 8, "steps": 8},
        {"class": "lasting_slowdown", "detected": 1, "traced": 0, "explained": 0, "steps": 8},
        {"class": "one_off", "detected": 2, "traced": 0, "explained": 1, "steps": 2},
    ]
    assert body["recurrences"] == [
        {"period_steps": 100.0, "first_step": 100, "last_step": 800, "occurrences": 8}
    ]
    text = render_text(report)
    assert "  by class (episodes):" in text
    assert "    periodic: 8 detected, 5 traced, 8 explained" in text
    assert "      every ~100 steps: 8 times, steps 100 to 800" in text
    assert "    lasting slowdown: 1 detected, 0 traced, 0 explained" in text
    assert "    one-off: 2 detected, 0 traced, 1 explained" in text
    page = render_html(report).html
    assert "<th>class (episodes)</th>" in page and "<td>lasting slowdown</td>" in page
    assert "Recurring: every ~100 steps: 8 times, steps 100 to 800" in page


def test_classes_follow_the_runs_merge_gap() -> None:
    verdict = AnomalyVerdict(None, "unknown", "", "none")
    close = [Anomaly(s, 3.0, 1.0, 3.0, False, "condition", verdict) for s in (10, 13, 16, 19)]
    (_, lasting, one_off) = anomaly_classes(close, {"merge_gap_steps": 5})
    assert (lasting.detected, lasting.steps, one_off.detected) == (1, 4, 0)
    (_, lasting, one_off) = anomaly_classes(close, {"merge_gap_steps": 1})
    assert (lasting.detected, one_off.detected) == (0, 4)
    assert anomaly_classes(close, {"merge_gap_steps": "bad"})[1].detected == 1  # the default


def test_the_text_names_the_best_supported_periods_and_counts_the_rest(tmp_path: Path) -> None:
    # five cadences, each of its own strength (an evaluation, checkpoints, ...)
    cadences = ((300, 3.0, 150), (770, 6.0, 400), (1130, 12.0, 620), (1900, 24.0, 910),
                (2300, 48.0, 1000))  # fmt: skip
    run = make_run(tmp_path, [], hosts=["a", "a"], steps=10_100)
    writer = AnomalyWriter(run)
    for step, ratio in sorted((s, r) for p, r, f in cadences for s in range(f, 10_001, p)):
        writer.write(record(step, ratio, traced=False, culprit=True))
    writer.close()
    report = build_report(load_run(str(run.path)))
    found = report_json(report)["recurrences"]
    assert [r["period_steps"] for r in found] == [300, 770, 1130, 1900, 2300]
    lines = [line for line in render_text(report).splitlines() if "      every ~" in line]
    most = sorted((r["occurrences"] for r in found), reverse=True)[:3]
    assert [int(line.split(": ")[1].split(" times")[0]) for line in lines] == most
    assert f"      and {len(found) - 3} more (--json)" in render_text(report)
