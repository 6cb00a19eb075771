"""The agent in one process (world size 1): step counting, optimizer choice, manual steps."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest
import torch

import distanom
from distanom.agent import Agent, active_agent
from distanom.config import load_config
from distanom.governor import GovernorParams, OverheadGovernor
from distanom.world import WorldInfo


def make_agent(tmp_path: Path, *overrides: str) -> Agent:
    config = load_config(
        None, ["tracer.backend=none", "detect.warmup_steps=0", "detect.min_steps=5", *overrides]
    )
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    return agent


def recorded_steps(agent: Agent) -> list[int]:
    assert agent.run is not None
    with open(agent.run.steps_csv(0)) as handle:
        return [int(row["step"]) for row in csv.DictReader(handle)]


def train(optimizers: list[torch.optim.Optimizer], model: torch.nn.Module, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


@pytest.fixture
def model() -> torch.nn.Module:
    return torch.nn.Linear(8, 2)


def test_each_optimizer_step_is_a_step(tmp_path: Path, model: torch.nn.Module) -> None:
    agent = make_agent(tmp_path)
    assert active_agent() is agent and distanom.current_step() == 0
    train([torch.optim.SGD(model.parameters(), lr=0.1)], model, 12)
    assert distanom.current_step() == 12
    agent.close()
    assert active_agent() is None and distanom.current_step() is None
    assert recorded_steps(agent) == list(range(1, 12))  # step 0 has no start boundary
    assert (agent.run.path / "status.json").exists()  # type: ignore[union-attr]


def test_first_optimizer_counts_unless_configured(tmp_path: Path, model: torch.nn.Module) -> None:
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    agent = make_agent(tmp_path)
    train([sgd, adam], model, 5)
    assert agent.current_step == 5  # not 10: only the first optimizer counts
    agent.close()

    agent = make_agent(tmp_path, "step.optimizer=Adam")
    train([sgd, adam], model, 4)
    assert agent.current_step == 4
    assert agent.counted_optimizer is adam
    agent.close()


def test_use_optimizer_and_manual_steps(tmp_path: Path, model: torch.nn.Module) -> None:
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    agent = make_agent(tmp_path)
    distanom.use_optimizer(adam)
    train([sgd, adam], model, 3)
    assert agent.current_step == 3 and agent.counted_optimizer is adam
    for _ in range(4):  # from now on only distanom.step() counts
        distanom.step()
        train([sgd, adam], model, 1)
    assert agent.current_step == 7
    agent.close()

    agent = make_agent(tmp_path, "step.source=manual")
    train([sgd], model, 3)
    assert agent.current_step == 0
    distanom.step()
    assert agent.current_step == 1
    agent.close()


def test_public_api_is_a_no_op_without_an_agent() -> None:
    assert active_agent() is None
    distanom.step()
    distanom.use_optimizer(object())
    assert distanom.current_step() is None


def test_a_failing_tracer_never_reaches_the_training_loop(
    tmp_path: Path, model: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        name = "broken"
        boundary_flushes = 0
        tracing = True

        def mark_step(self, step: int, host_end_ns: int) -> None:
            raise RuntimeError("disk on fire")

        def start(self) -> None: ...
        def set_tracing(self, on: bool) -> None: ...
        def end_of_training(self) -> None: ...
        def close(self) -> None: ...

    agent = make_agent(tmp_path)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    train([sgd], model, 2)
    agent.tracer = Broken()  # type: ignore[assignment]
    with caplog.at_level("WARNING", logger="distanom"):
        train([sgd], model, 5)
    assert agent.current_step == 7 and agent.tracer is None
    assert sum("disk on fire" in r.getMessage() for r in caplog.records) == 1
    agent.close()


class SwitchingTracer:
    """A tracer that makes switches on its own at chosen boundaries, as the cupti backend
    does when a switch asked during a CUDA graph capture is applied at the next mark."""

    name = "switching"

    def __init__(self, on_at: int, detach_at: int) -> None:
        self.on_at, self.detach_at = on_at, detach_at
        self.tracing = False
        self.boundary_flushes = 0
        self.calls: list[str] = []
        self.marked = -1

    @property
    def quiet(self) -> bool:
        return not self.tracing and self.on_at <= self.marked  # no switch of its own ahead

    def start(self) -> None: ...

    def mark_step(self, step: int, host_end_ns: int) -> None:
        self.marked = step
        if step == self.on_at:
            self.tracing = True  # a deferred switch on, applied at this boundary
        if step == self.detach_at:
            self.tracing = False
            self.boundary_flushes += 1  # the next step carries the detach

    def set_tracing(self, on: bool) -> None:
        self.calls.append(f"set_tracing({on})")
        self.tracing = on

    def end_of_training(self) -> None:
        import threading

        self.calls.append(f"end_of_training on {threading.current_thread().name}")

    def stats(self) -> dict[str, int]:
        return {"boundary_flushes": self.boundary_flushes}

    def close(self) -> None:
        self.calls.append("close")


def started_with(
    tmp_path: Path, model: torch.nn.Module, tracer: SwitchingTracer
) -> tuple[Agent, torch.optim.Optimizer]:
    """An agent two steps into training, with `tracer` in place of a started one."""
    agent = make_agent(tmp_path)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    train([sgd], model, 2)
    agent.tracer = tracer  # type: ignore[assignment]
    agent.boundaries.tracer_started = True
    return agent, sgd


def test_steps_are_labelled_by_what_the_tracer_has_in_force(
    tmp_path: Path, model: torch.nn.Module
) -> None:
    tracer = SwitchingTracer(on_at=4, detach_at=7)
    agent, sgd = started_with(tmp_path, model, tracer)
    train([sgd], model, 8)
    agent.close()
    assert agent.run is not None
    with open(agent.run.steps_csv(0)) as handle:
        rows = {int(r["step"]): r for r in csv.DictReader(handle)}
    traced = [s for s in sorted(rows) if rows[s]["traced"] == "1"]
    after_flush = [s for s in sorted(rows) if rows[s]["after_flush"] == "1"]
    assert traced == [5, 6, 7]  # on after boundary 4, off after boundary 7
    assert after_flush == [8]  # the step that carried the detach
    # no set_tracing at exit; stopped on the closing thread (torch.profiler's state
    # belongs to the thread that started it)
    assert tracer.calls == ["end_of_training on MainThread", "close"]


def test_a_gpu_that_never_reaches_the_end_leaves_the_tracer_running(
    tmp_path: Path, model: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    tracer = SwitchingTracer(on_at=-1, detach_at=-1)
    agent, _ = started_with(tmp_path, model, tracer)

    class HungClock:
        mode = "cuda_event"
        host_timed_steps = 0
        deferred = False  # the training thread reads its events

        def drain(self, timeout_s: float) -> tuple[list[tuple[int, float]], bool]:
            return [], False

    agent.clock = HungClock()  # type: ignore[assignment]
    with caplog.at_level("WARNING", logger="distanom"):
        agent.close()
    assert tracer.calls == []  # neither stopped nor closed: both could wait on the GPU
    assert any("did not reach the last step" in r.getMessage() for r in caplog.records)


def test_tracing_is_switched_off_once_capture_has_stepped_aside(
    tmp_path: Path, model: torch.nn.Module
) -> None:
    tracer = SwitchingTracer(on_at=-1, detach_at=-1)
    tracer.tracing = True
    agent, sgd = started_with(tmp_path, model, tracer)
    train([sgd], model, 2)
    assert tracer.calls == []
    agent.health.capture_off("run directory removed")
    train([sgd], model, 2)
    assert tracer.calls == ["set_tracing(False)"]  # once: nothing will be captured
    agent.close()


class CostlyTracer(SwitchingTracer):
    """A stand-in whose tracing slows the step, and whose switches cost, like cupti's."""

    TRACED_EXTRA_S = 0.0015
    ATTACH_S = 0.004

    def __init__(self) -> None:
        super().__init__(on_at=-1, detach_at=-1)
        self.tracing = True
        self.switches_on = 0

    def set_tracing(self, on: bool) -> None:
        if on and not self.tracing:
            self.switches_on += 1
            time.sleep(self.ATTACH_S)
        if self.tracing and not on:
            self.boundary_flushes += 1
        super().set_tracing(on)


