"""Straggler scores: who the others wait for, since when; drift of the whole job."""

from __future__ import annotations

import random

from distanom.stragglers import StragglerScorer


def feed(scorer: StragglerScorer, steps: range, slow_rank: int, slow_from: int) -> None:
    rng = random.Random(7)
    for step in steps:
        arrive = [10.0 + rng.uniform(0, 0.5) for _ in range(scorer.world_size)]
        step_ms = 15.0
        if step >= slow_from:
            arrive[slow_rank] += 20.0
            step_ms += 20.0
        scorer.add(step, arrive, step_ms)


def test_a_rank_late_on_every_step_is_named_with_since_when() -> None:
    scorer = StragglerScorer(4)
    feed(scorer, range(1, 121), slow_rank=2, slow_from=60)
    (first, *rest) = scorer.stragglers()
    assert first.rank == 2 and rest == []
    assert 58 <= first.since_step <= 62
    assert first.score > 0.5 and first.evidence["run_late_steps"] >= 61
    assert scorer.to_json()["stragglers"][0]["rank"] == 2


def test_noise_names_nobody_and_a_recovered_rank_is_dropped() -> None:
    scorer = StragglerScorer(4)
    feed(scorer, range(1, 200), slow_rank=1, slow_from=10_000)
    assert scorer.stragglers() == []
    scorer = StragglerScorer(2, window=16)
    feed(scorer, range(1, 40), slow_rank=1, slow_from=1)
    assert [s.rank for s in scorer.stragglers()] == [1]
    feed(scorer, range(40, 80), slow_rank=1, slow_from=10_000)
    assert scorer.stragglers() == []


def test_every_slow_rank_of_a_slow_node_is_named_most_severe_first() -> None:
    scorer = StragglerScorer(8, window=20)
    for step in range(1, 41):
        arrive = [10.0] * 8
        arrive[5] += 30.0
        arrive[6] += 20.0  # two ranks of one node, one slower
        scorer.add(step, arrive, 45.0)
    assert [s.rank for s in scorer.stragglers()] == [5, 6]


def test_drift_of_the_whole_job() -> None:
    scorer = StragglerScorer(2, window=10)
    for step in range(1, 41):
        scorer.add(step, [10.0, 10.1], 10.0 + step)  # slower every step
    drift = scorer.drift()
    assert drift is not None and drift["ratio"] > 2 and drift["from_step"] == 1
    steady = StragglerScorer(2, window=10)
    for step in range(1, 41):
        steady.add(step, [10.0, 10.1], 10.0)
    assert steady.drift() is None


def test_a_little_lateness_from_a_loaded_host_does_not_move_when_a_straggler_began() -> None:
    # before step 50 rank 1 is late by a little (3 of 40 ms: "late", over 5%) at 7 steps
    # in 10, as on a loaded host; from 50 on it is 30 ms late at every step
    scorer = StragglerScorer(3)
    named_at = None
    for step in range(1, 200):
        arrive = [10.0, 10.0, 10.2]
        if step >= 50:
            arrive[1] += 30.0
        elif step >= 20 and step % 10 >= 3:
            arrive[1] += 3.0
        scorer.add(step, arrive, 40.0)
        if named_at is None and scorer.stragglers():
            named_at = step
    (first,) = scorer.stragglers()
    assert first.rank == 1 and named_at is not None and named_at > 50
    assert first.since_step == 50  # counting late steps alike, it was 23


def test_a_straggler_that_caught_up_is_kept_as_an_earlier_one() -> None:
    scorer = StragglerScorer(2, window=16)
    feed(scorer, range(1, 40), slow_rank=1, slow_from=1)
    (named,) = scorer.stragglers()
    assert scorer.to_json()["earlier"] == []
    feed(scorer, range(40, 80), slow_rank=1, slow_from=10_000)
    assert scorer.stragglers() == []
    (earlier,) = scorer.to_json()["earlier"]
    assert earlier["rank"] == 1 and earlier["since_step"] == named.since_step
    # named until a few steps after it caught up: the window still held its late steps
    assert 40 <= earlier["until_step"] < 60
    assert earlier["peak_score"] >= round(named.score, 4) > 0.5


