"""Rounds paced in time: the control thread wakes per round, not per step; a round covers
about `consensus.interval_ms` of steps; a heavy round is charged to the training steps."""

from __future__ import annotations

import csv
import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from distanom import control_loop, pacing
from distanom.agent import Agent
from distanom.config import load_config
from distanom.inbox import StepInbox
from distanom.rounds import RoundBuilder, steps_per_round
from distanom.step_record import StepRecord
from distanom.world import WorldInfo

END = object()


def timed_take(inbox: StepInbox, timeout_s: float) -> tuple[list[object], float]:
    began = time.monotonic()
    items = inbox.take(timeout_s)
    return items, time.monotonic() - began


def test_the_inbox_wakes_its_reader_only_when_enough_is_queued_or_at_the_end() -> None:
    inbox = StepInbox(END)
    inbox.wake_at = 3
    inbox.put(1)
    inbox.put(2)
    items, waited = timed_take(inbox, 0.3)
    assert items == [1, 2] and waited >= 0.25  # not woken: the timeout ended the wait
    for item in (3, 4, 5):
        inbox.put(item)
    items, waited = timed_take(inbox, 5.0)
    assert items == [3, 4, 5] and waited < 1.0
    inbox.put(END)
    items, waited = timed_take(inbox, 5.0)
    assert items == [END] and waited < 1.0


def test_the_inbox_says_once_the_end_has_been_taken() -> None:
    end = object()
    inbox = StepInbox(end)
    inbox.put(1)
    assert inbox.take(0.0) == [1] and not inbox.ended
    inbox.put(2)
    inbox.put(end)
    assert inbox.take(0.0) == [2, end] and inbox.ended
    assert inbox.take(0.0) == [] and inbox.ended  # taken once; it stays said


def test_an_item_queued_while_the_reader_drains_wakes_its_next_wait() -> None:
    inbox = StepInbox(END)
    inbox.wake_at = 1
    threading.Thread(target=lambda: [inbox.put(i) for i in range(1000)]).start()
    seen: list[object] = []
    deadline = time.monotonic() + 10
    while len(seen) < 1000 and time.monotonic() < deadline:
        seen += inbox.take(1.0)
    assert seen == list(range(1000))


@pytest.mark.parametrize(
    ("median_ms", "expected"),
    [(None, 1), (float("nan"), 1), (400.0, 1), (20.0, 2), (7.0, 7), (0.4, 8)],
)
def test_a_round_covers_about_the_interval_at_the_median(
    median_ms: float | None, expected: int
) -> None:
    assert steps_per_round(median_ms, 50.0, 8) == expected


def test_the_builder_takes_rounds_of_the_size_asked() -> None:
    builder = RoundBuilder(batch_steps=8)
    for step in range(1, 6):
        builder.add(step, 10.0 + step, 0)
    assert builder.ready(4) and not builder.ready(6) and builder.missing(6) == 1
    first = builder.take(4)
    assert first.first_step == 1 and first.durations_ms == (11.0, 12.0, 13.0, 14.0)
    assert builder.missing(3) == 2 and not builder.ready(3)
    last = builder.take(3, final=True)  # what is left of the next 3 steps
    assert last.first_step == 5 and last.durations_ms == (15.0,)
    assert builder.next_first == 8


def run_agent(
    tmp_path: Path, steps: int, step_s: float, overrides: tuple[str, ...] | list[str] = ()
) -> Agent:
    config = load_config(
        None, ["tracer.backend=none", "detect.warmup_steps=0", "detect.min_steps=5", *overrides]
    )
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    layer = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    try:
        for _ in range(steps):
            layer(torch.ones(2, 4)).sum().backward()
            time.sleep(step_s)
            optimizer.step()
    finally:
        agent.close()
    return agent


def test_a_fast_loop_is_gathered_in_rounds_of_several_steps(tmp_path: Path) -> None:
    agent = run_agent(tmp_path, 240, 0.002)  # ~2 ms steps: 250 ms is over 32 steps (the most)
    assert agent.control.detector.counts.judged >= 200  # every step still judged
    assert agent.control.rounds <= 240 / 8, agent.control.rounds


