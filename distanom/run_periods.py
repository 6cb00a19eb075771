"""The trace planner's rule run over a whole run, for the report: which recorded anomalies
recur and with what period, and the class of each (periodic, lasting slowdown, one-off).

Fed the (step, x median) pairs of anomalies.jsonl by `distanom.analysis.anomalies`; the
same `SeriesLearner` and `PlannerParams` as the planner (`distanom.trace_planner`), fed
the same events in step order (docs/budget.md, "What the report counts"). The report
asks more of a series than the planner, which only spends a trace on it: at least
`MIN_OCCURRENCES` starts, and confirmations (starts after the three that formed it, each
within the learner's window of its prediction) too many for the run's other events as
strong to have put there by chance (`beyond_chance`, at `CHANCE_P` over the series
the learner formed). Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from distanom.trace_planner import (
    SIMILAR_SHARE,
    PlannerParams,
    Series,
    SeriesLearner,
    weak_event,
)

PERIODIC = "periodic"
LASTING = "lasting_slowdown"
ONE_OFF = "one_off"
CLASSES = (PERIODIC, LASTING, ONE_OFF)  # in the order the report lists them
# as a reader of the report names them
CLASS_LABELS = {PERIODIC: "periodic", LASTING: "lasting slowdown", ONE_OFF: "one-off"}
MIN_OCCURRENCES = 4  # the three that formed a series and one that came where predicted
# the most a run's recurrences may be explained by chance (binomial tail), shared
# among the series the learner formed
CHANCE_P = 0.01


def episodes_of(steps: Iterable[int], merge_gap_steps: int) -> list[list[int]]:
    """Anomalous steps (any order) grouped into episodes as the detector groups them."""
    out: list[list[int]] = []
    for step in sorted(set(steps)):
        if out and step - out[-1][-1] - 1 <= merge_gap_steps:
            out[-1].append(step)
        else:
            out.append([step])
    return out


@dataclass(frozen=True)
class Recurrence:
    """A series the report found in a run: its fitted period and the starts it holds."""

    period: float
    starts: tuple[int, ...]


def recurrences(
    anomalies: Iterable[tuple[int, float]],
    merge_gap_steps: int,
    params: PlannerParams | None = None,
) -> list[Recurrence]:
    """The series the planner's rule learns over a whole run from (step, x median) pairs
    that came again where predicted after they formed (three starts alone may line up by
    chance), in order of their first start."""
    params = params or PlannerParams()
    ratios = dict(anomalies)
    learner = SeriesLearner(params)
    members: dict[int, tuple[Series, set[int]]] = {}  # by id; the values keep them alive
    seen: dict[int, float] = {}  # every event start the learner saw, and its ratio
    for episode in episodes_of(ratios, merge_gap_steps):
        strong = [step for step in episode if ratios[step] >= params.min_ratio]
        # strong events as the planner sees them; else a short episode is a weak event
        events = [(event[0], ratios[event[0]]) for event in episodes_of(strong, merge_gap_steps)]
        if not strong and len(episode) < params.lasting_min_steps:
            weak = weak_event([(step, ratios[step]) for step in episode])
            events = [weak] if weak is not None else []
        for start, ratio in events:
            seen[start] = ratio
            learner.expire(start - 1)
            learner.observe(start, ratio)
            for series, starts in learner.joined:
                members.setdefault(id(series), (series, set()))[1].update(starts)
    found = [
        Recurrence(series.period, tuple(sorted(starts)))
        for series, starts in members.values()
        if series.hits and len(starts) >= MIN_OCCURRENCES
    ]
    # one test per series the learner formed over the run (Bonferroni): dense noise
    # forms many, and each is another chance for a coincidence to pass
    limit = CHANCE_P / max(1, len(members))
    found = [r for r in found if beyond_chance(r, seen, params, limit)]
    return sorted(_without_multiples(found, params), key=lambda r: r.starts)


def beyond_chance(
    recurrence: Recurrence,
    events: Mapping[int, float],
    params: PlannerParams,
    limit: float = 0.01,
) -> bool:
    """Whether a recurrence's confirmations are too many for chance: of the predictions
    after the three starts that formed it (one per period up to its last start), it hit
    `h`; the run's other events about as strong as its typical start (as the learner
    reckons alike), spread evenly over the run's events' span, land in a prediction's
    window (the learner's: 2 x tolerance + 1 either side) with probability `p`; the
    chance of `h` or more hits is at most `CHANCE_P`. On a loaded host jitter's
    anomalies are dense, and three of them line up, and a fourth, at many periods."""
    starts = recurrence.starts
    positions = round((starts[-1] - starts[0]) / recurrence.period) + 1
    trials = positions - 3
    hits = min(len(starts), positions) - 3
    if hits <= 0 or trials <= 0:
        return False
    typical = sorted(events.get(s, math.inf) for s in starts)[len(starts) // 2]
    floor = 1.0 + SIMILAR_SHARE * (typical - 1.0) if typical > 1.0 else 1.0
    own = set(starts)
    alike = sum(1 for step, ratio in events.items() if step not in own and ratio >= floor)
    span = max(events) - min(events) + 1 if events else 1
    window = 2 * (2 * params.tolerance_steps + 1) + 1
    # the rate's estimate with half an event more (Jeffreys' for a Poisson count): a
    # run with other events as strong may have more than it shows. With none at all the
    # series is the run's only pattern: 4 evenly spaced stalls are periodic at any period
    # (with the half event, 4 starts under ~150 steps apart read as chance)
    p = min(1.0, (alike + 0.5) * window / max(span, 1)) if alike else 0.0
    return _tail(trials, hits, p) <= limit


def _tail(trials: int, hits: int, p: float) -> float:
    """P(X >= hits) for X binomial(trials, p), summed in logs (no overflow)."""
    if p >= 1.0:
        return 1.0
    if p <= 0.0:
        return 0.0
    total = 0.0
    for k in range(hits, trials + 1):
        log_term = (
            math.lgamma(trials + 1) - math.lgamma(k + 1) - math.lgamma(trials - k + 1)
            + k * math.log(p) + (trials - k) * math.log1p(-p)
        )  # fmt: skip
        total += math.exp(log_term)
    return min(1.0, total)


def _without_multiples(found: list[Recurrence], params: PlannerParams) -> list[Recurrence]:
    """Drop a recurrence whose starts all belong to recurrences with a period dividing
    its own: after a pause the learner forms series at 2, 3, ... times the period from
    the same starts, which the real one explains."""
    tol = 2 * params.tolerance_steps + 1
    kept: list[Recurrence] = []
    for recurrence in sorted(found, key=lambda r: r.period):
        covered: set[int] = set()
        for shorter in kept:
            times = round(recurrence.period / shorter.period)
            if times >= 2 and abs(recurrence.period - times * shorter.period) <= tol:
                covered.update(shorter.starts)
        if not covered.issuperset(recurrence.starts):
            kept.append(recurrence)
    return kept


def classify_steps(
    anomalies: Iterable[tuple[int, float]],
    merge_gap_steps: int,
    params: PlannerParams | None = None,
    found: Iterable[Recurrence] | None = None,
) -> dict[int, str]:
    """Each anomalous step's class (PERIODIC, LASTING or ONE_OFF), from (step, x median)
    pairs, by the planner's rule run over the whole run: an episode holding a start of one
    of the run's `recurrences` (`found`, when the caller has them already) is periodic;
    else one of `lasting_min_steps` or more steps is a lasting slowdown."""
    params = params or PlannerParams()
    ratios = dict(anomalies)
    if found is None:
        found = recurrences(ratios.items(), merge_gap_steps, params)
    periodic = {s for r in found for s in r.starts}
    out: dict[int, str] = {}
    for episode in episodes_of(ratios, merge_gap_steps):
        if periodic.intersection(episode):
            kind = PERIODIC
        elif len(episode) >= params.lasting_min_steps:
            kind = LASTING
        else:
            kind = ONE_OFF
        out.update(dict.fromkeys(episode, kind))
    return out
