"""Early rounds: a run of slow steps wakes the control thread at once, the rank sends the
steps it has, the round covers the fewest steps any rank sent, and each rank sends the
rest again in the next round."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import pytest

from distanom.agent import Agent
from distanom.clock import StepClock
from distanom.config import load_config
from distanom.consensus import (
    FLAG_EARLY,
    FLAG_FINAL,
    FLAG_MORE_EVIDENCE,
    LocalRound,
    decode_rows,
    encode_row,
)
from distanom.inbox import SLOW_RUN_STEPS, StepInbox
from distanom.rounds import RoundBuilder
from distanom.world import WorldInfo
from tests.unit.test_clock import FakeEvent, FakeGpu

ROOM = 8


def test_a_run_of_slow_steps_wakes_the_consumer_once() -> None:
    inbox = StepInbox(object())
    inbox.wake_at = 100  # a long round: no wake by count
    inbox.slow_ms = 10.0
    for step in range(SLOW_RUN_STEPS - 1):
        inbox.put_step(step, 25.0)
    assert not inbox._ready.is_set()
    inbox.put_step(SLOW_RUN_STEPS - 1, 25.0)
    assert inbox._ready.is_set()
    assert inbox.take(0.0) == list(range(SLOW_RUN_STEPS)) and inbox.took_urgent
    inbox.put_step(99, 25.0)  # the same run goes on: no second wake
    assert not inbox._ready.is_set()
    assert inbox.take(0.0) == [99] and not inbox.took_urgent
    inbox.put_step(100, 5.0)  # a normal step ends the run
    for step in range(SLOW_RUN_STEPS - 1):
        inbox.put_step(200 + step, 25.0)
    inbox.put_step(299, math.nan)  # an untimed step is not slow: it ends the run too
    inbox.put_step(300, 25.0)
    assert not inbox._ready.is_set()
    for step in range(SLOW_RUN_STEPS - 1):
        inbox.put_step(301 + step, 25.0)
    items = inbox.take(0.0)
    assert inbox.took_urgent and items[-1] == 301 + SLOW_RUN_STEPS - 2


def test_a_slow_run_counted_after_a_take_is_told_by_the_next_one() -> None:
    # the 4th slow step arrives while the consumer works on what it took: the next take
    # returns at once, with that step, and says it ends a slow run
    inbox = StepInbox(object())
    inbox.wake_at = 100
    inbox.slow_ms = 10.0
    for step in range(SLOW_RUN_STEPS - 1):
        inbox.put_step(step, 25.0)
    assert inbox.take(0.0) == list(range(SLOW_RUN_STEPS - 1)) and not inbox.took_urgent
    inbox.put_step(SLOW_RUN_STEPS - 1, 25.0)
    assert inbox.take(5.0) == [SLOW_RUN_STEPS - 1] and inbox.took_urgent


def test_no_median_no_early_wake() -> None:
    inbox = StepInbox(object())
    inbox.wake_at = 100
    for step in range(50):
        inbox.put_step(step, 1e9)  # slow_ms is inf until the control thread sets it
    assert not inbox._ready.is_set()
    inbox.take(0.0)
    assert not inbox.took_urgent


def row(first: int, durations: list[float], flags: int = 0) -> list[float]:
    local = LocalRound(first, tuple(durations), (0,) * len(durations), flags, room=ROOM)
    return encode_row(local, ROOM).tolist()


def test_a_round_ended_early_covers_the_fewest_steps_sent() -> None:
    early = row(1, [10.0, 11.0, 30.0], FLAG_EARLY)
    full = row(1, [10.0] * ROOM)
    result = decode_rows([full, early], ROOM, with_evidence=False)
    assert [s.step for s in result.samples] == [1, 2, 3]
    assert result.samples[2].times_ms == (10.0, 30.0)
    # cut early for every rank, also the one that sent a full round (the job's count)
    assert result.cut_early
    # a rank's final round is not cut: that rank sends no more
    final = row(1, [10.0, 11.0], FLAG_FINAL)
    result = decode_rows([full, early, final], ROOM, with_evidence=False)
    assert len(result.samples) == ROOM and not result.cut_early
    # without an early flag a short row is read as before (its missing steps unknown)
    result = decode_rows([full, row(1, [10.0])], ROOM, with_evidence=False)
    assert len(result.samples) == ROOM and math.isnan(result.samples[3].times_ms[1])
    assert not result.cut_early


def gather(*sent: LocalRound) -> list[list[float]]:
    return [encode_row(local, ROOM).tolist() for local in sent]


def test_two_ranks_stay_aligned_after_an_early_round() -> None:
    fast, slow = RoundBuilder(ROOM), RoundBuilder(ROOM)
    for step in range(1, 11):
        fast.add(step, 10.0 + step, 0)
    for step in range(1, 6):
        slow.add(step, 30.0 + step, 0)
    sent_fast = fast.take(ROOM)  # its round is full: steps 1-8
    sent_slow = slow.take(ROOM, early=True)  # only steps 1-5 resolved
    assert len(sent_fast.durations_ms) == ROOM and len(sent_slow.durations_ms) == 5
    assert sent_slow.room == ROOM  # rows stay the same length on every rank
    assert sent_slow.flags == FLAG_EARLY and sent_fast.flags == 0
    result = decode_rows(gather(sent_fast, sent_slow), ROOM, with_evidence=False)
    assert len(result.samples) == 5
    for builder, sent in ((fast, sent_fast), (slow, sent_slow)):
        builder.settle(sent, len(result.samples), bool(result.ranks_with(FLAG_FINAL)))
    assert fast.next_first == slow.next_first == 6
    for step in range(6, 14):
        slow.add(step, 30.0 + step, 0)
    for step in range(11, 14):
        fast.add(step, 10.0 + step, 0)
    again_fast, again_slow = fast.take(ROOM), slow.take(ROOM)
    assert again_fast.first_step == again_slow.first_step == 6
    # the fast rank sends steps 6-8 again, as it measured them
    assert again_fast.durations_ms == tuple(10.0 + s for s in range(6, 14))
    assert again_slow.durations_ms == tuple(30.0 + s for s in range(6, 14))


def test_a_full_round_taken_early_is_not_flagged() -> None:
    builder = RoundBuilder(ROOM)
    for step in range(1, 12):
        builder.add(step, 5.0, 0)
    assert builder.take(ROOM, early=True).flags == 0  # all its steps were in


def test_after_a_final_round_met_an_early_one_no_rank_rewinds() -> None:
    # one rank ends its training (final) while another ends the round early: the round
    # is not cut (the final rank sends no more), and both go on from the same step
    ending, early = RoundBuilder(ROOM), RoundBuilder(ROOM)
    for step in range(1, 4):
        ending.add(step, 10.0, 0)
    for step in range(1, 6):
        early.add(step, 30.0, 0)
    last = ending.take(ROOM, final=True)
    last = dataclasses.replace(last, flags=FLAG_FINAL | FLAG_MORE_EVIDENCE)
    cut = early.take(ROOM, early=True)
    result = decode_rows(gather(last, cut), ROOM, with_evidence=False)
    assert len(result.samples) == 5  # the most any rank sent: nothing cut
    early.settle(cut, len(result.samples), bool(result.ranks_with(FLAG_FINAL)))
    # the evidence rounds after it start at the same step on both ranks
    assert ending.take(ROOM, final=True).first_step == early.take(ROOM, final=True).first_step


def test_rewind_is_a_no_op_for_a_round_covered_whole() -> None:
    builder = RoundBuilder(ROOM)
    for step in range(1, 9):
        builder.add(step, 5.0, 0)
    builder.take(ROOM)
    builder.rewind(9)
    assert builder.next_first == 9 and builder.pending_steps() == 0


def _manual_agent(tmp_path: Path) -> Agent:
    """An agent whose steps the test ends by hand, with a tracer (with none, rounds are
    never ended early) at a budget low enough to stay out of the way."""
    config = load_config(
        None,
        ["tracer.backend=kineto", "tracer.overhead_budget_pct=0.1", "detect.warmup_steps=5",
         "detect.min_steps=15", "capture.reference_every_steps=0", "step.source=manual"],
    )  # fmt: skip
    return Agent(config, WorldInfo.from_env({}), tmp_path / "runs")


class HostPacedGpu(FakeGpu):
    """A fake GPU whose events complete at once and are timed by the host clock, so the
    deferred clock's durations are the host's intervals."""

    def record(self, event: FakeEvent, stream: Any) -> None:
        super().record(event, stream)
        event.at_ms = time.perf_counter() * 1e3


@pytest.mark.parametrize("clock", ["host", "deferred_cuda_events"])
def test_a_slowdown_ends_a_long_round_early_in_a_running_agent(tmp_path: Path, clock: str) -> None:
    # the wiring: slow steps reach the inbox's run count, the control thread sends early;
    # with CUDA events (deferred: the training thread reads no times) by the host's
    # intervals between boundaries (`StepInbox.tick`)
    agent = _manual_agent(tmp_path)
    sent: list[tuple[int, int, int]] = []  # first step, steps sent, flags
    run_round = agent.control._run_round

    def spy(local: LocalRound, **kwargs: Any) -> Any:
        sent.append((local.first_step, len(local.durations_ms), local.flags))
        return run_round(local, **kwargs)

    agent.control._run_round = spy  # type: ignore[method-assign]
    agent.install()
    if clock != "host":
        gpu: Any = HostPacedGpu()
        agent.boundaries.use_clock(StepClock("cuda_event", calls=gpu, deferred=True))
    try:
        for step in range(420):
            time.sleep(0.016 if 380 <= step < 392 else 0.004)
            agent.boundaries.manual_step()
    finally:
        agent.close()
    assert agent.control.early_rounds >= 1
    # an early round that ends a few steps into the slowdown: with its 4th slow step in,
    # or its 3rd where the step before the slowdown ran slow too (a loaded host; a CI run
    # ended one at 382)
    early = [first + n - 1 for first, n, flags in sent if flags & FLAG_EARLY]
    assert any(380 + SLOW_RUN_STEPS - 2 <= last <= 380 + 12 for last in early), (early, sent)
    assert agent.control.detector.counts.judged >= 380  # every step still judged once


def test_steps_under_the_slowdown_floor_do_not_end_a_round_early(tmp_path: Path) -> None:
    """On ~1 ms steps a step counts towards a slow run only over the anomaly threshold's
    floor (the median + `detect.min_slowdown_ms`), not over 1.5 x the median alone."""
    agent = _manual_agent(tmp_path)
    agent.install()
    try:
        for _ in range(400):
            time.sleep(0.001)
            agent.boundaries.manual_step()
    finally:
        agent.close()  # the control thread has stopped: both values are its last
    median = agent.control.detector.median_ms
    slow_ms = agent.control.inbox.slow_ms
    assert median is not None and median < 3.0
    assert slow_ms == pytest.approx(median + agent.config.detect.min_slowdown_ms)
    assert slow_ms > 1.5 * median


def test_a_large_worlds_tensor_decode_cuts_an_early_round_the_same() -> None:
    import torch

    from distanom.consensus import decode_round, encode_round

    early = LocalRound(1, (10.0, 11.0, 30.0), (0, 0, 0), FLAG_EARLY, room=ROOM)
    full = LocalRound(1, (10.0,) * ROOM, (0,) * ROOM, room=ROOM)
    matrix = torch.stack([encode_round(full, ROOM), encode_round(early, ROOM)])
    by_tensor = decode_round(matrix, ROOM, with_evidence=False)
    by_lists = decode_rows(gather(full, early), ROOM, with_evidence=False)
    assert [s.step for s in by_tensor.samples] == [1, 2, 3]
    assert by_tensor.samples == by_lists.samples