def test_a_heavy_round_is_charged_to_the_steps_it_overlapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def slowed(decode: Any) -> Any:
        def slow_decode(*args: object, **kwargs: object) -> object:
            spin_until = time.thread_time() + 0.03  # a round holding the GIL for 30 ms of CPU
            while time.thread_time() < spin_until:
                pass
            return decode(*args, **kwargs)

        return slow_decode

    # a small world's rounds are decoded from lists, a large one's from the tensor
    monkeypatch.setattr(control_loop, "decode_rows", slowed(control_loop.decode_rows))
    monkeypatch.setattr(control_loop, "decode_round", slowed(control_loop.decode_round))
    agent = run_agent(tmp_path, 120, 0.002)
    assert agent.control.phases_charged >= 3
    assert agent.run is not None
    with open(agent.run.steps_csv(0)) as handle:
        charged = [float(row["self_ms"]) for row in csv.DictReader(handle)]
    # the last round's charge may come after the last step, and two rounds may stall one
    # step (it carries both): of three charged, at least two steps carry one (it was
    # three, which failed about one run in four on the 2-core VM)
    assert sum(1 for ms in charged if ms >= 25.0) >= 2, charged


def test_a_heavy_evidence_read_is_charged_to_the_steps_it_overlapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Flight Recorder read (the evidence poll, outside any round) holding the GIL for
    30 ms of CPU: the step it stalled carries it as distanom's own time, so it is not
    judged as the user's (on the H200, reads and rounds made 4-8x steps in a healthy loop)."""
    from distanom.evidence import EvidenceTier

    polls = [0]

    def slow_poll(self: EvidenceTier, final: bool) -> object:
        polls[0] += 1
        if polls[0] >= 2:  # every poll after the first
            spin_until = time.thread_time() + 0.03
            while time.thread_time() < spin_until:
                pass
        return original(self, final)

    original = EvidenceTier.poll
    monkeypatch.setattr(EvidenceTier, "poll", slow_poll)
    agent = run_agent(tmp_path, 120, 0.002)
    assert agent.run is not None
    with open(agent.run.steps_csv(0)) as handle:
        charged = [float(row["self_ms"]) for row in csv.DictReader(handle)]
    assert polls[0] >= 4 and sum(1 for ms in charged if ms >= 25.0) >= 2, (polls, charged)


def test_the_agent_measures_its_own_time_per_step(tmp_path: Path) -> None:
    agent = run_agent(tmp_path, 120, 0.002)
    own = agent.own_cost()
    assert own["steps"] == 120
    boundary, control = own["boundary_us_per_step"], own["control_us_per_step"]
    assert isinstance(boundary, float) and isinstance(control, float)
    assert 0 < boundary < 2000 and 0 < control < 2000  # a few to tens of us on a laptop
    pct = own["pct_of_median_step"]
    assert isinstance(pct, float)
    # the base is the run's median step (every step's time, as the means are), less
    # distanom's own time in it
    median = agent.control.run_steps.median_ms()
    assert median is not None and own["median_step_ms"] == pytest.approx(median, abs=1e-4)
    assert median == pytest.approx(2.0, rel=0.5)  # 2 ms steps
    own_ms = (boundary + own["phase_marks_us_per_step"] + control) / 1e3
    assert pct == pytest.approx(own_ms / (median - own_ms) * 100, rel=0.01)
    assert agent.run is not None
    status = json.loads((agent.run.path / "status.json").read_text())
    assert status["agent_cost"]["steps"] == 120
    assert status["agent_cost"]["clock_mode"] == "host"  # CPU: nothing else to time with


