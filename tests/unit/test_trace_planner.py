"""The trace planner: periods learned from anomalies, windows around predicted ones, lasting
slowdowns traced at once, all within its share of the budget, the same on every rank;
and the governor's side of the accounting (`charge`)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import pytest

from distanom.analysis.run_checks import STATUS_FIELDS
from distanom.config import config_from_mapping
from distanom.detect import AnomalyJudgment, StepSample
from distanom.duty_cycle import DutyCycle
from distanom.governor import GovernorParams, OverheadGovernor
from distanom.run_periods import LASTING, ONE_OFF, PERIODIC, classify_steps, recurrences
from distanom.trace_planner import (
    DEFAULT_COSTS,
    Costs,
    PlannerParams,
    SeriesLearner,
    TracePlanner,
)

COSTS = Costs(traced_step=0.13, switch=1.3, window=16 * 0.2)
LAG = 2  # the planner hears of a step this many steps after the slowest host ran it


def run(
    planner: TracePlanner,
    steps: int,
    anomalies: dict[int, float],
    traced: Callable[[int], bool] = lambda s: False,
) -> tuple[set[int], list[float]]:
    """Feed `planner` one round per step, as the control loop does; returns the planned
    steps and the charges. Checks every round that planned steps are ahead of every host
    and that the planner stays within its allowance."""
    planned: set[int] = set()
    charges: list[float] = []
    for host in range(LAG + 1, steps + 1):
        judged_step = host - LAG
        judged = []
        if judged_step in anomalies:
            judged = [(judged_step, traced(judged_step) or judged_step in planned,
                       anomalies[judged_step])]  # fmt: skip
        plan = planner.plan(judged, judged_step, host, judged_step, lambda: COSTS)
        assert all(s > host + planner.params.lead_steps for s in plan.steps)
        allowance = planner.params.share * planner.budget_pct / 100 * judged_step
        assert planner.counts.spent_step_times <= allowance + planner.params.advance_step_times
        planned.update(plan.steps)
        charges.append(plan.charge_windows)
    return planned, charges


def test_a_periodic_anomaly_with_jitter_is_traced_from_its_fourth_occurrence_on() -> None:
    rng = random.Random(3)
    starts = [k * 200 + rng.choice((-1, 0, 1)) for k in range(1, 30)]
    planner = TracePlanner(1.0, merge_gap_steps=5)
    planned, charges = run(planner, 6000, dict.fromkeys(starts, 4.0))
    missed = [s for s in starts[3:] if s not in planned]
    assert len(missed) <= 0.1 * len(starts[3:]), missed
    assert starts[2] not in planned  # learned from the first three
    (series,) = planner.learner.series
    assert series.period == pytest.approx(200, abs=0.5)
    assert sum(charges) == pytest.approx(planner.counts.spent_step_times / COSTS.window)
    # a few steps around each predicted start, not the run
    assert len(planned) <= 5 * len(starts)


def test_an_exact_series_gets_the_step_before_each_start_and_the_start() -> None:
    starts = list(range(100, 3000, 100))
    planner = TracePlanner(5.0, merge_gap_steps=5)
    planned, _ = run(planner, 3000, dict.fromkeys(starts, 4.0))
    assert {398, 399, 400, 401, 402} <= planned  # three starts: a wide window
    later = set(range(1000, 3000, 100))
    assert {s for s in planned if 990 <= s < 2990} == later | {s - 1 for s in later}


def test_two_series_at_once_are_both_learned() -> None:
    evals = list(range(200, 10_000, 200))
    checkpoints = list(range(500, 10_000, 500))
    anomalies = {**dict.fromkeys(evals, 3.0), **dict.fromkeys(checkpoints, 8.0)}
    planner = TracePlanner(5.0, merge_gap_steps=5)  # enough budget for both
    planned, _ = run(planner, 10_000, anomalies)
    for series in (evals, checkpoints):
        later = series[3:]
        assert sum(s in planned for s in later) >= 0.9 * len(later)
    assert sorted(round(s.period) for s in planner.learner.series) == [200, 500]


def test_a_coincidental_series_is_dropped_at_its_first_miss() -> None:
    planner = TracePlanner(5.0, merge_gap_steps=5)
    planned, _ = run(planner, 2000, {300: 3.0, 400: 3.0, 500: 3.0})
    assert {599, 600, 601} <= planned  # the 4th start, were it a series
    assert not planner.learner.series  # it did not come: dropped
    assert max(planned) <= 602  # its window, and nothing after it


def test_slight_anomalies_in_dense_noise_teach_no_period_and_do_not_move_an_event() -> None:
    # a loaded host: slight anomalies at random, one step in 30, and a slight periodic one
    rng = random.Random(5)
    slight = {s: rng.uniform(1.5, 1.7) for s in rng.sample(range(50, 6000), 200)}
    slight.update({s: 1.6 for s in range(100, 6000, 100)})
    planner = TracePlanner(1.0, merge_gap_steps=5)
    run(planner, 6000, slight)
    # chance triples abound at this density: none may become a series
    assert planner.counts.series_learned == 0 and planner.counts.periodic_windows == 0
    stalls = {s: 5.0 for s in range(100, 1000, 100)}
    stalls.update({s - 3: 1.6 for s in range(100, 1000, 100)})  # noise just before each
    planner = TracePlanner(5.0, merge_gap_steps=5)
    planned, _ = run(planner, 1000, stalls)
    assert all(s in planned for s in range(400, 1000, 100))


def test_a_delay_straddling_the_strong_ratio_is_learned_amid_sparse_noise() -> None:
    # a periodic GPU delay of about 2x the median (the H200 e2e: some occurrences over
    # `min_ratio`, some under) amid one-off noise near the threshold, one step in 150
    mixed, weak, occurrences = 0, 0, 0
    for seed in range(6):
        rng = random.Random(seed)
        starts = list(range(150, 6000, 400))
        anomalies = {s: 1.5 + rng.expovariate(10) for s in rng.sample(range(20, 6000), 40)}
        anomalies.update({s: rng.choice((1.8, 1.9, 2.1, 2.2)) for s in starts})
        planner = TracePlanner(1.0, merge_gap_steps=5)
        planned, _ = run(planner, 6000, anomalies)
        later = starts[3:]
        mixed += sum(s in planned for s in later)
        occurrences += len(later)
        # all of them at 1.8: a quarter of this noise is as strong, so chance is ruled
        # out later (after more occurrences) in one seed of six
        planner = TracePlanner(1.0, merge_gap_steps=5)
        planned, _ = run(planner, 6000, {**anomalies, **dict.fromkeys(starts, 1.8)})
        weak += sum(s in planned for s in later)
    assert mixed >= 0.95 * occurrences, (mixed, occurrences)
    assert weak >= 0.9 * occurrences, (weak, occurrences)


def test_slight_noise_just_before_a_weak_event_does_not_move_its_start() -> None:
    anomalies = {s: 1.8 for s in range(150, 3000, 400)}
    anomalies.update({s - 4: 1.55 for s in range(150, 3000, 400)[1::2]})  # every other
    planner = TracePlanner(5.0, merge_gap_steps=5)
    planned, _ = run(planner, 3000, anomalies)
    assert all(s in planned for s in range(1350, 3000, 400))
    (found,) = recurrences(anomalies.items(), merge_gap_steps=5)
    assert found.starts == tuple(range(150, 3000, 400))


def test_endless_slight_hiccups_do_not_keep_a_finished_series_alive() -> None:
    # an episode that never ends must not hold back the learner's expiry
    anomalies = {s: 4.0 for s in range(100, 1001, 100)}
    anomalies.update({s: 1.6 for s in range(1010, 6000, 5)})  # 1.6x every 5 steps
    planner = TracePlanner(5.0, merge_gap_steps=5)
    planned, _ = run(planner, 6000, anomalies)
    assert not planner.learner.series
    assert max(planned) < 1500  # a window or two after the last event, then nothing


def test_slight_noise_after_a_quiet_stretch_teaches_few_periods() -> None:
    # the noise rate is the recent one: a quiet past does not dilute a loaded host's noise
    rng = random.Random(0)
    anomalies = {s: 5.0 for s in rng.sample(range(100, 10_000), 30)}  # strong one-offs
    anomalies.update({s: rng.uniform(1.5, 1.7) for s in rng.sample(range(10_000, 16_000), 240)})
    planner = TracePlanner(1.0, merge_gap_steps=5)
    run(planner, 16_000, anomalies)
    assert planner.counts.series_learned <= 6  # 15-25 when the rate was over all kept starts


def test_dense_slight_noise_does_not_confirm_a_coincidence() -> None:
    rng = random.Random(4)
    anomalies = {s: rng.uniform(1.5, 1.7) for s in rng.sample(range(100, 700), 25)}
    anomalies.update({300: 3.0, 400: 3.0, 500: 3.0, 600: 1.6})  # strong by chance, then noise
    planner = TracePlanner(5.0, merge_gap_steps=0)
    run(planner, 800, anomalies)
    assert planner.counts.series_learned >= 1 and not planner.learner.series


def test_a_short_coincidental_period_does_not_hide_its_multiple() -> None:
    learner = SeriesLearner(PlannerParams())
    for start in (200, 400, 500, 600):  # every 200 and every 500: "every 100" by chance
        learner.expire(start - 1)
        learner.observe(start)
    assert sorted(round(s.period) for s in learner.series) == [100, 200]


def test_a_slight_lasting_slowdown_on_a_series_phase_stays_a_lasting_slowdown() -> None:
    anomalies = {s: 4.0 for s in range(100, 801, 100)}
    anomalies.update({s: 1.6 for s in range(1000, 1300)})  # starts where 1000 was predicted
    kinds = classify_steps(anomalies.items(), merge_gap_steps=5)
    assert kinds[1000] == LASTING and kinds[800] == PERIODIC


def test_steps_without_a_ratio_are_no_events() -> None:
    nan = float("nan")
    learner = SeriesLearner(PlannerParams())
    for start in (1000, 1100, 1200, 1300):
        learner.observe(start, nan)
    assert not learner.series
    planner = TracePlanner(5.0, merge_gap_steps=5)
    planned, _ = run(planner, 2000, dict.fromkeys(range(100, 2000, 100), nan))
    assert not planned and planner.counts.series_learned == 0


def test_what_is_learned_does_not_depend_on_how_steps_fall_into_rounds() -> None:
    anomalies = {100: 4.0, 200: 4.0, 300: 4.0, 402: 1.2, 403: 1.8, 503: 4.0, 603: 4.0}
    anomalies.update({401: 1.5, 703: 4.0, 903: 1.8, 1003: 4.0})
    learned = []
    for size in (1, 8, 130):
        planner = TracePlanner(5.0, merge_gap_steps=5)
        for end in range(size, 1040 + 1, size):  # rounds of `size` judged steps, to 1040
            judged = [(s, False, anomalies[s]) for s in range(end - size + 1, end + 1)
                      if s in anomalies]  # fmt: skip
            planner.plan(judged, end, end + LAG, end, lambda: COSTS)
        learned.append([(round(s.period), s.hits, s.points[0][1]) for s in planner.learner.series])
    assert learned[0] == learned[1] == learned[2]
    (found,) = recurrences(anomalies.items(), merge_gap_steps=5)  # the report agrees
    assert [(round(found.period), found.starts[0])] == [(p, first) for p, _, first in learned[0]]


def test_a_weak_series_is_learned_among_weaker_dense_noise() -> None:
    starts = list(range(300, 8000, 300))
    anomalies = {s: 1.5 for s in range(20, 8000, 20) if all(abs(s - t) > 6 for t in starts)}
    anomalies.update(dict.fromkeys(starts, 1.9))  # the noise is not as strong: no chance
    planner = TracePlanner(5.0, merge_gap_steps=5)
    planned, _ = run(planner, 8000, anomalies)
    later = starts[3:]
    assert sum(s in planned for s in later) >= 0.9 * len(later)


def test_a_short_clean_weak_series_hits() -> None:
    for period in (40, 60):
        starts = list(range(period, 3000, period))
        planner = TracePlanner(5.0, merge_gap_steps=5)
        planned, _ = run(planner, 3000, dict.fromkeys(starts, 1.8))
        later = starts[3:]
        assert sum(s in planned for s in later) >= 0.9 * len(later), period


def test_a_pause_does_not_report_multiples_of_the_period() -> None:
    anomalies = dict.fromkeys([*range(200, 2001, 200), *range(3000, 6001, 200)], 3.0)
    found = recurrences(anomalies.items(), merge_gap_steps=5)
    assert [(round(r.period), r.starts[0], len(r.starts)) for r in found] == [
        (200, 200, 10),
        (200, 3000, 16),
    ]


def test_an_untraced_lasting_slowdown_is_traced_within_its_first_window() -> None:
    slow = {s: 1.7 for s in range(1000, 1300)}
    planner = TracePlanner(1.0, merge_gap_steps=5)
    planned, _ = run(planner, 2000, slow)
    assert planned and min(planned) - 1000 < 16
    assert len(planned) == planner.params.episode_steps  # once per episode
    assert planner.counts.episode_windows == 1
    # already traced (the duty cycle was on): nothing to add
    planner = TracePlanner(1.0, merge_gap_steps=5)
    planned, _ = run(planner, 2000, slow, traced=lambda s: True)
    assert not planned


def test_short_bursts_are_no_lasting_slowdown() -> None:
    bursts = {s + d: 1.7 for s in range(100, 3000, 97) for d in range(3)}
    planner = TracePlanner(1.0, merge_gap_steps=5)
    run(planner, 3000, bursts)
    assert planner.counts.episode_windows == 0
    assert planner.counts.series_learned == 1  # they are periodic, though


def test_an_exhausted_budget_declines_windows_and_holds() -> None:
    starts = list(range(50, 5000, 50))  # a window every 50 steps costs ~3% at these costs
    planner = TracePlanner(1.0, merge_gap_steps=5)
    planned, _ = run(planner, 5000, dict.fromkeys(starts, 4.0))
    assert planner.counts.declined > 0
    spent = planner.counts.spent_step_times
    assert spent <= 0.8 * 0.01 * 5000 + planner.params.advance_step_times
    later = starts[3:]
    assert 0.2 * len(later) < sum(s in planned for s in later) < 0.6 * len(later)
    # with no advance and a tiny budget nothing is affordable
    params = PlannerParams(advance_step_times=0.0)
    planner = TracePlanner(0.001, merge_gap_steps=5, params=params)
    planned, _ = run(planner, 5000, dict.fromkeys(starts, 4.0))
    assert not planned and planner.counts.declined > 0


def test_the_same_inputs_give_the_same_plan() -> None:
    rng = random.Random(7)
    anomalies = {s: rng.uniform(1.5, 6.0) for s in rng.sample(range(20, 8000), 300)}
    anomalies.update(dict.fromkeys(range(300, 8000, 300), 5.0))
    plans = []
    for _ in range(2):
        planner = TracePlanner(1.0, merge_gap_steps=5)
        plans.append(run(planner, 8000, anomalies))
    assert plans[0] == plans[1]


def test_classes_of_a_run() -> None:
    anomalies = {s: 4.0 for s in (200, 400, 600, 800)}  # periodic
    anomalies.update({s: 1.6 for s in range(1050, 1060)})  # lasting
    anomalies.update({1500: 3.0, 2702: 1.6})  # one-offs
    anomalies[797] = 1.6  # just before a periodic one: the same episode, still periodic
    kinds = classify_steps(anomalies.items(), merge_gap_steps=5)
    assert {kinds[s] for s in (200, 400, 600, 797, 800)} == {PERIODIC}
    assert {kinds[s] for s in range(1050, 1060)} == {LASTING}
    assert kinds[1500] == kinds[2702] == ONE_OFF


def test_a_runs_recurrences_name_their_period_and_starts() -> None:
    anomalies = {s: 4.0 for s in range(150, 2000, 400)}  # every 400 from 150
    anomalies.update({s: 3.0 for s in (300, 400, 500)})  # three in a row by chance
    anomalies.update({s: 1.6 for s in range(1000, 1010)})  # a lasting slowdown
    (found,) = recurrences(anomalies.items(), merge_gap_steps=5)
    assert found.period == pytest.approx(400) and found.starts == (150, 550, 950, 1350, 1750)
    assert recurrences({s: 4.0 for s in (300, 400, 500)}.items(), 5) == []  # never came again
    for period in (10, 20, 50, 100, 200):  # 4 evenly spaced stalls and nothing else
        (alone,) = recurrences({100 + k * period: 5.0 for k in range(4)}.items(), 5)
        assert alone.period == pytest.approx(period, abs=1), period


def loaded_host_jitter(seed: int, steps: int = 1000, rate: float = 0.05) -> dict[int, float]:
    """A fault-free run on a loaded host: episodes of 1-3 anomalous steps of 1.6-2.8x the
    median (about half of them strong, 2x or more) at random, ~`rate` per step."""
    rng = random.Random(seed)
    out: dict[int, float] = {}
    step = 10
    while step < steps:
        if rng.random() < rate:
            for k in range(rng.choice((1, 1, 1, 2, 3))):
                out[step + k] = rng.uniform(1.6, 2.8)
            step += 3
        step += 1
    return out


def test_a_loaded_hosts_jitter_makes_no_recurrence() -> None:
    # three events line up and a fourth comes where predicted, at some period, in most
    # such runs: 13 of these 20 at 4 per 100 steps, 20 of 20 at 6 per 100 (before the
    # chance test); now one at most
    for rate in (0.04, 0.06):
        found = [recurrences(loaded_host_jitter(seed, rate=rate).items(), 5) for seed in range(20)]
        assert sum(bool(f) for f in found) <= 1, [f for f in found if f]


def test_a_periodic_stall_in_the_same_jitter_is_still_found() -> None:
    stalls = range(100, 801, 100)
    for seed in range(20):
        noise = loaded_host_jitter(seed, rate=0.04)
        anomalies = {s: r for s, r in noise.items() if all(abs(s - t) > 5 for t in stalls)}
        anomalies.update(dict.fromkeys(stalls, 8.0))
        found = recurrences(anomalies.items(), 5)
        assert any(
            r.period == pytest.approx(100, abs=1) and len(set(r.starts) & set(stalls)) >= 5
            for r in found
        ), (seed, found)


def test_four_regular_occurrences_in_a_quiet_run_are_periodic_in_a_busy_one_not() -> None:
    quiet = {s: 4.0 for s in (200, 400, 600, 800)}
    assert [r.starts for r in recurrences(quiet.items(), 5)] == [(200, 400, 600, 800)]
    # 36 more as strong at random between them: one more where predicted is no evidence
    # (the rule found it and four coincidental series besides)
    rng = random.Random(0)
    busy = dict(quiet)
    busy.update({s: 4.0 for s in rng.sample(range(150, 850), 40) if 8 < s % 200 < 192})
    assert len(busy) == 40 and recurrences(busy.items(), 5) == []


def test_params_are_checked() -> None:
    with pytest.raises(ValueError):
        PlannerParams(tolerance_steps=3, min_period_steps=8)
    with pytest.raises(ValueError):
        PlannerParams(share=0.0)
    with pytest.raises(ValueError):
        TracePlanner(0.0, merge_gap_steps=5)


# -- the governor's side ------------------------------------------------------------


def feed(gov: OverheadGovernor, first: int, last: int) -> None:
    for step in range(first, last + 1):
        on = gov.tracing_on(step) if gov.ready(step) else False
        gov.record(step, 0.010 * (1.13 if on else 1.0), on)


def test_a_charge_lands_on_a_window_no_decision_has_seen_and_costs_traced_windows() -> None:
    params = GovernorParams(lag_steps=4)
    plain = OverheadGovernor(1.0, params, first_step=1)
    charged = OverheadGovernor(1.0, params, first_step=1)
    for gov in (plain, charged):
        feed(gov, 1, 320)
    # the charged one has decided every window its data allow; charge lands after them
    decided = [charged.tracing_on(s) for s in range(161, 321 + 16, 16)]
    assert decided == [plain.tracing_on(s) for s in range(161, 321 + 16, 16)]
    charged.charge(4.0)
    (window, amount), *_ = charged._charges
    assert amount == 4.0 and window * 16 + 1 > 320 + 16
    for gov in (plain, charged):
        feed(gov, 321, 6400)
    assert charged.report()["charged_windows"] == 4.0
    assert charged.report()["windows_traced"] <= plain.report()["windows_traced"] - 3


def test_charges_give_the_same_schedule_however_late_decisions_are_asked() -> None:
    eager = OverheadGovernor(1.0, first_step=1)
    late = OverheadGovernor(1.0, first_step=1)
    for step in range(1, 4001):
        on = eager.tracing_on(step) if eager.ready(step) else False
        for gov in (eager, late):
            gov.record(step, 0.010 * (1.13 if on else 1.0), on)
            if step % 500 == 0:
                gov.charge(1.5)  # after the same data on every rank
    assert [eager.tracing_on(s) for s in range(3000, 4001)] == [
        late.tracing_on(s) for s in range(3000, 4001)
    ]


def test_measured_costs_come_from_the_recorded_data() -> None:
    gov = OverheadGovernor(1.0, first_step=1)
    assert gov.measured_costs().overhead is None
    feed(gov, 1, 3000)
    costs = gov.measured_costs()
    assert costs.traced_step == pytest.approx(0.13, abs=0.01)
    assert costs.overhead is not None and costs.overhead >= costs.traced_step


# -- the duty cycle ------------------------------------------------------------------


def judgment(step: int, ratio: float = 4.0, traced: bool = False) -> AnomalyJudgment:
    return AnomalyJudgment(step, 10.0 * ratio, 10.0, 15.0, traced, "condition", 0)


def test_the_duty_cycle_plans_only_with_a_budget_and_reports_flat_counts() -> None:
    budgeted = DutyCycle(config_from_mapping({"tracer": {"overhead_budget_pct": 1}}))
    unbudgeted = DutyCycle(
        config_from_mapping({"tracer": {"backend": "kineto", "overhead_budget_pct": None}})
    )
    assert budgeted.planner is not None and unbudgeted.planner is None
    assert DutyCycle(config_from_mapping({"tracer": {"backend": "none"}})).planner is None
    for step in (100, 200, 300):
        budgeted.plan([judgment(step)], step + 1, step + 2)
    assert budgeted._forced_on == set(range(398, 403))  # wide: a period from 3 starts
    assert budgeted.wanted(400) is True
    report = budgeted.report()
    assert report is not None and report["planner_periodic_windows"] == 1
    assert STATUS_FIELDS["tracer"]({"duty_cycle": report})  # the report reads it back


def test_a_failing_planner_steps_aside_and_the_duty_cycle_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    duty = DutyCycle(config_from_mapping({"tracer": {"overhead_budget_pct": 1}}))

    def broken(*_args: object) -> None:
        raise RuntimeError("boom")

    assert duty.planner is not None
    duty.planner.plan = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        duty.plan([judgment(10)], 11, 12)
        duty.plan([judgment(20)], 21, 22)
    assert duty.planner is None and duty.governor is not None
    assert sum("trace planner: boom" in r.getMessage() for r in caplog.records) == 1


def test_requested_steps_are_charged_to_the_budget_and_traced() -> None:
    budgeted = DutyCycle(config_from_mapping({"tracer": {"overhead_budget_pct": 1}}))
    assert budgeted.governor is not None
    budgeted.request([40, 41, 42])
    ((_, windows),) = budgeted.governor._charges
    costs = DEFAULT_COSTS  # nothing measured yet
    assert windows == pytest.approx((3 * costs.traced_step + costs.switch) / costs.window)
    assert budgeted.wanted(41) is True
    unbudgeted = DutyCycle(
        config_from_mapping({"tracer": {"backend": "kineto", "overhead_budget_pct": None}})
    )
    assert unbudgeted.governor is not None
    unbudgeted.request([40])
    assert not unbudgeted.governor._charges and unbudgeted.wanted(40) is True


def test_the_duty_cycle_answers_each_window_as_its_governor_decided_it() -> None:
    """`wanted` keeps the last window's decision for the boundaries inside it: the answers
    equal the governor's own, step by step, as rounds of data arrive; a governor replaced
    or removed is never answered for from the cache."""
    duty = DutyCycle(config_from_mapping({"tracer": {"overhead_budget_pct": 1}}))
    governor = duty.governor
    assert governor is not None
    reference = OverheadGovernor(1.0, governor.params, first_step=1)
    answers, expected = [], []
    for step in range(1, 3001):
        answers.append(duty.wanted(step))
        expected.append(reference.tracing_on(step) if reference.ready(step) else None)
        traced = bool(answers[-1])
        ms = 10.0 * (1.13 if traced else 1.0) + (step % 7) * 0.1
        duty.record([StepSample(step, (ms,), traced)])
        reference.record(step, ms / 1000.0, traced)
    assert answers == expected
    assert any(answers) and False in answers  # both decisions were answered
    duty.governor = None
    assert duty.wanted(3001) is None
    duty.governor = OverheadGovernor(1.0, governor.params, first_step=1)
    assert duty.wanted(3001) is None  # the new governor has no data: not the cached answer


def test_a_lasting_slowdown_that_completes_a_coincidental_series_still_gets_its_window() -> None:
    # two noise spikes 200 steps apart, then a real slowdown 200 steps later: the three
    # starts line up as "every 200", but nothing predicted the slowdown, nothing traced it
    anomalies = {300: 2.5, 500: 2.5, **{s: 2.5 for s in range(700, 800)}}
    planner = TracePlanner(1.0, merge_gap_steps=5)
    planned, _ = run(planner, 900, anomalies)
    assert planner.counts.series_learned == 1
    assert planner.counts.episode_windows == 1
    assert planned and min(planned) - 700 < 16
    # a start the series did predict is its window's business, not an episode's
    periodic = {s + d: 4.0 for s in range(200, 3001, 200) for d in range(6)}
    planner = TracePlanner(1.0, merge_gap_steps=5)
    planned, _ = run(planner, 3100, periodic)
    assert planner.counts.episode_windows == 3  # the three starts that taught the period
    assert all(s in planned for s in range(800, 3001, 200))


def test_a_series_yet_to_hit_never_takes_the_last_episode_window_of_the_allowance() -> None:
    # at 0.1% the allowance is ~the 6-step-time advance: two noise episodes take 3.64, a
    # coincidental series (370, 570, 770) would take 1.95 more for its guess at 970, and
    # the real slowdown at 1050 would find 0.4 step times left
    anomalies = {
        **{s: 2.5 for s in range(100, 104)}, **{s: 2.5 for s in range(230, 234)},
        370: 2.5, 570: 2.5, 770: 2.5, **{s: 2.5 for s in range(1050, 1150)},
    }  # fmt: skip
    planner = TracePlanner(0.1, merge_gap_steps=5)
    planned, _ = run(planner, 1200, anomalies)
    assert planner.counts.series_learned == 1 and planner.counts.periodic_windows == 0
    assert planner.counts.episode_windows == 3
    assert min(s for s in planned if s > 300) - 1050 < 16


def test_a_lasting_slowdown_the_budget_declined_is_asked_for_again_while_it_lasts() -> None:
    # no advance: a window's 1.82 step times are affordable once 0.8% of the steps
    # recorded reach them (~step 230); asked at 4 steps in, then at 8, 16, ... 256
    params = PlannerParams(advance_step_times=0.0)
    planner = TracePlanner(1.0, merge_gap_steps=5, params=params)
    planned, _ = run(planner, 600, dict.fromkeys(range(100, 500), 1.7))
    assert planned and 230 <= min(planned) < 500, sorted(planned)
    assert len(planned) == planner.params.episode_steps
    assert planner.counts.episode_windows == 1
    assert planner.counts.declined == 1  # a window declined, counted once per episode
    # a few slow steps (a loaded host's noise) end before the budget has grown: they
    # are declined once and cost nothing more
    planner = TracePlanner(1.0, merge_gap_steps=5, params=params)
    planned, _ = run(planner, 600, dict.fromkeys(range(100, 106), 1.7))
    assert not planned and planner.counts.declined == 1