def test_a_rank_that_crosses_the_line_again_and_again_is_one_earlier_straggler() -> None:
    # late at 3 steps in 5, right at the 60% line: a 16-step window holds 9 or 10 late
    # steps, so the rank is named and dropped ~100 times; then on time. One entry from
    # its first naming, not one per crossing (which filled all 16 places before)
    scorer = StragglerScorer(2, window=16)
    crossings, named_before, first_since = 0, False, None
    for step in range(1, 600):
        late = step < 500 and step % 5 in (0, 1, 2)
        scorer.add(step, [10.0, 30.0 if late else 10.2], 35.0 if late else 15.0)
        named = scorer.stragglers()
        if named and first_since is None:
            first_since = named[0].since_step
        crossings += bool(named) and not named_before
        named_before = bool(named)
    assert crossings > 50 and scorer.stragglers() == []
    (earlier,) = scorer.to_json()["earlier"]
    assert earlier["rank"] == 1 and earlier["since_step"] == first_since
    assert 490 <= earlier["until_step"] < 520


def test_the_skew_of_a_jobs_first_steps_names_nobody() -> None:
    # a rank late at its first 12 steps (start-up), then on time: 12 of the first 32
    # steps is under the 60% line; over the first 8 (before) it was named
    scorer = StragglerScorer(4)
    feed(scorer, range(1, 13), slow_rank=0, slow_from=1)
    feed(scorer, range(13, 200), slow_rank=0, slow_from=10_000)
    assert scorer.stragglers() == [] and scorer.to_json()["earlier"] == []


def loaded_host(
    scorer: StragglerScorer, steps: range, *, start_up: int = 0, stall_at: int = -1
) -> list[int]:
    """A fault-free job on a loaded host: step times jitter by -20%..+25% and rank 1 is a
    little late (6% of the step) at two steps in three; its first `start_up` steps it is
    very late (start-up), at `stall_at` it stalls for 0.5 s. The steps it was named at."""
    rng = random.Random(11)
    named = []
    for step in steps:
        step_ms = 30.0 * rng.uniform(0.8, 1.25)
        arrive = [10.0] * scorer.world_size
        if step % 3:
            arrive[1] += 0.06 * step_ms
        if step <= start_up:
            arrive[1] += 0.4 * step_ms
        if step == stall_at:
            arrive[1] += 500.0
            step_ms += 500.0
        scorer.add(step, arrive, step_ms)
        if scorer.stragglers():
            named.append(step)
    return named


def test_one_stall_on_a_loaded_host_does_not_make_a_straggler() -> None:
    # the 0.5 s stall was ~0.25 of the window's summed time: the rank's mean share rose
    # over 5% for a window, and the rule named it from the stall on (steps 100-163)
    scorer = StragglerScorer(2)
    assert loaded_host(scorer, range(1, 300), stall_at=100) == []
    assert scorer.to_json()["earlier"] == []
    assert scorer.window_score(1) < 0.1  # the median share: the stall is one step of 64


def test_a_fault_free_warm_up_on_a_loaded_host_names_nobody() -> None:
    # 15 start-up steps late by 40%, then a little late at most steps: the mean share
    # named it from step 32 to ~70; the median share over the window is the jitter's
    scorer = StragglerScorer(4)
    assert loaded_host(scorer, range(1, 300), start_up=15) == []
    assert scorer.to_json()["earlier"] == []


def test_a_straggler_is_named_through_the_same_jitter() -> None:
    # the same loaded host, and rank 1 late by 30 ms at every step from step 60 on
    rng = random.Random(5)
    scorer = StragglerScorer(4)
    for step in range(1, 200):
        step_ms = 30.0 * rng.uniform(0.8, 1.25)
        arrive = [10.0, 10.0 + (0.06 * step_ms if step % 3 else 0.0), 10.0, 10.0]
        if step >= 60:
            arrive[1] += 30.0
            step_ms += 30.0
        scorer.add(step, arrive, step_ms)
    (first,) = scorer.stragglers()
    assert first.rank == 1 and 58 <= first.since_step <= 62 and first.score > 0.4
    assert 0.05 < scorer.step_spread() < 0.3  # the jitter it was judged against


def test_a_stall_just_before_a_straggler_began_does_not_move_when_it_began() -> None:
    # a 0.5 s stall at step 50, then 10 ms late at every step from 60: the stall weighed
    # as 50 typical late steps and the streak was said to begin at 50
    scorer = StragglerScorer(4)
    for step in range(1, 200):
        arrive = [10.0] * 4
        step_ms = 30.0 + (step % 7) * 0.2
        if step >= 60:
            arrive[1] += 10.0
            step_ms += 10.0
        if step == 50:
            arrive[1] += 500.0
            step_ms += 500.0
        scorer.add(step, arrive, step_ms)
    (first,) = scorer.stragglers()
    assert first.rank == 1 and first.since_step == 60