def test_a_round_ends_within_half_the_trace_history_of_its_first_traced_step() -> None:
    from distanom.rounds import cut_at_trace, traced_round_steps

    assert traced_round_steps(32) == 16
    assert traced_round_steps(2) == 1
    assert cut_at_trace(128, 100, None, 32) == 128  # nothing traced: as long as it is
    assert cut_at_trace(128, 100, 100, 32) == 16
    assert cut_at_trace(128, 100, 150, 32) == 66  # 50 untraced steps, then 16
    assert cut_at_trace(128, 100, 220, 32) == 128  # the first traced step is past its end
    assert cut_at_trace(128, 100, 227, 32) == 128  # its last step
    assert cut_at_trace(128, 100, 226, 32) == 128  # its last but one: 126 + 16 > 128
    assert cut_at_trace(10, 100, 100, 32) == 10  # short anyway


def test_a_round_waiting_without_working_is_not_charged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def idled(decode: Any) -> Any:
        def idle_decode(*args: object, **kwargs: object) -> object:
            time.sleep(0.03)  # waiting (the GIL released) takes nothing from training
            return decode(*args, **kwargs)

        return idle_decode

    # a small world's rounds are decoded from lists, a large one's from the tensor
    monkeypatch.setattr(control_loop, "decode_rows", idled(control_loop.decode_rows))
    monkeypatch.setattr(control_loop, "decode_round", idled(control_loop.decode_round))
    agent = run_agent(tmp_path, 80, 0.002)
    # charged by wall time, every round would add its 30 ms of waiting; by CPU time a
    # round adds its own work at most (a few ms on a slow CPU), whether or not that work
    # is heavy against these ~2 ms steps
    rounds = agent.control.rounds
    assert rounds >= 6, rounds
    assert agent.health.control_busy_ns < rounds * 15e6, (agent.health.control_busy_ns, rounds)


def test_the_inbox_signals_once_per_wake(monkeypatch: pytest.MonkeyPatch) -> None:
    inbox = StepInbox(object())
    sets: list[int] = []
    original = inbox._ready.set
    monkeypatch.setattr(inbox._ready, "set", lambda: (sets.append(1), original()))
    inbox.wake_at = 2
    for item in range(6):
        inbox.put(item)
    assert len(sets) == 1  # the consumer has not taken yet: no further set()
    assert inbox.take(0.0) == list(range(6))
    inbox.put(6)
    inbox.put(7)
    assert len(sets) == 2


@pytest.mark.parametrize("side_process", [False, True])
def test_a_control_thread_abandoned_at_exit_writes_nothing_to_the_closed_steps_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, side_process: bool
) -> None:
    overrides = ["tracer.backend=none", "step.source=manual"]
    config = load_config(None, [*overrides, f"control.side_process={str(side_process).lower()}"])
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    for _ in range(3):
        agent.boundaries.boundary()
    step_log = agent.control.step_log
    deadline = time.monotonic() + 30
    # the control thread opens the steps file once set up; the side process takes it over
    # at a write or flush after it says it reads
    while step_log.link is None if side_process else step_log.here._writer is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    steps, link = step_log.here._writer, step_log.link
    assert (link is not None) == side_process
    agent.control.close()  # as at an exit that gave up waiting for the control thread
    if link is None:
        assert steps is not None and steps._file.closed
    else:
        assert link.process.returncode == 0  # ended, its rows written
    assert agent.run is not None
    written = agent.run.steps_csv(0).read_bytes()
    late = [StepRecord(step, 3.0, 0, 0.0, 0.0, -1) for step in range(100, 110)]
    with caplog.at_level("WARNING", logger="distanom"):
        step_log.write(late)  # what the abandoned thread does next: no raise, no row
        step_log.flush()
    assert not [r for r in caplog.records if "steps file" in r.getMessage()]
    assert agent.run.steps_csv(0).read_bytes() == written
    agent.close()


