"""End to end (CPU, 4 gloo ranks, real torchrun, the default config): one fault per kind
where users have them, each on its own rank and step, named with the right rank, cause
and phase; and the same with every step traced (the trace never makes it worse)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distanom.cli import main as cli_main
from distanom.records.steps import read_steps
from tests.conftest import REPO, torchrun

SCRIPT = REPO / "tests" / "e2e" / "scripts" / "phases_train.py"
FAULT_S = 0.4  # each fault's sleep (phases_train.FAULT_S)
# (kind, rank, step) -> (cause, phase) expected
FAULTS = {
    ("data", 1, 60): ("data_loading", "data"),
    ("forward", 2, 85): ("host_busy", "forward"),
    ("tail", 3, 110): ("host_stall", "backward"),
    ("optimizer", 0, 135): ("host_stall", "optimizer"),
    ("gc", 1, 160): ("python_gc", None),
}
SPEC = ",".join(f"{kind}:{rank}:{step}" for kind, rank, step in FAULTS)


def _report(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert cli_main(["report", str(run_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _check(report: dict, traced: bool) -> list[str]:
    """What does not match: each fault's step named with its rank, cause and phase. A
    CPU-only trace names a busy host's grown ops `compute` (its host timeline), with the
    ops listed: the same finding as `host_busy`, said more closely."""
    anomalies = {a["step"]: a for a in report["anomalies"]}
    wrong = []
    for (kind, rank, step), (cause, phase) in FAULTS.items():
        verdict = (anomalies.get(step) or {}).get("verdict") or {}
        got = (verdict.get("culprit_rank"), verdict.get("cause"), verdict.get("phase"))
        causes = {cause, "compute"} if traced and cause == "host_busy" else {cause}
        if got[0] != rank or got[1] not in causes or (phase is not None and got[2] != phase):
            wrong.append(f"{kind} (rank {rank}, step {step}): got {got}: {verdict}")
    return wrong


@pytest.mark.parametrize("traced", [False, True], ids=["default", "every_step_traced"])
def test_each_fault_is_named_with_its_rank_cause_and_phase(
    traced: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    launch = ["--run-dir", "runs"]
    if traced:
        launch += ["--set", "tracer.overhead_budget_pct=null"]
    done = torchrun(
        4, launch, ["--steps", "180", "--faults", SPEC], cwd=tmp_path, script=SCRIPT, timeout=280
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = _report(tmp_path / "runs", capsys)
    wrong = _check(report, traced)
    assert not wrong, json.dumps({"wrong": wrong, "log": done.stderr[-1500:]}, indent=1)
    # the steps after a sleep after the collective wait for that rank: linked to it
    for step, rank in ((111, 3), (136, 0)):
        knock = next((a["verdict"] for a in report["anomalies"] if a["step"] == step), None)
        if knock is not None:  # anomalous when the others' wait made it so
            assert knock["culprit_rank"] == rank, knock
            assert knock["details"].get("knock_on_of") == step - 1, knock
    # the report leads with the time lost: the GC pause (~1-2 s) is the largest share
    largest = report["lost_time"]["by_culprit"][0]
    assert (largest["culprit_rank"], largest["cause"]) == (1, "python_gc"), report["lost_time"]
    data = next(a for a in report["anomalies"] if a["step"] == 60)["verdict"]
    # The worker sleeps 400 ms in step 60's batch. With the DataLoader's default prefetch
    # (2 batches a worker) it is asked for that batch as step 58's is taken, and starts
    # it as soon as step 59's is done: rank 1 then waits 400 ms less at most what steps
    # 58 and 59 took (a CI run with every step traced waited 286 ms, against the fixed
    # 300 this asserted before).
    rows = read_steps(tmp_path / "runs" / "latest" / "steps" / "rank1.csv").rows
    ahead = sum(r.duration_ms for r in rows if r.step in (58, 59))
    waited = 1000 * FAULT_S - ahead - 5  # 5 ms: the clocks' and the worker's own overhead
    assert data["phases_ms"]["data"] >= waited and data["fetch_ms"] >= waited, (ahead, data)


NOISE_STEPS = 300


def test_a_fault_free_run_stays_under_the_noise_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # issue 36's target at the default config: at most 1 anomaly per 100 steps for a
    # fault-free 4-rank CPU job (DataLoader workers) on the loaded 2-core host; at 1.5x
    # alone it raised 4 per 100 there, and jitter named stragglers and periods
    done = torchrun(
        4, ["--run-dir", "runs"], ["--steps", str(NOISE_STEPS)], cwd=tmp_path, script=SCRIPT,
        timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = _report(tmp_path / "runs", capsys)
    seen = [(a["step"], round(a["ratio"], 2)) for a in report["anomalies"]]
    assert len(seen) <= NOISE_STEPS // 100, seen
    assert report["stragglers"] == [] and report["earlier_stragglers"] == [], report["stragglers"]
    assert report["recurrences"] == [], report["recurrences"]