def test_a_budgeted_agent_follows_the_governor_in_whole_windows(
    tmp_path: Path, model: torch.nn.Module
) -> None:
    # Tracing costs +30% a step plus an attach: a 5% budget traces a small share of the
    # steps, switched at window boundaries, and the status says what it measured.
    tracer = CostlyTracer()
    # nothing to capture: the stand-in holds no events
    quiet = ("detect.multiplier=50", "capture.reference_every_steps=0")
    # rounds of one step, so the stand-in governor's lag of 2 steps is enough
    agent = make_agent(tmp_path, "tracer.overhead_budget_pct=5", "consensus.batch_steps=1", *quiet)
    params = GovernorParams(window_steps=8, lag_steps=2, burst_windows=2)
    agent.duty.governor = OverheadGovernor(5.0, params, first_step=1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    train([sgd], model, 1)  # the first boundary sets the configured backend (none) up
    agent.tracer = tracer  # type: ignore[assignment]
    agent.boundaries.tracer_started = True
    for _ in range(600):
        time.sleep(0.005 + (tracer.TRACED_EXTRA_S if tracer.tracing else 0.0))
        model(torch.randn(4, 8)).sum().backward()
        sgd.step()
        sgd.zero_grad()
    report = agent.tracer_report()
    agent.close()
    assert agent.run is not None
    with open(agent.run.steps_csv(0)) as handle:
        traced = {int(r["step"]): r["traced"] == "1" for r in csv.DictReader(handle)}
    steady = [traced[s] for s in sorted(traced) if s > 200]
    assert 0.03 < sum(steady) / len(steady) < 0.5
    assert tracer.switches_on >= 2
    # switches land on window boundaries (steps 1 + 8k open a window), unless gathered
    # data lagged a decision
    switch_steps = [s for s in sorted(traced) if s - 1 in traced and traced[s] != traced[s - 1]]
    on_boundary = [s for s in switch_steps if (s - 1) % 8 == 0]
    assert len(on_boundary) >= 0.8 * len(switch_steps)
    duty = report["duty_cycle"]
    assert duty["windows_traced"] > 0 and duty["switches_on"] > 0
    assert 15.0 < report["overhead_pct"] < 120.0


def test_the_governor_waits_for_a_whole_gathering_round(tmp_path: Path) -> None:
    # step times reach the governor once per round of up to consensus.batch_steps steps
    # (away from traced steps a traced job's rounds are as long): its decisions must not
    # need fresher data, or every switch would come late
    for batch in (16, 128):
        agent = make_agent(
            tmp_path / str(batch),
            "tracer.backend=kineto",
            "tracer.overhead_budget_pct=1",
            f"consensus.batch_steps={batch}",
        )
        try:
            assert agent.duty.governor is not None
            assert agent.duty.governor.params.lag_steps == batch + 4
        finally:
            agent.close()


def test_a_capture_readings_step_back_never_gives_a_negative_share(tmp_path: Path) -> None:
    # the worker may end a lookup just under the heavy threshold after a reading saw it
    # just over: the next reading is lower, and that step's share must not be negative
    agent = make_agent(tmp_path)
    real = agent.capture
    try:
        readings = iter([20_000_000, 10_000_000, 25_000_000])

        class Capture:
            def busy_ns(self) -> int:
                return next(readings)

        agent.capture = Capture()  # type: ignore[assignment]
        agent.boundaries.last_busy_ns = 0
        shares = [agent.boundaries.self_ms_of_ended_step() for _ in range(3)]
        assert shares == [20.0, 0.0, 5.0]
    finally:
        agent.capture = real
        agent.close()


# -- step boundaries that follow the loop ----------------------------------------------


def amp_train(
    agent: Agent,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    overflow: set[int],
    iterations: int,
    scaler: torch.amp.GradScaler | None = None,
) -> list[int]:
    """A mixed-precision loop whose loss overflows at the given iterations; returns the
    distanom step in progress at the start of each iteration."""
    scaler = scaler or torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=3)
    seen = []
    for iteration in range(iterations):
        seen.append(agent.current_step)
        loss = model(torch.randn(4, 8)).sum()
        if iteration in overflow:
            loss = loss * float("inf")  # forced overflow: the scaler skips optimizer.step()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return seen