def test_a_group_lost_in_the_final_round_does_not_hold_up_the_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank that vanished near the end is often found out only in the final round,
    after training's end was taken from the inbox: the exit must not wait for it again
    (it waited analysis.exit_timeout_s + 10 s, and abandoned the control thread)."""
    from distanom.world import GroupUnavailableError

    run_round = control_loop.ControlLoop._run_round

    def lost_at_the_end(self: control_loop.ControlLoop, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("final"):
            raise GroupUnavailableError("all-gather failed: connection reset by peer")
        return run_round(self, *args, **kwargs)

    monkeypatch.setattr(control_loop.ControlLoop, "_run_round", lost_at_the_end)
    with caplog.at_level("WARNING", logger="distanom"):
        began = time.monotonic()
        agent = run_agent(tmp_path, 40, 0.002, ["analysis.exit_timeout_s=5"])
        closed_in = time.monotonic() - began
    assert not agent.control.is_alive()
    assert closed_in < 12.0, closed_in  # training and close; it waited 5 + 10 s more before
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "still running at exit" in m]
    assert agent.health.consensus_error is not None
    assert "connection reset" in agent.health.consensus_error
    assert agent.run is not None
    status = json.loads((agent.run.path / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 40


def test_peers_that_ended_in_the_take_that_held_training_end_do_not_hold_up_the_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The take that holds training's end also fills a round, and that round shows another
    rank's final flag (ranks ending together): the drain after it must not wait again."""
    from distanom.consensus import FLAG_FINAL

    class PeerEnded:
        def __init__(self, result: Any) -> None:
            self._result = result

        def __getattr__(self, name: str) -> Any:
            return getattr(self._result, name)

        def ranks_with(self, flag: int) -> list[int]:
            return [0] if flag == FLAG_FINAL else self._result.ranks_with(flag)

    run_round = control_loop.ControlLoop._run_round
    seen: list[bool] = []

    def peer_ended(self: control_loop.ControlLoop, *args: Any, **kwargs: Any) -> Any:
        result = run_round(self, *args, **kwargs)
        if self.inbox.ended and not kwargs.get("final"):
            seen.append(True)
            return PeerEnded(result)
        return result

    take = control_loop.StepInbox.take

    def late_take(self: Any, timeout_s: float) -> Any:
        time.sleep(0.3)  # training's 40 quick steps and its end pile up for one take
        return take(self, timeout_s)

    monkeypatch.setattr(control_loop.ControlLoop, "_run_round", peer_ended)
    monkeypatch.setattr(control_loop.StepInbox, "take", late_take)
    with caplog.at_level("WARNING", logger="distanom"):
        began = time.monotonic()
        agent = run_agent(
            tmp_path, 40, 0.0, ["analysis.exit_timeout_s=5", "consensus.batch_steps=8"]
        )
        closed_in = time.monotonic() - began
    assert not agent.control.is_alive()
    assert seen, "no round ran after training's end was taken"
    assert closed_in < 12.0, closed_in  # it waited 5 + 10 s more before
    assert not [r for r in caplog.records if "still running at exit" in r.getMessage()]


def test_the_capture_worker_learns_training_s_last_ended_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class CloseSpy:
        active, stats = True, None

        def __init__(self) -> None:
            self.calls: list[tuple[float, int | None]] = []

        def busy_ns(self) -> int:
            return 0

        def close(self, timeout_s: float, *, last_ended_step: int | None = None) -> None:
            self.calls.append((timeout_s, last_ended_step))

    spy = CloseSpy()
    config = load_config(None, ["tracer.backend=none", "analysis.exit_timeout_s=3"])
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    agent.health.capture = spy  # type: ignore[assignment]
    layer = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    try:
        for _ in range(25):
            layer(torch.ones(2, 4)).sum().backward()
            optimizer.step()
    finally:
        agent.close()
    # 25 optimizer steps end steps 0..24: nothing after step 24 ever ran
    assert spy.calls == [(3.0, 24)]


@pytest.mark.parametrize("backend", ["none", "kineto"])
def test_the_gathered_row_has_room_for_batch_steps(tmp_path: Path, backend: str) -> None:
    # with a tracer too: rounds away from traced steps are as long as detection's
    config = load_config(None, [f"tracer.backend={backend}"])
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    assert agent.control._sizer.batch_steps == 128
    assert agent.control._sizer.steps(None, 2.0, agent.control.duty) == 128  # capped
    assert agent.control._round_steps() == 1  # before a median exists


