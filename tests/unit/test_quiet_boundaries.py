"""Quiet boundaries: inside a run of steps the duty cycle decided untraced, with the
tracer off, a boundary only marks the step (`StepBoundaries._quiet_from`). What is
traced must be exactly what asking the duty cycle at every boundary would trace,
requests made during a quiet run included."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from distanom.agent import Agent
from distanom.config import load_config
from distanom.duty_cycle import DutyCycle
from distanom.governor import GovernorParams, OverheadGovernor
from distanom.world import WorldInfo

WINDOW = 8


class ScriptedGovernor(OverheadGovernor):
    """Always ready; every 4th window of 8 steps (from step 1) traced."""

    def ready(self, step: int) -> bool:
        return True

    def tracing_on(self, step: int) -> bool:
        return scripted(step)


def scripted(step: int) -> bool:
    return ((step - 1) // WINDOW) % 4 == 0


class OffTracer:
    """Records what is in force at each mark; quiet whenever it is off."""

    name = "off"

    def __init__(self) -> None:
        self.tracing = False
        self.boundary_flushes = 0
        self.marks: list[int] = []
        self.switches: list[tuple[int, bool]] = []

    @property
    def quiet(self) -> bool:
        return not self.tracing

    def start(self) -> None: ...

    def mark_step(self, step: int, host_end_ns: int) -> None:
        self.marks.append(step)

    def set_tracing(self, on: bool) -> None:
        self.switches.append((self.marks[-1], on))
        self.tracing = on

    def end_of_training(self) -> None: ...
    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None: ...


class NeverQuietTracer(OffTracer):
    @property
    def quiet(self) -> bool:
        return False


def train(agent: Agent, model: torch.nn.Module, sgd: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        sgd.step()
        sgd.zero_grad()


def traced_steps(agent: Agent) -> dict[int, bool]:
    assert agent.run is not None
    with open(agent.run.steps_csv(0)) as handle:
        return {int(r["step"]): r["traced"] == "1" for r in csv.DictReader(handle)}


@pytest.mark.parametrize("quiet", [True, False])
def test_quiet_boundaries_trace_exactly_what_the_duty_cycle_decides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quiet: bool
) -> None:
    config = load_config(
        None,
        [
            "tracer.backend=none",  # the stand-in tracer is put in place by hand
            "detect.multiplier=50",  # nothing to capture: the stand-in holds no events
            "capture.reference_every_steps=0",
        ],
    )
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    governor = ScriptedGovernor(5.0, GovernorParams(window_steps=WINDOW), first_step=1)
    agent.duty.governor = governor
    asked = [0]
    wanted = agent.duty.wanted

    def counted(next_step: int) -> bool | None:
        asked[0] += 1
        return wanted(next_step)

    monkeypatch.setattr(agent.duty, "wanted", counted)
    # the reference: a tracer never quiet, so the duty cycle is asked at every boundary
    tracer = OffTracer() if quiet else NeverQuietTracer()
    model = torch.nn.Linear(8, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        train(agent, model, sgd, 1)  # the first boundary sets the configured backend up
        agent.tracer = tracer  # type: ignore[assignment]
        agent.boundaries.tracer_started = True
        train(agent, model, sgd, 41)  # boundaries 1..41
        # a request inside a quiet run (window 41-48, decided untraced at boundary 40):
        # it must be traced although no boundary before it asks the duty cycle again
        requested = agent.current_step + 4
        assert requested == 46 and not scripted(requested)
        assert agent.boundaries._quiet_before == (48 if quiet else 0)
        agent.duty.force([requested])
        train(agent, model, sgd, 79)  # boundaries 42..120
    finally:
        agent.close()

    labels = traced_steps(agent)
    expected = {s: scripted(s) or s == requested for s in range(2, 121)}
    assert {s: labels[s] for s in expected} == expected
    # switched exactly where tracing changes (it starts off, with step 2 traced)
    switches = [s for s in expected if expected[s] != expected.get(s - 1, False)]
    assert [step + 1 for step, _ in tracer.switches] == switches
    assert tracer.marks == list(range(1, 121))
    # quiet: asked at the boundaries before and inside traced windows (1-8, 32-40, 45-46,
    # 64-72, 96-104), at the last boundary of each untraced window (16, 24, 48, 56, 80,
    # 88, 112, 120) and once after the request (42)
    assert asked[0] == (46 if quiet else 120)


def test_untraced_until_ends_at_the_window_or_a_requested_step(tmp_path: Path) -> None:
    config = load_config(None, ["tracer.backend=kineto", "tracer.overhead_budget_pct=5"])
    duty = DutyCycle(config)
    duty.governor = ScriptedGovernor(5.0, GovernorParams(window_steps=WINDOW), first_step=1)
    assert duty.untraced_until(10) == 10  # nothing decided yet
    assert duty.wanted(10) is False  # window 9..16 decided untraced
    assert duty.untraced_until(10) == 17
    assert duty.untraced_until(16) == 17
    assert duty.untraced_until(17) == 17  # another window: not decided
    version = duty.schedule_version
    duty.force([13])
    assert duty.schedule_version == version + 1  # callers holding an answer ask again
    assert duty.untraced_until(10) == 13
    assert duty.untraced_until(14) == 17  # a passed request does not shorten the run
    duty.force([30])
    assert duty.untraced_until(14) == 17  # nor one past the window
    assert duty.wanted(1) is True  # window 1..8 traced
    assert duty.untraced_until(3) == 3
    assert duty.wanted(10) is False
    version = duty.schedule_version
    duty.governor = ScriptedGovernor(5.0, GovernorParams(window_steps=WINDOW), first_step=1)
    assert duty.schedule_version == version + 1  # a new governor decides anew
    assert duty.untraced_until(10) == 10
    assert duty.wanted(10) is False
    duty.disable()
    assert duty.schedule_version == version + 2
    assert duty.untraced_until(10) == 10  # no governor: no promise


def cupti_agent(tmp_path: Path) -> tuple[Agent, Any, torch.nn.Module, torch.optim.Optimizer]:
    """An agent one step in, with the scripted governor and the CUPTI tracer (CUDA,
    CUPTI and its marker faked, tracing on as after its start) in place."""
    from tests.unit.test_cupti_mark_step import running_tracer

    config = load_config(
        None, ["tracer.backend=none", "detect.multiplier=50", "capture.reference_every_steps=0"]
    )
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    agent.duty.governor = ScriptedGovernor(5.0, GovernorParams(window_steps=WINDOW), first_step=1)
    tracer, _ = running_tracer(history=64)
    model = torch.nn.Linear(8, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    train(agent, model, sgd, 1)
    agent.tracer = tracer
    agent.boundaries.tracer_started = True
    return agent, tracer, model, sgd


def marks_agree_with_labels(tracer: Any, labels: dict[int, bool], last: int) -> None:
    """Every step marked, and a step's marks say traced exactly where its label does."""
    marks = tracer._resolver._snapshot()
    assert [m.step for m in marks] == list(range(marks[0].step, last + 1))
    for lo, hi in itertools.pairwise(marks):
        assert (lo.traced_after and hi.marker_launched) == labels[hi.step], hi.step
        if last - hi.step < 64:  # within the history: the resolver answers for it
            reason = tracer._resolver.locate(hi.step, allow_flush=False)[2]
            assert (reason == "tracing was off for this step") == (not labels[hi.step])
    assert tracer.counters["mark_errors"] == 0


