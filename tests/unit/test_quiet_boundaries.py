"""Quiet boundaries: inside a run of steps the duty cycle decided untraced, with the
tracer off, a boundary only marks the step (`StepBoundaries._quiet_from`). What is
traced must be exactly what asking the duty cycle at every boundary would trace,
requests made during a quiet run included."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

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
    train(agent, model, sgd, 1)  # the first boundary sets the configured backend up
    agent.tracer = tracer  # type: ignore[assignment]
    agent.boundaries.tracer_started = True
    train(agent, model, sgd, 41)  # boundaries 1..41
    # a request inside a quiet run (window 41-48, decided untraced at boundary 40): it
    # must be traced although no boundary before it asks the duty cycle again
    requested = agent.current_step + 4
    assert requested == 46 and not scripted(requested)
    assert agent.boundaries._quiet_before == (48 if quiet else 0)
    agent.duty.force([requested])
    train(agent, model, sgd, 79)  # boundaries 42..120
    agent.close()

    labels = traced_steps(agent)
    expected = {s: scripted(s) or s == requested for s in range(2, 121)}
    assert {s: labels[s] for s in expected} == expected
    # switched exactly where tracing changes (it starts off, with step 2 traced)
    switches = [s for s in expected if expected[s] != expected.get(s - 1, False)]
    assert [step + 1 for step, _ in tracer.switches] == switches
    assert tracer.marks == list(range(1, 121))
    if quiet:  # asked at traced windows' boundaries and once per untraced run
        assert asked[0] < 60
    else:
        assert asked[0] == 120


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
    assert duty.wanted(1) is True  # window 1..8 traced
    assert duty.untraced_until(3) == 3
    assert duty.wanted(10) is False
    duty.disable()
    assert duty.untraced_until(10) == 10  # no governor: no promise


def test_the_cupti_tracer_marks_every_step_as_the_boundary_labels_it(tmp_path: Path) -> None:
    # The CUPTI tracer (CUDA, CUPTI and its marker faked) behind quiet boundaries: every
    # step is marked, and its marks say traced exactly where the steps file does, so a
    # capture finds the markers of a traced step and hears "tracing was off" otherwise.
    from tests.unit.test_cupti_mark_step import running_tracer

    config = load_config(
        None, ["tracer.backend=none", "detect.multiplier=50", "capture.reference_every_steps=0"]
    )
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    agent.duty.governor = ScriptedGovernor(5.0, GovernorParams(window_steps=WINDOW), first_step=1)
    tracer, _ = running_tracer(history=64)  # tracing on, as after start()
    model = torch.nn.Linear(8, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    train(agent, model, sgd, 1)
    agent.tracer = tracer  # type: ignore[assignment]
    agent.boundaries.tracer_started = True
    train(agent, model, sgd, 120)  # boundaries 1..120
    assert agent.boundaries._quiet_before > 0  # the run ended in a quiet stretch
    agent.close()

    labels = traced_steps(agent)
    assert {s: labels[s] for s in range(2, 121)} == {s: scripted(s) for s in range(2, 121)}
    assert tracer._resolver is not None
    marks = tracer._resolver._snapshot()
    assert [m.step for m in marks] == list(range(marks[0].step, 121))
    for lo, hi in itertools.pairwise(marks):
        assert (lo.traced_after and hi.marker_launched) == scripted(hi.step), hi.step
        if 120 - hi.step < 64:  # within the history: the resolver answers for it
            reason = tracer._resolver.locate(hi.step, allow_flush=False)[2]
            assert (reason == "tracing was off for this step") == (not scripted(hi.step))
    assert tracer.counters["marks_untraced"] > 0 and tracer.counters["mark_errors"] == 0