def test_the_round_loop_sleeps_until_the_next_periodic_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config(None, ["tracer.backend=none"])
    loop = Agent(config, WorldInfo.from_env({}), tmp_path / "runs").control
    now = time.monotonic()
    monkeypatch.setattr(loop.evidence, "next_read_at", lambda: math.inf)
    assert loop._sleep_s([]) == control_loop.WAKE_EVERY_S  # nothing due: the idle wake
    assert loop._sleep_s([now + 0.3]) == pytest.approx(0.3, abs=0.05)  # e.g. a status write
    assert loop._sleep_s([now - 5]) == control_loop.WAKE_MIN_S  # overdue: at once
    # a Flight Recorder read due soon wakes it, but not more than 5 times a second
    monkeypatch.setattr(loop.evidence, "next_read_at", lambda: now + 0.01)
    assert loop._sleep_s([]) == pytest.approx(control_loop.EVIDENCE_WAKE_MIN_S, abs=0.05)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "tracing duty-cycled to 1% of step time (tracer.overhead_budget_pct)"),
        (["tracer.overhead_budget_pct=null"], "tracing nearly every step"),
    ],
)
def test_the_start_line_says_how_much_is_traced(
    tmp_path: Path, overrides: list[str], expected: str
) -> None:
    agent = Agent(load_config(None, overrides), WorldInfo.from_env({}), tmp_path / "runs")
    assert "tracing" not in agent.boundaries._start_notes()  # no tracer (yet): nothing said
    agent.boundaries.tracer = object()  # type: ignore[assignment]  # any tracer
    assert expected in agent.boundaries._start_notes()


