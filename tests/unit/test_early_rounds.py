"""Early rounds: a run of slow steps wakes the control thread at once, the rank sends the
steps it has, the round covers the fewest steps any rank sent, and each rank sends the
rest again in the next round."""

from __future__ import annotations

import math

from distanom.consensus import (
    FLAG_EARLY,
    FLAG_FINAL,
    LocalRound,
    decode_rows,
    encode_row,
)
from distanom.inbox import SLOW_RUN_STEPS, StepInbox
from distanom.rounds import RoundBuilder

ROOM = 8


def test_a_run_of_slow_steps_wakes_the_consumer_once() -> None:
    inbox = StepInbox(object())
    inbox.wake_at = 100  # a long round: no wake by count
    inbox.slow_ms = 10.0
    for step in range(SLOW_RUN_STEPS - 1):
        inbox.put_step(step, 25.0)
    assert not inbox.urgent and not inbox._ready.is_set()
    inbox.put_step(SLOW_RUN_STEPS - 1, 25.0)
    assert inbox.urgent and inbox._ready.is_set()
    assert inbox.take(0.0) == list(range(SLOW_RUN_STEPS))
    inbox.urgent = False  # the consumer acted on it
    inbox.put_step(99, 25.0)  # the same run goes on: no second wake
    assert not inbox.urgent and not inbox._ready.is_set()
    inbox.put_step(100, 5.0)  # a normal step ends the run
    inbox.put_step(101, math.nan)  # an untimed step is not slow
    for step in range(SLOW_RUN_STEPS):
        inbox.put_step(200 + step, 25.0)
    assert inbox.urgent


def test_no_median_no_early_wake() -> None:
    inbox = StepInbox(object())
    inbox.wake_at = 100
    for step in range(50):
        inbox.put_step(step, 1e9)  # slow_ms is inf until the control thread sets it
    assert not inbox.urgent and not inbox._ready.is_set()


def row(first: int, durations: list[float], flags: int = 0) -> list[float]:
    local = LocalRound(first, tuple(durations), (0,) * len(durations), flags, room=ROOM)
    return encode_row(local, ROOM).tolist()


def test_a_round_ended_early_covers_the_fewest_steps_sent() -> None:
    early = row(1, [10.0, 11.0, 30.0], FLAG_EARLY)
    full = row(1, [10.0] * ROOM)
    result = decode_rows([full, early], ROOM, with_evidence=False)
    assert [s.step for s in result.samples] == [1, 2, 3]
    assert result.samples[2].times_ms == (10.0, 30.0)
    # a rank's final round is not cut: that rank sends no more
    final = row(1, [10.0, 11.0], FLAG_FINAL)
    result = decode_rows([full, early, final], ROOM, with_evidence=False)
    assert len(result.samples) == ROOM
    # without an early flag a short row is read as before (its missing steps unknown)
    result = decode_rows([full, row(1, [10.0])], ROOM, with_evidence=False)
    assert len(result.samples) == ROOM and math.isnan(result.samples[3].times_ms[1])


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
    rows = [
        encode_row(sent_fast, ROOM).tolist(),
        encode_row(sent_slow, ROOM).tolist(),
    ]
    rows[1][3] = FLAG_EARLY  # as the control loop flags a short non-final round
    result = decode_rows(rows, ROOM, with_evidence=False)
    covered = len(result.samples)
    assert covered == 5
    for builder, sent in ((fast, sent_fast), (slow, sent_slow)):
        if covered < sent.room:  # as the control loop does after a round not final
            builder.rewind(sent.first_step + covered)
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


def test_rewind_is_a_no_op_for_a_round_covered_whole() -> None:
    builder = RoundBuilder(ROOM)
    for step in range(1, 9):
        builder.add(step, 5.0, 0)
    builder.take(ROOM)
    builder.rewind(9)
    assert builder.next_first == 9 and builder.pending_steps() == 0
