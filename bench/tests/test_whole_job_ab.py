"""bench/whole_job_ab.py and its in-process switch (bench/workloads/ab_switch.py) on the
CPU: segments alternate on, off, off, on; the inert agent does no boundary work; the first
step of every on segment is dropped from the agent's step times (never judged); the
summary pairs each on segment with its neighbour and bounds the spill."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

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


class WatchedLayer:
    """A one-layer loop under an installed agent (tracer off), stepped by `step`."""

    def __init__(self, runs: Path) -> None:
        self.layer = torch.nn.Linear(4, 4)
        self._optimizer = torch.optim.SGD(self.layer.parameters(), lr=1e-3)
        self._inputs = torch.randn(2, 4)
        config = load_config(None, ["tracer.backend=none"])
        self.agent = Agent(config, WorldInfo.from_env({}), runs)
        self.agent.install()

    def step(self) -> None:
        self._optimizer.zero_grad()
        self.layer(self._inputs).sum().backward()
        self._optimizer.step()

    def hooked(self) -> tuple[bool, bool]:
        return bool(self.layer._forward_pre_hooks), bool(self.layer._forward_hooks)


def segmented_run(runs: Path) -> tuple[Agent, dict[str, Any], bool]:
    """A tiny loop under an agent switched by `SegmentedAB`: the (closed) agent, the A/B's
    result, and whether the A/B left the agent watching."""
    loop = WatchedLayer(runs)
    agent = loop.agent
    try:
        ab = SegmentedAB(WARMUP, SEGMENT)
        for _ in range(WARMUP + SEGMENTS * SEGMENT):
            loop.step()
            ab.step_end()
        result = ab.finish()
        watching = not agent.boundaries._boundaries_off
    finally:
        agent.close()
    return agent, result, watching


def test_segments_switch_the_agent_and_drop_each_on_segments_first_step(tmp_path: Path) -> None:
    agent, result, _ = segmented_run(tmp_path / "runs")
    run = agent.run
    segments = result["ab_segments"]
    cost = result["agent_cost_at_end"]
    assert cost["rounds"] >= 1 and "round_pauses" in cost and "round_work_ms" in cost
    assert [s["on"] for s in segments] == [True, False, False, True] * 2
    assert all(s["steps"] == SEGMENT for s in segments)
    assert all(s["boundary_us_per_step"] == 0 for s in segments if not s["on"])
    assert all(s["boundary_us_per_step"] > 0 for s in segments if s["on"])
    assert all(s["traced_boundaries"] == 0 for s in segments)  # no tracer: none traced
    # the phase marks pause with the boundaries (the model is found in the warm-up)
    assert all(s["phase_marks_us_per_step"] == 0 for s in segments if not s["on"])
    assert all(s["phase_marks_us_per_step"] > 0 for s in segments if s["on"])
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
    # and its phase marks stay off, the model unhooked
    assert agent.boundaries.phases.off
    assert not layer._forward_pre_hooks and not layer._forward_hooks


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


def job_envs(monkeypatch: pytest.MonkeyPatch, script: Any) -> list[dict[str, str]]:
    """The environment of every job `script` starts from now on (none runs: each stops
    at once)."""
    seen: list[dict[str, str]] = []

    class Done:
        returncode, stderr = 1, "stopped here"

    def run(*_args: object, env: dict[str, str], **_kwargs: object) -> Done:
        seen.append(env)
        return Done()

    monkeypatch.setattr(script.subprocess, "run", run)
    return seen


def test_a_shells_tweak_never_reaches_a_variant_without_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = load_bench_script("whole_job_ab")
    monkeypatch.setenv("WHOLE_JOB_AB_NO_PAUSES", "1")  # left over in the shell
    seen = job_envs(monkeypatch, script)
    script.run_job("amp", "none", 2, tmp_path)
    script.run_job("amp", "none+nopause", 2, tmp_path)
    assert "WHOLE_JOB_AB_NO_PAUSES" not in seen[0]
    assert seen[1]["WHOLE_JOB_AB_NO_PAUSES"] == "1"


def _abba_segments(
    units: int, ratio: float, noise: float, seed: int, drift: float = 0.0, steps: int = 8
) -> list[dict[str, object]]:
    """Synthetic segments in the A/B's order (on, off, off, on, ...): a base time per step
    that drifts (`drift`: the whole run's rise, plus a slow wave), times `ratio` in on
    segments, times lognormal noise of sd `noise`."""
    import math
    import random

    rng = random.Random(seed)
    segments: list[dict[str, object]] = []
    count = 4 * units
    for index in range(count):
        on = index % 4 in (0, 3)
        base = 10.0 * (1 + drift * index / count) * (1 + 0.1 * math.sin(index / 7))
        ms = base * (ratio if on else 1.0) * math.exp(rng.gauss(0.0, noise))
        segments.append({"on": on, "steps": steps, "ms_per_step": ms,
                         "boundary_us_per_step": 0.0, "threads_cpu_us_per_step": 0.0})  # fmt: skip
    return segments


def test_the_abba_interval_covers_a_known_ratio_under_drift() -> None:
    """A known 2% cost under a 30% drift and 5% noise: the ABBA interval holds 1.02 and
    not 1.0; with no cost it holds 1.0. Over 200 simulated runs each of its intervals
    holds the truth 90-99% of the time (a biased estimator or a mis-sized interval
    fails), and the point estimates centre on it."""
    script = load_bench_script("whole_job_ab")
    summary = script.summarize(_abba_segments(150, 1.02, 0.05, seed=1, drift=0.3))
    assert summary["abba_units"] == 150
    low, high = summary["abba_ci95"]
    assert low <= 1.02 <= high and low > 1.0, summary
    assert summary["abba_halfwidth_pct"] == pytest.approx((high - low) / 2 * 100, abs=1e-2)
    low, high = summary["abba_trimmed_ci95"]
    assert low <= 1.02 <= high and low > 1.0, summary
    null = script.summarize(_abba_segments(150, 1.0, 0.05, seed=2, drift=0.3))
    assert null["abba_ci95"][0] <= 1.0 <= null["abba_ci95"][1], null
    for prefix in ("abba_", "abba_trimmed_"):
        covered, estimates = 0, []
        for seed in range(200):
            s = script.summarize(_abba_segments(40, 1.01, 0.05, seed=100 + seed, drift=0.3))
            low, high = s[f"{prefix}ci95"]
            covered += low <= 1.01 <= high
            estimates.append(s[f"{prefix}ratio"])
        assert 180 <= covered <= 198, (prefix, covered)
        assert sum(estimates) / len(estimates) == pytest.approx(1.01, abs=0.002), prefix


def test_abba_units_weight_each_half_by_its_steps_and_skip_broken_units() -> None:
    script = load_bench_script("whole_job_ab")

    def seg(on: bool, steps: int, ms: float) -> dict[str, object]:
        return {"on": on, "steps": steps, "ms_per_step": ms}

    # on: 30 steps at 11 ms and 10 at 10 ms (10.75 a step); off: 10 ms
    unit = [seg(True, 30, 11.0), seg(False, 10, 10.0), seg(False, 10, 10.0), seg(True, 10, 10.0)]
    [(log_ratio, weight)] = script.abba_units(unit)
    assert log_ratio == pytest.approx(math.log(1.075)) and weight == 40
    # a unit out of order (a job that ended early, or another order) is not a unit
    assert script.abba_units(unit[1:] + unit[:1]) == []
    assert script.abba_units(unit[:3]) == []


def test_t_quantile_matches_tables() -> None:
    script = load_bench_script("whole_job_ab")
    for df, value in ((5, 2.5706), (10, 2.2281), (30, 2.0423), (100, 1.9840)):
        assert script.t_quantile(0.975, df) == pytest.approx(value, rel=2e-3)


def test_a_sham_spin_costs_only_the_on_half_and_the_summary_finds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`+sham+spin<N>us`: the agent inert in both halves, N us busy-waited at each step of
    an on segment only; the summary's injected ratio is the spin measured."""
    monkeypatch.setenv("WHOLE_JOB_AB_SHAM", "1")
    monkeypatch.setenv("WHOLE_JOB_AB_SPIN_US", "2000")
    _, result, watching = segmented_run(tmp_path)
    assert watching  # the A/B left the agent watching
    segments = result["ab_segments"]
    assert result["ab_injected"] == {"sham": True, "spin_us": 2000.0, "spin_pct": 0.0}
    assert all(s["boundary_us_per_step"] == 0 for s in segments)  # inert in both halves
    assert all(s["spin_us_per_step"] >= 2000 for s in segments if s["on"])
    assert all(s["spin_us_per_step"] == 0 for s in segments if not s["on"])
    assert all(s["cpu_ms_per_step"] > 0 and s["gc_collections"] >= 0 for s in segments)
    summary = load_bench_script("whole_job_ab").summarize(segments)
    assert summary["abba_units"] == SEGMENTS // 4
    assert summary["injected_ratio"] > 1.0
    assert summary["abba_ratio"] > 1.0  # 2 ms a step on a loop of well under 2 ms


def test_spin_tweaks_are_parsed_and_reach_the_job(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = load_bench_script("whole_job_ab")
    assert script.tweak_env("spin200us") == {"WHOLE_JOB_AB_SPIN_US": "200"}
    assert script.tweak_env("spin1.5pct") == {"WHOLE_JOB_AB_SPIN_PCT": "1.5"}
    assert script.tweak_env("spin") is None and script.tweak_env("spin5ms") is None
    assert script.known_variant("none+sham+spin1pct")
    assert not script.known_variant("none+spin1")
    monkeypatch.setenv("WHOLE_JOB_AB_SPIN_US", "7")  # left over in the shell
    seen = job_envs(monkeypatch, script)
    script.run_job("amp", "none", 2, tmp_path)
    script.run_job("amp", "none+sham+spin2pct", 2, tmp_path, segment_steps=3)
    assert "WHOLE_JOB_AB_SPIN_US" not in seen[0] and "WHOLE_JOB_AB_SHAM" not in seen[0]
    assert seen[1]["WHOLE_JOB_AB_SPIN_PCT"] == "2" and seen[1]["WHOLE_JOB_AB_SHAM"] == "1"
    assert seen[1]["WHOLE_JOB_AB_SEGMENT"] == "3"


def test_a_jobs_segments_are_cut_to_what_the_budget_has_left() -> None:
    ab = load_bench_script("whole_job_ab")
    step_s = 0.0162 * ab.STEP_MARGIN  # HF at its nominal 16.2 ms, and the margin
    # 24 steps a segment, 200 warm-up steps, 30 s of start and end
    assert ab.segments_that_fit("hf", 1000, 10_000.0, 0.0, None) == 1000  # room for all
    expected = int((300 - 30 - 200 * step_s) / (24 * step_s))
    assert ab.segments_that_fit("hf", 1000, 300.0, 0.0, None) == expected
    # a longer warm-up (617 steps: 10 s at the nominal step) and shorter segments
    expected = int((300 - 30 - 617 * step_s) / (12 * step_s))
    assert ab.segments_that_fit("hf", 2000, 300.0, 10.0, 12) == expected
    assert ab.segments_that_fit("hf", 4, 10_000.0, 0.0, None) == 4  # never more than asked
    assert ab.segments_that_fit("lightning", 1000, 31.0, 0.0, None) == 0  # not two units


def test_units_with_a_traced_window_are_split_off_and_their_excess_is_tracings() -> None:
    ab = load_bench_script("whole_job_ab")

    def unit(on_ms: float, on_steps: int) -> list[dict[str, Any]]:
        on = {"on": True, "steps": on_steps, "ms_per_step": on_ms}
        off = {"on": False, "steps": 10, "ms_per_step": 1.0}
        return [on, off, dict(off), dict(on)]

    # 18 untraced units at +2% (one at +3%: an interval), 2 whose on segments ran on to
    # the end of a traced window (20 steps) at +20%
    segments = [s for _ in range(17) for s in unit(1.02, 10)] + unit(1.03, 10)
    segments += [s for _ in range(2) for s in unit(1.20, 20)]
    split = ab.split_by_tracing(segments, 10)
    assert split["abba_untraced_units"] == 18
    assert split["extended_on_share"] == round(80 / (18 * 20 + 80), 4)
    assert 1.020 < split["abba_untraced_ratio"] < 1.022
    low, high = split["abba_untraced_ci95"]
    assert low < split["abba_untraced_ratio"] < high
    whole = math.exp(ab.weighted_t_interval(ab.abba_units(segments))[0])
    assert split["tracing_pct"] == round((whole - split["abba_untraced_ratio"]) * 100, 3)
    assert split["tracing_pct"] > 2.0  # 18% more on 18% of the on steps
    assert ab.split_by_tracing(segments, None) == {}
    assert ab.split_by_tracing(unit(1.2, 20), 10) == {}  # no untraced unit
    # an older result's on segment followed by an on one is never run on: its heavy
    # boundaries say it held a traced window
    boundaries = [{**s, "boundary_us_per_step": 60.0 if s["on"] else 0.0} for s in segments]
    boundaries[3]["boundary_us_per_step"] = 100.0  # the first unit's last on segment
    assert ab.split_by_tracing(boundaries, 10)["abba_untraced_units"] == 17
    # where the segments count their traced boundaries, that count decides
    counted = [{**s, "traced_boundaries": 5 if s["steps"] > 10 else 0} for s in segments]
    assert ab.split_by_tracing(counted, 10)["abba_untraced_units"] == 18
    counted[0]["traced_boundaries"] = 3  # a traced window inside the first on segment
    assert ab.split_by_tracing(counted, 10)["abba_untraced_units"] == 17


def test_the_inert_half_lifts_the_models_hooks_and_puts_them_back(tmp_path: Path) -> None:
    loop = WatchedLayer(tmp_path)
    hooked = []
    try:
        ab = SegmentedAB(WARMUP, SEGMENT)
        for _ in range(WARMUP + 4 * SEGMENT):
            loop.step()
            ab.step_end()
            if ab.index >= 0:
                hooked.append((ab.on, loop.hooked()))
        ab.finish()
        assert loop.hooked() == (True, True)  # watching again
    finally:
        loop.agent.close()
    assert {state for on, state in hooked if on} == {(True, True)}
    assert {state for on, state in hooked if not on} == {(False, False)}


def test_finishing_in_an_off_segment_leaves_the_agent_watching(tmp_path: Path) -> None:
    loop = WatchedLayer(tmp_path)
    boundaries = loop.agent.boundaries
    try:
        ab = SegmentedAB(WARMUP, SEGMENT)
        for _ in range(WARMUP + SEGMENT + 3):  # into the first off segment
            loop.step()
            ab.step_end()
        assert not ab.on and boundaries.phases.off and loop.hooked() == (False, False)
        ab.finish()
        assert not boundaries._boundaries_off and not boundaries.phases.off
        assert loop.hooked() == (True, True)
    finally:
        loop.agent.close()