def record_pauses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pause of every `RoundPacer.pause` call (0: none slept), in order."""
    pauses: list[float] = []
    original = pacing.RoundPacer.pause

    def pause(self: pacing.RoundPacer) -> None:
        pauses.append(self.pause_s)
        original(self)

    monkeypatch.setattr(pacing.RoundPacer, "pause", pause)
    return pauses


def test_a_round_pauses_about_a_step_between_its_phases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a round of many steps is milliseconds of Python: in one piece it would stretch one
    # training step by all of it; a pause of about a step puts each phase in another
    pauses = record_pauses(monkeypatch)
    agent = run_agent(tmp_path, 400, 0.004)  # rounds of 128 steps: the median known by the 2nd
    assert agent.control.rounds >= 3
    assert len(pauses) >= 3 * agent.control.rounds
    paced = [s for s in pauses if s > 0]
    assert len(paced) >= 4  # two per round once a median is known (none before, nor at the end)
    assert agent.control.pacer.pauses == len(paced)
    assert all(s <= pacing.PACE_MAX_S for s in paced)
    # ~ the median step once known (4 ms of sleep, more on a loaded machine: the
    # detector's median, not the script's sleep, is what the pause follows)
    median_s = agent.control.detector.median_ms / 1e3
    assert median_s >= 0.004 and max(paced) == pytest.approx(min(median_s, 0.01), rel=0.5)
    assert pauses[-1] == 0.0  # the final round: training is over, nothing to pace for
    # a 128-step round is well over a tenth of a 4 ms step on any CPU
    work = agent.control.pacer.work_ms
    assert work is not None and work > pacing.UNPACED_SHARE * 4


def test_a_round_whose_work_is_small_beside_a_step_runs_in_one_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 50 ms steps, rounds of ~5 steps: well under a millisecond of work each; pausing
    # would only cost wake-ups
    pauses = record_pauses(monkeypatch)
    agent = run_agent(tmp_path, 60, 0.05, ["consensus.interval_ms=250"])  # 5-step rounds
    assert agent.control.rounds >= 8
    assert len(pauses) >= 3 * agent.control.rounds
    # the first round of full length is paced (nothing as long measured yet), no other
    assert agent.control.pacer.pauses <= 3 and not any(pauses[-9:])
    work = agent.control.pacer.work_ms
    assert work is not None and 0 < work <= pacing.UNPACED_SHARE * 50
    cost = agent.own_cost()
    assert cost["round_pauses"] == 0 and cost["round_work_ms"] == pytest.approx(work, abs=1e-3)


def fake_thread_clock(monkeypatch: pytest.MonkeyPatch, step_ms: float = 1.0) -> list[float]:
    """Make `pacing`'s thread-time reads advance `step_ms` each and its sleeps only
    recorded; returns the sleeps."""
    slept: list[float] = []
    monkeypatch.setattr(pacing.time, "sleep", slept.append)
    clock = iter(range(0, 10**15, int(step_ms * 1e6)))
    monkeypatch.setattr(pacing.time, "thread_time_ns", lambda: next(clock))
    return slept


def test_the_pacer_pauses_until_the_heaviest_recent_pass_is_small(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept = fake_thread_clock(monkeypatch)  # each thread-time read 1 ms after the last
    pacer = pacing.RoundPacer()
    pacer.begin(4.0, 128, final=False)  # nothing measured yet: paced
    assert pacer.pause_s == pytest.approx(0.004)
    pacer.pause()
    assert slept == [pytest.approx(0.004)] and pacer.pauses == 1
    pacer.end(steps=25)  # 3 ms between begin and end, 1 ms of it in the pause
    assert pacer.work_ms == pytest.approx(2.0)
    pacer.begin(40.0, 25, final=False)  # 2 ms of work beside 40 ms steps: no pause
    assert pacer.pause_s == 0.0
    pacer.pause()
    assert pacer.pauses == 1 and len(slept) == 1  # nothing slept
    pacer.end(steps=0)  # a pass without a round measures nothing
    assert pacer.work_ms == pytest.approx(2.0)
    pacer.begin(10.0, 25, final=False)  # 2 ms is a fifth of a 10 ms step: paced
    assert pacer.pause_s == pytest.approx(0.01)
    pacer.end(steps=25)  # 1 ms
    pacer.begin(4.0, 128, final=True)  # the end of training: never paced ...
    assert pacer.pause_s == 0.0
    pacer.end(steps=128)  # ... and its last rounds decide nothing
    assert pacer.work_ms == pytest.approx(2.0)


def test_the_work_since_the_last_sleep_is_charged_before_the_next_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pacer hands the CPU time since its last sleep to `charge` just before it
    sleeps (the step that work stalled has not ended yet), and at `end`; a pause's own
    time is never charged. Phases with no sleep between them (`mark`, an unpaced pass)
    add up: nothing let the training thread run between them."""
    fake_thread_clock(monkeypatch)  # each thread-time read 1 ms after the last
    charged: list[int] = []
    pacer = pacing.RoundPacer(charge=charged.append)
    pacer.begin(4.0, 128, final=False)  # read at 0: paced
    pacer.pause()  # reads 1 (the work's end), charges 1 ms, sleeps, reads 2
    pacer.mark()  # reads 3: a phase ends, nothing slept
    pacer.pause()  # reads 4: 2 ms since the sleep, charged; sleeps, reads 5
    pacer.end(steps=25)  # reads 6
    assert charged == [1_000_000, 2_000_000, 1_000_000]
    assert pacer.pauses == 2
    charged.clear()
    pacer.begin(400.0, 1, final=False)  # 7: 3 ms of work beside 400 ms steps: unpaced
    assert pacer.pause_s == 0.0
    pacer.pause()  # 8: no sleep, so nothing charged yet
    assert charged == []
    pacer.end(steps=1)  # 9: the whole pass in one piece
    assert charged == [2_000_000]


def test_small_rounds_work_does_not_unpace_a_round_many_times_longer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # before a median is known rounds are one step each: their fraction of a millisecond
    # must not let the first 128-step round run in one piece
    fake_thread_clock(monkeypatch, step_ms=0.15)
    pacer = pacing.RoundPacer()
    for _ in range(6):
        pacer.begin(None, 1, final=False)
        pacer.end(steps=1)  # 0.15 ms each
    assert pacer.work_ms == pytest.approx(0.15)
    assert pacer.expected_work_ms(2) == pytest.approx(0.15)
    assert pacer.expected_work_ms(128) is None  # nothing comparable measured
    pacer.begin(4.0, 128, final=False)
    assert pacer.pause_s == pytest.approx(0.004)
    pacer.end(steps=128)  # 0.15 ms again: now a 128-step round is known to be light
    pacer.begin(4.0, 128, final=False)
    assert pacer.pause_s == 0.0
    # a shorter round is expected to cost what the longer ones did (its fixed part)
    assert pacer.expected_work_ms(16) == pytest.approx(0.15)


