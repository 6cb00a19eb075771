"""The trace planner's rule run over a whole run, for the report: which recorded anomalies
recur and with what period, and the class of each (periodic, lasting slowdown, one-off).

Fed the (step, x median) pairs of anomalies.jsonl by `distanom.analysis.anomalies`; the
same `SeriesLearner` and `PlannerParams` as the planner (`distanom.trace_planner`), fed
the same events in step order (docs/budget.md, "What the report counts"). Pure: no
torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from distanom.trace_planner import PlannerParams, Series, SeriesLearner, weak_event

PERIODIC = "periodic"
LASTING = "lasting_slowdown"
ONE_OFF = "one_off"
CLASSES = (PERIODIC, LASTING, ONE_OFF)  # in the order the report lists them
# as a reader of the report names them
CLASS_LABELS = {PERIODIC: "periodic", LASTING: "lasting slowdown", ONE_OFF: "one-off"}


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
    for episode in episodes_of(ratios, merge_gap_steps):
        strong = [step for step in episode if ratios[step] >= params.min_ratio]
        # strong events as the planner sees them; else a short episode is a weak event
        events = [(event[0], ratios[event[0]]) for event in episodes_of(strong, merge_gap_steps)]
        if not strong and len(episode) < params.lasting_min_steps:
            weak = weak_event([(step, ratios[step]) for step in episode])
            events = [weak] if weak is not None else []
        for start, ratio in events:
            learner.expire(start - 1)
            learner.observe(start, ratio)
            for series, starts in learner.joined:
                members.setdefault(id(series), (series, set()))[1].update(starts)
    found = [
        Recurrence(series.period, tuple(sorted(starts)))
        for series, starts in members.values()
        if series.hits
    ]
    return sorted(_without_multiples(found, params), key=lambda r: r.starts)


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
