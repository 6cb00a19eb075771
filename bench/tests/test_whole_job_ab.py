"""bench/whole_job_ab.py and its in-process switch (bench/workloads/ab_switch.py) on the
CPU: segments alternate on, off, off, on; the inert agent does no boundary work; the first
step of every on segment is dropped from the agent's step times (never judged); the
summary pairs each on segment with its neighbour and bounds the spill."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from bench.tests.scripts import BENCH, load_bench_script
from distanom.agent import Agent
from distanom.config import load_config
from distanom.records.steps import read_steps
from distanom.world import WorldInfo

sys.path.insert(0, str(BENCH / "workloads"))
from ab_switch import SegmentedAB

WARMUP, SEGMENT, SEGMENTS = 30, 10, 8


def test_segments_switch_the_agent_and_drop_each_on_segments_first_step(tmp_path: Path) -> None:
    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    inputs = torch.randn(2, 4)
    config = load_config(None, ["tracer.backend=none"])
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    try:
        ab = SegmentedAB(WARMUP, SEGMENT)
        for _ in range(WARMUP + SEGMENTS * SEGMENT):
            optimizer.zero_grad()
            layer(inputs).sum().backward()
            optimizer.step()
            ab.step_end()
        result = ab.finish()
        run = agent.run
    finally:
        agent.close()
    segments = result["ab_segments"]
    cost = result["agent_cost_at_end"]
    assert cost["rounds"] >= 1 and "round_pauses" in cost and "round_work_ms" in cost
    assert [s["on"] for s in segments] == [True, False, False, True] * 2
    assert all(s["steps"] == SEGMENT for s in segments)
    assert all(s["boundary_us_per_step"] == 0 for s in segments if not s["on"])
    assert all(s["boundary_us_per_step"] > 0 for s in segments if s["on"])
    # the training thread's blocks per step: counted on Linux (None elsewhere), never < 0
    blocks = [s["training_blocks_per_step"] for s in segments]
    if sys.platform.startswith("linux"):
        assert all(b is not None and b >= 0 for b in blocks), blocks
    # the agent counted only the on segments' steps (and the warm-up)
    on_steps = sum(s["steps"] for s in segments if s["on"])
    assert agent.current_step == WARMUP + on_steps
    assert run is not None
    rows = read_steps(run.path / "steps" / "rank0.csv").rows
    timed = {row.step for row in rows}
    # each on segment's first step (agent numbering) has no duration: after a
    # synchronize, or spanning the inert segment before it
    firsts, step = [], WARMUP
    for s in segments:
        if s["on"]:
            firsts.append(step)
            step += s["steps"]
    assert firsts and not timed & set(firsts), sorted(timed & set(firsts))
    assert {f + 1 for f in firsts} <= timed  # the steps after them are timed


def test_the_summary_pairs_neighbours_and_adds_the_spill_back() -> None:
    script = load_bench_script("whole_job_ab")

    def seg(on: bool, ms: float, cpu_us: float = 0.0) -> dict[str, object]:
        return {"on": on, "steps": 10, "ms_per_step": ms, "boundary_us_per_step": 5.0,
                "threads_cpu_us_per_step": cpu_us}  # fmt: skip

    segments = [seg(True, 10.2), seg(False, 10.0, 100.0), seg(False, 20.0), seg(True, 20.2)]
    summary = script.summarize(segments)
    assert summary["pairs"] == 2
    assert summary["mean_ratio"] == pytest.approx((1.02 + 1.01) / 2, abs=1e-5)
    # 100 us/step of distanom's threads in the first off segment, added to its on side
    assert summary["spill_added_mean_ratio"] == pytest.approx((1.03 + 1.01) / 2, abs=1e-5)
    assert summary["ci95"][0] <= summary["mean_ratio"] <= summary["ci95"][1]
    assert script.summarize([seg(True, 1.0)]) == {"pairs": 0}
    # segments without the blocks count (another OS, or older results): None, not 0
    assert summary["on_training_blocks_per_step"] is None


def test_the_summary_averages_the_training_threads_blocks_per_half() -> None:
    script = load_bench_script("whole_job_ab")

    def seg(on: bool, waits: float | None) -> dict[str, object]:
        return {"on": on, "steps": 10, "ms_per_step": 10.0, "boundary_us_per_step": 5.0,
                "threads_cpu_us_per_step": 0.0, "training_blocks_per_step": waits}  # fmt: skip

    summary = script.summarize([seg(True, 0.3), seg(False, 0.0), seg(False, 0.1), seg(True, 0.5)])
    assert summary["on_training_blocks_per_step"] == pytest.approx(0.4)
    assert summary["off_training_blocks_per_step"] == pytest.approx(0.05)
    # a segment that could not read the count is left out of its half's mean
    summary = script.summarize([seg(True, 0.3), seg(False, None), seg(False, 0.1), seg(True, None)])
    assert summary["on_training_blocks_per_step"] == pytest.approx(0.3)
    assert summary["off_training_blocks_per_step"] == pytest.approx(0.1)


def test_an_agent_closed_in_an_off_segment_still_finishes(tmp_path: Path) -> None:
    """A job that fails while the A/B holds the agent inert: `close` still drains and ends
    the run (inert is not `closed`), and the A/B never revives a closed agent."""
    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    agent = Agent(load_config(None, ["tracer.backend=none"]), WorldInfo.from_env({}), tmp_path)
    agent.install()
    ab = SegmentedAB(WARMUP, SEGMENT)
    for _ in range(WARMUP + SEGMENT + 3):  # into the first off segment
        optimizer.step()
        ab.step_end()
    assert not ab.on
    agent.close(outcome="failed", exit_code=1)
    assert not agent.control.is_alive()
    assert agent.run is not None
    status = json.loads((agent.run.path / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 1
    ab.finish()  # the A/B's own end: the closed agent stays closed
    assert agent.boundaries.closed


def test_pairs_are_weighted_by_their_on_segments_steps() -> None:
    """An on segment that ran on through a traced window holds more of the job's steps:
    its pair counts for them, or the tracing cost would be diluted."""
    script = load_bench_script("whole_job_ab")

    def seg(on: bool, steps: int, ms: float) -> dict[str, object]:
        return {"on": on, "steps": steps, "ms_per_step": ms, "boundary_us_per_step": 5.0,
                "threads_cpu_us_per_step": 0.0}  # fmt: skip

    segments = [
        seg(True, 30, 11.0),
        seg(False, 10, 10.0),
        seg(False, 10, 10.0),
        seg(True, 10, 10.0),
    ]
    summary = script.summarize(segments)
    assert summary["mean_ratio"] == pytest.approx((30 * 1.1 + 10 * 1.0) / 40, abs=1e-5)
    assert summary["median_ratio"] == pytest.approx(1.05, abs=1e-5)  # unweighted


def test_a_nopause_variant_runs_its_base_with_rounds_unpaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = load_bench_script("whole_job_ab")
    assert script.split_variant("none+nopause") == ("none", ["nopause"])
    assert script.split_variant("default") == ("default", [])
    import distanom.pacing

    def pause_of_a_fresh_pacer() -> float:
        pacer = distanom.pacing.RoundPacer()  # as the control loop begins a pass
        pacer.begin(10.0, 128, final=False)  # 10 ms steps, work not measured yet
        return pacer.pause_s

    assert pause_of_a_fresh_pacer() > 0  # paced as it is
    # the job's environment, as run_job sets it; pace_s is restored after the test
    monkeypatch.setattr(distanom.pacing, "pace_s", distanom.pacing.pace_s)
    monkeypatch.setenv("WHOLE_JOB_AB_NO_PAUSES", "1")
    agent = Agent(load_config(None, ["tracer.backend=none"]), WorldInfo.from_env({}), tmp_path)
    agent.install()
    try:
        ab = SegmentedAB(WARMUP, SEGMENT)
        assert pause_of_a_fresh_pacer() == 0.0
        assert ab.finish()["ab_unpaced"] is True
    finally:
        agent.close()


def test_variants_and_their_tweaks_are_checked_before_any_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = load_bench_script("whole_job_ab")
    ran: list[str] = []
    monkeypatch.setattr(script, "run_job", lambda *a, **k: ran.append(a[1]) or {"rc": 0})
    for bad in ("none+bogus", "plain+nopause", "nothing"):
        argv = ["whole_job_ab.py", "--variants", bad, "--out", str(tmp_path)]
        monkeypatch.setattr(sys, "argv", argv)
        assert script.main() == 2
        assert bad in capsys.readouterr().err
    assert not ran


def test_a_shells_tweak_never_reaches_a_variant_without_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = load_bench_script("whole_job_ab")
    monkeypatch.setenv("WHOLE_JOB_AB_NO_PAUSES", "1")  # left over in the shell
    seen: list[dict[str, str]] = []

    class Done:
        returncode, stderr = 1, "stopped here"

    def run(*_args: object, env: dict[str, str], **_kwargs: object) -> Done:
        seen.append(env)
        return Done()

    monkeypatch.setattr(script.subprocess, "run", run)
    script.run_job("amp", "none", 2, tmp_path)
    script.run_job("amp", "none+nopause", 2, tmp_path)
    assert "WHOLE_JOB_AB_NO_PAUSES" not in seen[0]
    assert seen[1]["WHOLE_JOB_AB_NO_PAUSES"] == "1"