def recorded_rows(agent: Agent) -> list[dict[str, str]]:
    assert agent.run is not None
    with open(agent.run.steps_csv(0)) as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("first_skipped", [False, True])
def test_skipped_optimizer_steps_still_end_a_step(
    tmp_path: Path, model: torch.nn.Module, first_skipped: bool
) -> None:
    overflow = {0, 1, 7, 12, 13} if first_skipped else {7, 12, 13}
    agent = make_agent(tmp_path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = amp_train(agent, model, optimizer, overflow, 20)
    assert seen == list(range(20))  # iteration N is step N, skipped or not
    assert agent.counted_optimizer is optimizer
    assert agent.boundaries.skipped_steps == len(overflow)
    agent.close()
    rows = recorded_rows(agent)
    skipped = {int(r["step"]) for r in rows if r["skipped"] == "1"}
    assert skipped == overflow - {0}  # step 0 has no start boundary, so no row


def test_cuda_amp_grad_scaler_subclass_is_followed_too(
    tmp_path: Path, model: torch.nn.Module
) -> None:
    agent = make_agent(tmp_path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.__class__ = type("Sub", (torch.amp.GradScaler,), {})  # like torch.cuda.amp's
    seen = amp_train(agent, model, optimizer, {3, 4}, 8, scaler)
    assert seen == list(range(8))
    agent.close()
    assert not hasattr(torch.amp.GradScaler.step, "__wrapped__")  # the wrap is undone


def test_manual_steps_beside_an_optimizer_number_like_the_loop(
    tmp_path: Path, model: torch.nn.Module
) -> None:
    agent = make_agent(tmp_path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(10):
        seen.append(agent.current_step)
        train([optimizer], model, 1)
        distanom.step()  # at the end of each iteration, from the first
    assert seen == list(range(10))
    agent.close()


def test_the_second_optimizer_of_one_class_can_be_chosen(
    tmp_path: Path, model: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    disc = torch.optim.Adam(model.parameters(), lr=0.1)
    gen = torch.optim.Adam(model.parameters(), lr=0.1)
    agent = make_agent(tmp_path, "step.optimizer=Adam", "step.optimizer_index=1")
    with caplog.at_level("INFO", logger="distanom"):
        train([disc, gen], model, 4)
    assert agent.counted_optimizer is gen and agent.current_step == 4
    assert "steps end at Adam #1 (step.optimizer_index, from 0).step()" in caplog.text
    agent.close()


def test_steps_files_without_the_skipped_column_still_read(tmp_path: Path) -> None:
    from distanom.records.steps import read_steps

    old = tmp_path / "rank0.csv"
    old.write_text(
        "step,duration_ms,traced,after_flush,self_ms,gc_ms,gc_gen\n3,1.5,1,0,0.0,0.0,-1\n"
    )
    rows = read_steps(old).rows
    assert len(rows) == 1 and rows[0].skipped is False
    new = tmp_path / "rank1.csv"
    new.write_text(
        "step,duration_ms,traced,after_flush,self_ms,gc_ms,gc_gen,skipped\n3,1.5,1,0,0.0,0.0,-1,1\n"
    )
    assert read_steps(new).rows[0].skipped is True
