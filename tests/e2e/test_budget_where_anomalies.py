"""End to end (CPU, kineto, 2 gloo ranks, real torchrun): at a 1% budget, a periodic stall
on one rank is traced on every rank from its 4th occurrence on, and the report counts it
as periodic, detected, traced and explained, and names its period."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distanom.cli import main as cli_main
from tests.conftest import torchrun

PERIOD = 100
STALLS = list(range(PERIOD, 801, PERIOD))  # 8 occurrences: learned at the 3rd (300)


def budgeted_job(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    ranks: int,
    launch: list[str],
    script: list[str],
) -> dict:
    """Run the toy script under kineto with `launch`'s settings; its report as JSON.
    These tests measure the trace planner and the budget, not detection's noise rule:
    the spread fence is off (`detect.spread_sigmas=0`), since on a loaded 2-core host
    it rises with the jitter and moved when the slowdown was first judged (CI, 2026-12-04)."""
    done = torchrun(
        ranks,
        ["--run-dir", "runs", "--set", "tracer.backend=kineto",
         "--set", "capture.reference_every_steps=0", "--set", "detect.spread_sigmas=0",
         *launch],
        script,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    capsys.readouterr()
    assert cli_main(["report", str(tmp_path / "runs"), "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_a_periodic_stall_is_traced_from_its_fourth_occurrence_at_a_one_percent_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 2 ranks: 4 on the 2-core CI host measure tracing at up to 31% and make noise
    # that teaches coincidental series, whose guesses spend the budget meant for it.
    # At 2x (the stall is ~8x): at 1.5x a CI host made noise episodes (313, 349, 431,
    # 434, ...) whose windows left the 1% budget short of the 6th occurrence's window.
    report = budgeted_job(
        tmp_path, capsys, 2,
        ["--set", "tracer.overhead_budget_pct=1", "--set", "detect.multiplier=2",
         "--set", "detect.warmup_steps=5", "--set", "detect.min_steps=15"],
        ["--steps", "820", "--step-sleep", "0.02", "--stall-rank", "1",
         "--stall-steps", ",".join(map(str, STALLS)), "--stall-s", "0.15"],
    )  # fmt: skip
    anomalies = {a["step"]: a for a in report["anomalies"]}
    assert set(STALLS) <= set(anomalies), sorted(anomalies)
    later = STALLS[3:]
    untraced = [s for s in later if not anomalies[s]["traced"]]
    seen = [(a["step"], round(a["ratio"], 2), a["traced"]) for a in report["anomalies"]]
    duty = report["tracer"].get("duty_cycle") or {}
    planner = {k: v for k, v in duty.items() if "planner" in k or "window" in k}
    assert not untraced, f"untraced {untraced}; anomalies {seen}; {planner}"
    captured = {c["step"] for c in report["captures"] if "anomaly" in c["kinds"]}
    assert set(later) <= captured, sorted(captured)
    for step in later:  # every rank wrote the step's trace
        (capture,) = [c for c in report["captures"] if c["step"] == step]
        assert sorted(capture["ranks"]) == ["0", "1"], capture["missing_ranks"]
    assert report["tracer"]["duty_cycle"]["planner_periodic_windows"] >= len(later)
    classes = {c["class"]: c for c in report["anomaly_classes"]}
    periodic = classes["periodic"]
    assert periodic["detected"] >= len(STALLS) and periodic["traced"] >= len(later)
    assert periodic["explained"] >= len(later)
    (every,) = [r for r in report["recurrences"] if r["first_step"] == STALLS[0]]
    assert every["period_steps"] == pytest.approx(PERIOD, abs=1)
    assert every["occurrences"] == len(STALLS) and every["last_step"] == STALLS[-1]
    capsys.readouterr()
    assert cli_main(["report", str(tmp_path / "runs")]) == 0
    text = capsys.readouterr().out
    assert "periodic" in text and "every ~100 steps: 8 times, steps 100 to 800" in text


SLOWDOWN = range(700, 800)  # every rank ~4-6x slower for 100 steps


def test_a_lasting_slowdown_is_traced_within_its_first_two_windows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # ~12 ms steps: away from traced steps a round covers ~80 of them, so the slowdown
    # is traced this early only because its first slow steps end the round early (10
    # steps in on the 2-core VM; without early rounds 25-60). At a 0.1% budget the duty
    # cycle's own windows end with its first measurements (step ~480), before it.
    # At 1.5x a loaded 2-core host makes 4-step noise episodes of up to 2.4x that spend
    # the planner's advance (~2 windows at 0.1%) before step 700: at 2x they are rare,
    # and the mechanism under test is the same. The slowdown adds 60 ms: a loaded CI
    # host ran these steps at 22 ms, where 30 ms more judged only 46 of its 100 steps.
    report = budgeted_job(
        tmp_path, capsys, 2,
        ["--set", "tracer.overhead_budget_pct=0.1", "--set", "detect.multiplier=2"],
        ["--steps", "900", "--width", "16", "--step-sleep", "0.01",
         "--all-slow-steps", ",".join(map(str, SLOWDOWN)), "--all-slow-s", "0.06"],
    )  # fmt: skip
    status = json.loads((tmp_path / "runs" / "latest" / "status.json").read_text())
    # a string: pytest cuts an object's repr in the message, and the counts are the cause
    why = json.dumps([report["tracer"].get("duty_cycle"), status["agent_cost"]])
    # the slowdown ended a round early (where a round happens to end anyway soon after
    # it begins, it is traced early without one: the count tells the two apart)
    assert status["agent_cost"]["early_rounds"] >= 1, why
    judged = [a for a in report["anomalies"] if a["step"] in SLOWDOWN]
    assert len(judged) >= 50, (len(judged), why)
    traced = [a["step"] for a in judged if a["traced"]]
    assert traced and traced[0] - SLOWDOWN.start < 24, (traced[:5], why)
    captured = [c for c in report["captures"] if c["step"] in SLOWDOWN]
    assert captured, (report["captures"], why)  # every rank's trace: the periodic test
