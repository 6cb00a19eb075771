"""distanom's own time as status.json's `agent_cost` gives it: one-off work (install, the
first boundaries, the tracer's start, the end) reported once in ms, not spread over the
steps; tracer switches apart; the steady boundary's mean split into named parts that add
up to it (`distanom.own_time`)."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from distanom import boundary as boundary_module
from distanom import clock as clock_module
from distanom.agent import Agent
from distanom.config import load_config
from distanom.governor import GovernorParams
from distanom.own_time import CPU_SAMPLE_EVERY, PARTS, STARTUP_BOUNDARIES
from distanom.world import WorldInfo
from tests.unit.test_quiet_boundaries import WINDOW, OffTracer, ScriptedGovernor, train

CONFIG = ["tracer.backend=none", "detect.warmup_steps=0", "detect.min_steps=5"]


def spin(seconds: float) -> None:
    """Busy for `seconds` on this thread (a sleep would do too: the meters read wall time)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def run(tmp_path: Path, steps: int, overrides: list[str] | None = None) -> Agent:
    config = load_config(None, [*CONFIG, *(overrides or [])])
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    model = torch.nn.Linear(8, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        train(agent, model, sgd, steps)
    finally:
        agent.close()
    return agent


def final_cost(agent: Agent) -> dict[str, Any]:
    assert agent.run is not None
    status = json.loads((agent.run.path / "status.json").read_text())
    assert status["state"] == "finished"
    cost: dict[str, Any] = status["agent_cost"]
    return cost


def test_start_up_and_the_end_are_reported_once_in_ms_not_per_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a slow install, a slow first boundary (the clock and tracer made, a CUPTI
    # calibration) and a slow drain: 60 + 80 + 50 ms of one-off work over a 40-step run
    for owner, name, seconds in (
        (boundary_module.StepBoundaries, "install_hook", 0.06),
        (boundary_module.StepBoundaries, "_first_boundary", 0.08),
        (clock_module.StepClock, "drain", 0.05),
    ):
        original = getattr(owner, name)

        def slowed(*args: Any, _original: Any = original, _s: float = seconds) -> Any:
            spin(_s)
            return _original(*args)

        monkeypatch.setattr(owner, name, slowed)
    agent = run(tmp_path, 40)
    cost = final_cost(agent)
    assert cost["steps"] == 40
    assert cost["startup_ms"] >= 140
    assert cost["startup_boundaries"] == STARTUP_BOUNDARIES
    assert cost["teardown_ms"] >= 50
    assert cost["steady_boundaries"] == 40 - STARTUP_BOUNDARIES
    # spread over the steps, the one-off work would read 3.5 ms a step
    assert 0 < cost["boundary_us_per_step"] < 1000
    # every boundary's time is still there in all
    assert cost["boundary_ns"] >= 80e6


def test_tracer_switches_are_tracing_s_cost_not_the_step_end_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class SlowSwitch(OffTracer):
        slowed: int | None = None  # the one switch three times as slow (from step 60)

        def set_tracing(self, on: bool) -> None:
            if self.slowed is None and self.marks[-1] >= 60:
                self.slowed = self.marks[-1]
                spin(0.06)
            else:
                spin(0.02)  # a CUPTI attach or detach: milliseconds
            super().set_tracing(on)

    config = load_config(None, [*CONFIG, "detect.multiplier=50", "capture.reference_every_steps=0"])
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    agent.duty.governor = ScriptedGovernor(5.0, GovernorParams(window_steps=WINDOW), first_step=1)
    tracer = SlowSwitch()
    model = torch.nn.Linear(8, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        train(agent, model, sgd, 1)
        agent.tracer = tracer  # type: ignore[assignment]
        agent.boundaries.tracer_started = True
        train(agent, model, sgd, 119)
    finally:
        agent.close()
    cost = final_cost(agent)
    later = [step for step, _on in tracer.switches if step >= STARTUP_BOUNDARIES]
    assert len(later) >= 5
    assert cost["tracer_switches"] == len(later)
    assert cost["tracer_switch_ms"] >= 20 * len(later)
    assert cost["traced_boundaries"] >= 3 * (WINDOW - 1)  # both switches of a window apart
    # spread over 120 steps the switches would read over 1 ms a step
    assert 0 < cost["boundary_us_per_step"] < 1000
    # a switch at step N's end runs after N's clock mark: its time is in step N + 1. The
    # first after start-up and one far slower than the latest are carried into N + 1's
    # self_ms (discounted when judged); ordinary ones are the after-flush baseline's
    assert agent.run is not None
    with open(agent.run.steps_csv(0)) as handle:
        self_ms = {int(row["step"]): float(row["self_ms"]) for row in csv.DictReader(handle)}
    assert tracer.slowed is not None and tracer.slowed in later
    assert self_ms[later[0] + 1] >= 20
    assert self_ms[tracer.slowed + 1] >= 60
    ordinary = [s for s in later[1:] if s != tracer.slowed and s + 1 in self_ms]
    assert len(ordinary) >= 3
    assert sum(1 for s in ordinary if self_ms[s + 1] < 20) >= 0.8 * len(ordinary)


def test_the_step_end_s_parts_are_named_and_add_up_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mark = clock_module.StepClock.mark

    def slow_mark(clock: Any, step: int) -> Any:
        spin(0.002)
        return mark(clock, step)

    monkeypatch.setattr(clock_module.StepClock, "mark", slow_mark)
    agent = run(tmp_path, 60)
    cost = final_cost(agent)
    parts = cost["boundary_parts_us"]
    assert list(parts) == list(PARTS)
    assert parts["clock"] >= 2000
    assert all(parts[name] < 1000 for name in PARTS if name != "clock")
    assert sum(parts.values()) == pytest.approx(cost["boundary_us_per_step"], rel=0.01)


def test_the_marks_records_waits_are_given_beside_the_marks_and_charged() -> None:
    from distanom.own_time import BoundaryMeters, own_cost_body

    meters = BoundaryMeters()
    meters.steady_boundaries, meters.steady_ns = 10, 1_000_000  # 100 us each
    args = {"steps": 10, "boundary_ns": 1_000_000, "phase_marks_ns": 400_000}
    before = own_cost_body(meters, **args, control_cpu_ns=200_000, median_ms=1.0)
    # (100 + 40 + 20) us added to a step of 1 ms with them: of the 0.84 ms without
    assert before["pct_of_median_step"] == pytest.approx(100 * 0.16 / 0.84, abs=1e-4)
    assert before["median_step_ms"] == 1.0
    assert before["phase_marks_wait_us_per_step"] == 0.0 and before["record_floor_us"] is None
    assert before["boundary_cpu_share"] is None
    meters.cpu_sample_ns, meters.cpu_sample_wall_ns = 30_000, 60_000  # half of it ran
    cost = own_cost_body(
        meters, **args, control_cpu_ns=200_000, median_ms=1.0, phase_marks_sample=(10, 40),
        phase_marks_wait=(300_000, 2.5),
    )  # fmt: skip
    assert (cost["boundary_cpu_share"], cost["phase_marks_cpu_share"]) == (0.5, 0.25)
    assert cost["phase_marks_us_per_step"] == 40.0  # all of it: the waits are charged
    assert cost["phase_marks_wait_us_per_step"] == 30.0 and cost["record_floor_us"] == 2.5
    assert cost["pct_of_median_step"] == pytest.approx(100 * 0.16 / 0.84, abs=1e-4)
    # a wait read over the marks' own time (counters read a moment apart) is cut to it
    over = own_cost_body(
        meters, **args, control_cpu_ns=0, median_ms=1.0, phase_marks_wait=(900_000, 2.5)
    )
    assert over["phase_marks_wait_us_per_step"] == 40.0
    assert over["pct_of_median_step"] == pytest.approx(100 * 0.14 / 0.86, abs=1e-4)
    # a median no longer than distanom's own time (a broken clock): no percentage
    broken = own_cost_body(meters, **args, control_cpu_ns=0, median_ms=0.1)
    assert broken["pct_of_median_step"] is None


def test_queue_waits_are_the_records_time_over_their_median() -> None:
    from distanom.phases import PhaseMarks

    marks = PhaseMarks()
    assert marks.queue_waits_ns() == (0, None)
    # most records wait for nothing (1-2 us: jitter, charged); two waited
    walls = [1_000] * 3 + [2_000] * 3 + [9_000] * 2
    marks.record_walls.extend(walls)
    marks.record_ns, marks.records = sum(walls) + 500_000, 9  # one more, unsampled: 500 us
    wait, floor = marks.queue_waits_ns()
    assert floor == 2.0
    assert wait == sum(walls) + 500_000 - 9 * 2_000
    # every record as slow: that is what a record costs here, no wait
    marks.record_walls.clear()
    marks.record_walls.extend([9_000] * 8)
    marks.record_ns, marks.records = 8 * 9_000, 8
    assert marks.queue_waits_ns() == (0, 9.0)


class SlowRecords:
    """Phase-mark event calls whose every third record waits (as on a full CUDA launch
    queue), working (`busy`: a spin) or asleep."""

    def __init__(self, busy: bool) -> None:
        self.busy = busy
        self.records = 0

    @staticmethod
    def stream_key() -> str:
        return "s0"

    @staticmethod
    def stream_of(key: str) -> str:
        return key

    @staticmethod
    def new_event() -> object:
        return object()

    def record(self, event: object, stream: str) -> None:
        self.records += 1
        if not self.records % 3:
            spin(0.001) if self.busy else time.sleep(0.001)


@pytest.mark.parametrize("busy", [False, True])
def test_the_cpu_shares_tell_waits_from_work_and_the_marks_waits_are_told_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, busy: bool
) -> None:
    # a clock mark and phase events that wait 1 ms (sleep: no CPU) or work 1 ms (spin)
    original = clock_module.StepClock.mark

    def slow_mark(clock: Any, step: int) -> Any:
        spin(0.001) if busy else time.sleep(0.001)
        return original(clock, step)

    monkeypatch.setattr(clock_module.StepClock, "mark", slow_mark)
    config = load_config(None, CONFIG)
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    agent.boundaries.phases.use_gpu(SlowRecords(busy))
    model = torch.nn.Linear(8, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        train(agent, model, sgd, 100)
    finally:
        agent.close()
    cost = final_cost(agent)
    marks = agent.boundaries.phases
    # every record is counted; only those of 1 step in CPU_SAMPLE_EVERY keep their wall
    assert marks.records >= 2 * 90, marks.records
    assert 0 < len(marks.record_walls) <= 2 * (100 // CPU_SAMPLE_EVERY + 1)
    assert cost["boundary_us_per_step"] > 1000
    # a record in three waited 1 ms (two records a step): charged, and told apart from
    # what the rest cost (the floor)
    assert cost["phase_marks_wait_us_per_step"] > 500, cost
    assert cost["phase_marks_us_per_step"] > cost["phase_marks_wait_us_per_step"], cost
    assert cost["record_floor_us"] < 300, cost
    shares = (cost["boundary_cpu_share"], cost["phase_marks_cpu_share"])
    if busy:
        assert min(shares) > 0.6, shares
    else:
        assert max(shares) < 0.4, shares
