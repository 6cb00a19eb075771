"""Round lengths with a tracer: long rounds away from traced steps, rounds cut to end
within half the trace history of the first step the duty cycle may trace.

The simulation plays both threads against the real `DutyCycle`: the training thread asks
`wanted` at every boundary (keeping its state when the answer is None, as the boundary
does), the control thread gathers rounds some steps late and schedules requested steps.
"""

from __future__ import annotations

import random

import pytest

from distanom.config import config_from_mapping
from distanom.detect import StepSample
from distanom.duty_cycle import DutyCycle
from distanom.rounds import cut_at_trace, steps_per_round, traced_round_steps

HISTORY = 32


def budgeted_duty() -> DutyCycle:
    return DutyCycle(config_from_mapping({"tracer": {"overhead_budget_pct": 1}}))


def round_length(duty: DutyCycle, first: int, median_ms: float = 10.0) -> int:
    n = steps_per_round(median_ms, 1000.0, 128)
    return cut_at_trace(n, first, duty.first_traced(first, first + n - 1), HISTORY)


def simulate(
    seed: int, steps: int, max_late: int, requests: float, median_ms: float = 10.0
) -> tuple[list[tuple[int, int]], dict[int, bool]]:
    """Rounds (first, last) and each step's tracing state, as the two threads made them."""
    rng = random.Random(seed)
    duty = budgeted_duty()
    traced: dict[int, bool] = {}
    rounds: list[tuple[int, int]] = []
    state = True  # the tracer starts on at the first boundary
    first, n, late = 1, round_length(duty, 1, median_ms), rng.randint(0, max_late)
    for step in range(steps):  # the boundary that ends `step`
        traced[step] = state
        wanted = duty.wanted(step + 1)
        if wanted is not None:
            state = wanted
        while step >= first + n - 1 + late:  # the control thread gathers a round
            samples = []
            for s in range(first, first + n):
                ms = median_ms * (1.2 if traced[s] else 1.0) * rng.uniform(0.97, 1.03)
                samples.append(StepSample(s, (ms,), traced[s]))
            duty.record(samples)
            if rng.random() < requests:  # a request or a planned window, a lead ahead
                start = step + 4 + rng.randint(0, 40)
                duty.request(list(range(start, start + rng.randint(1, 5))))
            rounds.append((first, first + n - 1))
            first += n
            n, late = round_length(duty, first, median_ms), rng.randint(0, max_late)
    return rounds, traced


@pytest.mark.parametrize(
    ("seed", "median_ms", "max_late"),
    [(s, 10.0, 4) for s in range(4)] + [(s, 2.6, 16) for s in range(4)],
)
def test_every_traced_step_is_decided_on_within_half_the_history(
    seed: int, median_ms: float, max_late: int
) -> None:
    # rounds gathered up to `max_late` steps after their last step ended
    rounds, traced = simulate(seed, 12_000, max_late, requests=0.03, median_ms=median_ms)
    near = traced_round_steps(HISTORY)
    for first, last in rounds:
        for step in range(first, last + 1):
            if traced[step]:
                # the round holding a traced step ends soon enough after it that the step's
                # trace is still kept when the round's decisions arrive
                assert last - step < near, (first, last, step)
    lengths = [last - first + 1 for first, last in rounds]
    longest = steps_per_round(median_ms, 1000.0, 128)  # 100 steps at 10 ms, 128 at 2.6
    covered_long = sum(n for n in lengths if n == longest)
    # at a 1% budget most steps are untraced: most of the run goes in long rounds
    assert covered_long > 0.6 * sum(lengths), lengths[:50]
    assert sum(traced.values()) < 0.3 * len(traced)


def test_without_a_governor_every_round_is_short() -> None:
    duty = budgeted_duty()
    duty.disable()  # tracing stays as it is: any step may be traced
    assert duty.first_traced(500, 600) == 500
    assert round_length(duty, 500) == traced_round_steps(HISTORY)


def fed_duty(steps: int, traced_ms: float = 30.0) -> DutyCycle:
    """A budgeted duty cycle fed `steps` gathered steps of 10 ms, `traced_ms` traced (30:
    the governor traces as little as it may)."""
    duty = budgeted_duty()
    for step in range(1, steps + 1):
        on = bool(duty.wanted(step))
        duty.record([StepSample(step, (traced_ms if on else 10.0,), on)])
    return duty


def test_scheduled_steps_cut_a_round_even_after_the_training_thread_passed_them() -> None:
    duty = fed_duty(2000)
    # a stretch the governor leaves untraced (decided from the data fed)
    quiet = next(a for a in range(1900, 2100) if duty.first_traced(a, a + 99) is None)
    assert duty.first_traced(quiet, quiet + 99) is None
    target = quiet + 50
    duty.request([target, target + 1])
    assert duty.first_traced(quiet, quiet + 99) == target
    assert duty.wanted(target) is True  # the training thread consumes the step ...
    assert duty.wanted(target + 2) is False  # ... and drops the next one on passing it
    # the control thread still knows both, and a window's worth of steps after them
    # (a decision that reached the training thread late may have kept tracing on there)
    assert duty.first_traced(target + 1, quiet + 99) == target + 1
    assert duty.first_traced(target + 17, quiet + 99) == target + 17
    assert duty.first_traced(target + 18, quiet + 99) is None


def test_a_traced_window_counts_for_the_window_after_it() -> None:
    duty = fed_duty(2000, traced_ms=10.4)  # tracing costs 4%: about one window in five
    governor = duty.governor
    assert governor is not None

    def on(step: int) -> bool:
        return governor.tracing_on(step)

    # bursts of traced windows between untraced ones, all decided from the data fed
    kept = range(1 + 16 * 70, 2080, 16)  # windows whose decisions are still kept
    first = next(s for s in kept if on(s) and not on(s - 16) and not on(s - 32))
    assert duty.first_traced(first - 20, first + 40) == first
    last = next(s for s in kept if on(s) and not on(s + 16) and not on(s + 32))
    end = last + 16
    assert duty.first_traced(end, end + 15) == end  # the pad after it
    assert duty.first_traced(end + 16, end + 31) is None


def test_a_window_the_governor_cannot_decide_yet_counts_as_traced() -> None:
    duty = budgeted_duty()  # no data: windows past the lag are not decidable
    governor = duty.governor
    assert governor is not None and not governor.ready(500)
    assert duty.first_traced(500, 600) == 500


def test_no_window_is_traced_blind_while_the_first_measurement_is_on_its_way() -> None:
    # the decision lag is a whole round (132 steps): the bootstrap's traced window is
    # measured only ~9 windows later, and the windows between must not spend credit
    # banked at the initial fraction (a burst of 4 windows before anything is known)
    from distanom.governor import GovernorParams, OverheadGovernor

    governor = OverheadGovernor(1.0, GovernorParams(lag_steps=132), first_step=1)
    traced = []
    for step in range(1, 40 * 16 + 1):
        on = governor.tracing_on(step)
        traced.append(on)
        governor.record(step, 0.010 * (1.2 if on else 1.0), on)
    windows = [traced[w * 16] for w in range(40)]
    assert windows[0] and not any(windows[1:]), windows  # 20% overhead at 1%: rare