def test_the_cupti_tracer_marks_every_step_as_the_boundary_labels_it(tmp_path: Path) -> None:
    # Behind quiet boundaries the CUPTI tracer marks every step, its marks say traced
    # where the steps file does (a capture finds a traced step's markers and hears
    # "tracing was off" otherwise), and only the steps after a switch carry its flush.
    agent, tracer, model, sgd = cupti_agent(tmp_path)
    try:
        train(agent, model, sgd, 120)  # boundaries 1..120
        assert agent.boundaries._quiet_before > 0  # the run ended in a quiet stretch
    finally:
        agent.close()
    assert agent.run is not None
    with open(agent.run.steps_csv(0)) as handle:
        rows = {int(r["step"]): r for r in csv.DictReader(handle)}
    labels = {s: rows[s]["traced"] == "1" for s in rows}
    assert {s: labels[s] for s in range(2, 121)} == {s: scripted(s) for s in range(2, 121)}
    after_flush = [s for s in range(2, 121) if rows[s]["after_flush"] == "1"]
    assert after_flush == [s for s in range(3, 121) if scripted(s) != scripted(s - 1)]
    marks_agree_with_labels(tracer, labels, 120)
    assert tracer.counters["marks_untraced"] > 0


def test_a_switch_the_cupti_tracer_deferred_is_never_hidden_by_a_quiet_run(
    tmp_path: Path,
) -> None:
    # A switch on asked during a CUDA graph capture waits for the tracer's next mark:
    # while it is pending the tracer is not quiet, so the boundaries after it ask the
    # duty cycle and switch it off again where the window says so.
    agent, tracer, model, sgd = cupti_agent(tmp_path)
    try:
        train(agent, model, sgd, 43)  # boundaries 1..43: window 41-48 is untraced
        agent.duty.force([45])
        tracer._capturing["on"] = True
        train(agent, model, sgd, 1)  # boundary 44 asks to switch on: deferred
        assert tracer._want_tracing and not tracer.tracing and not tracer.quiet
        tracer._capturing["on"] = False
        train(agent, model, sgd, 76)  # boundaries 45..120
    finally:
        agent.close()
    labels = traced_steps(agent)
    assert not any(labels[s] for s in range(41, 65))  # the request was lost to the capture
    assert {s: labels[s] for s in range(65, 73)} == dict.fromkeys(range(65, 73), True)
    marks_agree_with_labels(tracer, labels, 120)