def test_the_pause_is_one_median_step_at_most_10_ms_and_an_eighth_of_a_round() -> None:
    assert pacing.pace_s(None, 128) == pacing.pace_s(math.nan, 128) == 0.0
    assert pacing.pace_s(0.2, 128) == pytest.approx(0.0002)
    assert pacing.pace_s(4.5, 16) == pytest.approx(0.0045)
    assert pacing.pace_s(400.0, 16) == pacing.PACE_MAX_S
    # rounds of one step (consensus.batch_steps: 1): three pauses in a round must not
    # outlast its step, or the thread falls behind for good
    assert 3 * pacing.pace_s(5.0, 1) <= 0.005 * 0.5
    # a round whose work is at most a tenth of a step is not paced at all
    assert pacing.pace_s(10.0, 16, work_ms=1.0) == 0.0
    assert pacing.pace_s(10.0, 16, work_ms=1.01) == pytest.approx(0.01)


def test_the_round_loop_reads_step_records_by_column_in_this_order() -> None:
    """The round loop transposes a round's records (`zip(*records)`) and reads its first
    five columns by position: a field moved in `StepRecord` must fail here."""
    from distanom.boundary import StepRecord

    assert StepRecord._fields[:5] == ("step", "duration_ms", "flags", "self_ms", "gc_ms")


def test_ranks_that_ended_first_are_announced_once_this_rank_trains_past_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_config(None, ["tracer.backend=none"])
    agent = Agent(config, WorldInfo.from_env({}), tmp_path / "runs")
    control, boundaries = agent.control, agent.boundaries

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "INFO"]

    with caplog.at_level("INFO", logger="distanom"):
        control._peers_ended([1], 99, 100)
        assert agent.health.consensus_error is not None  # capture steps aside at once
        boundaries.current_step = 101  # the same step, a moment apart: not news
        control._say_peers_ended(ending=False)
        assert not said() and agent.health.consensus_error is not None
        control._say_peers_ended(ending=True)  # and this rank ends too: ended together
        assert not said() and agent.health.consensus_error is None
        control._peers_ended([1], 99, 100)
        boundaries.current_step = 102  # past them: this rank trains on alone
        control._say_peers_ended(ending=False)
        control._say_peers_ended(ending=False)
        assert len(said()) == 1 and "rank 1 ended its training first" in said()[0]
        # stuck at their last step (in a collective they left): said after a while
        caplog.clear()
        control._peers_ended([2], 99, 100)
        boundaries.current_step = 100
        control._say_peers_ended(ending=False)
        assert not said()
        control._peers_ended_at -= control_loop.PEERS_ENDED_QUIET_S + 1
        control._say_peers_ended(ending=False)
        assert len(said()) == 1 and "rank 2 ended its training first" in said()[0]


def test_a_traces_slices_are_a_quarter_step_of_encoding_in_at_most_64_pieces() -> None:
    from distanom.pacing import MAX_SLICES, MIN_SLICE_EVENTS, slice_events, slice_pause_s

    assert slice_events(2.0, 20_000) == 500  # 0.5 ms of orjson at ~1 us an event
    assert slice_events(0.1, 1_000) == MIN_SLICE_EVENTS
    assert slice_events(math.nan, 1_000) == MIN_SLICE_EVENTS  # a requested capture
    assert slice_events(1.0, 100_000) == -(-100_000 // MAX_SLICES)  # pauses bounded
    assert slice_pause_s(3.4) == 0.0034 and slice_pause_s(50.0) == 0.01
    assert slice_pause_s(math.nan) == 0.002
