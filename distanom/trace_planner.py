"""Where a tracing budget goes beyond the duty cycle: the steps detection predicts slow.

Owns the rule that sorts anomalies into classes (periodic, lasting slowdown, one-off) and
the plan of extra traced steps that follows from it (docs/budget.md):

- Episodes: anomalous steps at most `merge_gap_steps` apart are one episode, as the
  detector groups them. An episode of `lasting_min_steps` or more anomalous steps is a
  lasting slowdown; when none of its steps was traced, the next `episode_steps` steps
  are traced at once (the detector then captures one of them). A window the budget
  declines is asked for again at twice the episode's steps, while the episode lasts.
- Recurrence: strong events are the steps of `min_ratio` medians or more, grouped by
  `merge_gap_steps` like episodes (a slight anomaly just before one does not move its
  start); an episode with no such step, shorter than a lasting slowdown, is a weak
  event, its start (its first step about as strong as its peak) known once it has
  ended. Event starts whose gaps repeat within 2 x `tolerance_steps` (three starts, two
  alike gaps: each start may be off by the tolerance) make a series: three strong
  starts always; a triple with a weak start only while events about as strong as its
  weakest are too rare, lately, to line up by chance (`chance_limit`; near the
  threshold a loaded host's noise is dense enough to, and a delay near 2x the median
  straddles `min_ratio`, so it must not depend on which side each occurrence fell). A
  strong start where a series predicts one is a hit; a weak one only while events as
  strong are too rare to land there by chance. The latest strong starts are kept apart
  from the latest of all, so dense weak noise does not push a long period's starts
  out. Several series are learned at once
  (an evaluation every 200 steps, a checkpoint every 500). Each predicted next start
  gets a window of 2 x tolerance + 1 traced steps (twice as wide while the series'
  starts are few or jitter); the period and phase are fitted to the series' latest
  starts, so jitter does not shift the next window. A series whose recent predictions
  miss at least as often as they hit (and twice or more) is dropped, and so is one whose
  first prediction missed: it was a coincidence, or it ended. Series that have not hit
  yet spend at most the advance and `probation_share` of the rest of the allowance, so
  coincidences cannot starve the proven series, and always leave one episode window's
  worth of the allowance, so they cannot starve a lasting slowdown either.
- Budget: the planned steps are charged to the same budget as the duty cycle, at the
  costs the overhead governor measured (a traced step's extra time, a switch on and
  off). The planner may spend `share` of the budget plus a small advance
  (`advance_step_times`); past that it declines windows until the budget has grown.
  What it spends is taken from the governor's credit, so the duty cycle traces less.

Pure and deterministic: no torch, no clock, no I/O. Every rank feeds it the same judged
steps, the same gathered and host steps and the same measured costs, in the same order,
so every rank plans the same steps. Planned steps start no earlier than `earliest` (the
furthest rank's host step plus a lead), so every rank learns of them before reaching
them. Memory is bounded: the last `kept_starts` event starts (and strong starts) and
`max_series` series.
The same rule run over a whole run, for the report, is `distanom.run_periods`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PlannerParams:
    """Tuning of the plan: tolerance of periods, window sizes, the planner's budget share."""

    tolerance_steps: int = 1  # a start this far from its prediction is traced; half a window
    min_period_steps: int = 8  # shorter gaps are not learned as periods
    max_period_steps: int = 1_000_000
    kept_starts: int = 32  # event starts remembered for learning periods
    min_ratio: float = 2.0  # a step this slow (x median) or slower is a strong event
    # a triple with a weak event makes a series only while the expected number of chance
    # triples at its gap among events about as strong (their rate squared x 2 gaps x the
    # window) is this low; over all gaps, half this many false series per event at most
    chance_limit: float = 0.1
    max_series: int = 8
    recent_outcomes: int = 6  # predictions per series a drop is judged on
    lead_steps: int = 4  # planned steps start this far after the furthest host step
    episode_steps: int = 4  # traced at once when a lasting slowdown went untraced
    # anomalous steps that make an episode a lasting slowdown: two or three side by side
    # come by chance on a loaded host, and each would spend a window of the budget
    lasting_min_steps: int = 4
    share: float = 0.8  # of the budget the planner may spend; the duty cycle keeps the rest
    probation_share: float = 0.25  # of the planner's allowance, for series yet to hit
    advance_step_times: float = 6.0  # spent ahead of the budget, so the first plans happen

    def __post_init__(self) -> None:
        if self.tolerance_steps < 0 or self.min_period_steps < 4 * self.tolerance_steps + 2:
            raise ValueError("tolerance_steps >= 0 and min_period_steps >= 4 x tolerance + 2")
        if self.kept_starts < 3 or self.max_series < 1 or self.recent_outcomes < 2:
            raise ValueError("kept_starts >= 3, max_series >= 1, recent_outcomes >= 2")
        if self.episode_steps < 1 or self.lasting_min_steps < 2 or self.lead_steps < 0:
            raise ValueError("episode_steps >= 1, lasting_min_steps >= 2, lead_steps >= 0")
        if not (0 < self.share <= 1 and 0 < self.probation_share <= 1):
            raise ValueError("share and probation_share in (0, 1]")
        if self.advance_step_times < 0 or self.chance_limit < 0:
            raise ValueError("advance_step_times >= 0 and chance_limit >= 0")


FIT_POINTS = 16  # a series' latest starts its period and phase are fitted to
SIMILAR_SHARE = 0.8  # events this share of a weak triple's excess over x1.0 count as alike
RATE_TAILS = (8, 16)  # the latest kept starts a noise rate is also taken over


@dataclass
class Series:
    """A learned period: starts expected at anchor + k x period (k >= 1), both fitted
    (least squares) to the latest starts, so jitter averages out and drift is followed."""

    period: float
    anchor: float  # the fitted phase at the latest start that matched
    outcomes: collections.deque[bool]  # recent predictions: True hit, False missed
    # (period number, start) of the latest starts, numbered from the first
    points: collections.deque[tuple[int, int]] = field(
        default_factory=lambda: collections.deque(maxlen=FIT_POINTS)
    )
    missed_since_anchor: int = 0  # predictions after the anchor already counted missed
    hits: int = 0  # starts that came where predicted, over the series' life
    residual: float = 0.0  # the largest distance of a fitted start from the fit
    scheduled: int = -1  # the latest predicted start traced for
    declined: int = -1  # the latest predicted start the budget could not serve

    def add(self, index: int, start: int) -> None:
        """A start of period number `index`: fit period and phase again."""
        self.points.append((index, start))
        n = len(self.points)
        mean_i = sum(i for i, _ in self.points) / n
        mean_t = sum(t for _, t in self.points) / n
        spread = sum((i - mean_i) ** 2 for i, _ in self.points)
        if spread > 0:
            self.period = sum((i - mean_i) * (t - mean_t) for i, t in self.points) / spread
        self.anchor = mean_t + (index - mean_i) * self.period
        origin = self.anchor - index * self.period
        self.residual = max(abs(t - origin - i * self.period) for i, t in self.points)

    def half_width(self, tolerance: int) -> int:
        """Steps traced each side of a predicted start (one before it at least), once four
        starts or more are fitted: none when they all lie on the fit (an evaluation every
        N steps: the switches cost more than the steps, so every step saved counts),
        `tolerance` when within a step of it; else (jitter, or few starts) twice that."""
        if len(self.points) >= 4 and self.residual <= 0.25:
            return 0
        if len(self.points) >= 4 and self.residual <= 1.0:
            return tolerance
        return 2 * tolerance

    def predicted_after(self, step: int) -> int:
        """The first predicted start at or after `step`."""
        k = max(1, math.ceil((step - self.anchor) / self.period))
        while round(self.anchor + k * self.period) < step:
            k += 1
        return round(self.anchor + k * self.period)


class SeriesLearner:
    """Periods learned from event starts, fed in step order (`observe`, `expire`)."""

    def __init__(self, params: PlannerParams) -> None:
        self.params = params
        # the latest event starts, and the latest strong ones (weak noise must not push
        # the strong starts of a long period out); each kept start's ratio
        self._starts: collections.deque[int] = collections.deque(maxlen=params.kept_starts)
        self._strong: collections.deque[int] = collections.deque(maxlen=params.kept_starts)
        self._ratios: dict[int, float] = {}
        self.series: list[Series] = []
        # the series the latest start joined or formed, with the starts it gave each
        self.joined: list[tuple[Series, list[int]]] = []

    def observe(self, start: int, ratio: float = math.inf) -> list[int]:
        """Add an event start and its ratio (x median); returns the starts it shows
        periodic (itself, and the two earlier starts of a series it completes), [] if none."""
        tol = 2 * self.params.tolerance_steps
        self._ratios[start] = ratio
        self.joined = []
        periodic: list[int] = []
        matched_periods: list[float] = []
        strong = ratio >= self.params.min_ratio
        for series in self.series:
            k = round((start - series.anchor) / series.period)
            expected = series.anchor + k * series.period
            # one step more than two tolerances: a period learned from three jittered
            # starts is off by up to a step, and the first prediction carries that too
            if (
                k >= 1
                and abs(start - expected) <= tol + 1
                and (strong or self._weak_hits(start, ratio, series))
            ):
                series.add(series.points[-1][0] + k, start)
                series.missed_since_anchor = 0
                series.outcomes.append(True)
                series.hits += 1
                matched_periods.append(series.period)
                self.joined.append((series, [start]))
                periodic = [start]
        # a start an existing series explains makes no new one: with two series, their
        # starts side by side form coincidental triples (200, 400, 500, 600: "every 100")
        known = set(self._starts).union(self._strong)
        for p in sorted(known, reverse=True) if not matched_periods else ():
            gap = start - p
            if gap < self.params.min_period_steps:
                continue
            if gap > self.params.max_period_steps:
                break
            # the earliest start one gap (within the tolerance) before p
            near = range(p - gap - tol, min(p, p - gap + tol + 1))
            q = next((q for q in near if q in known), None)
            if q is None or any(abs(m - gap) <= tol for m in matched_periods):
                continue  # none, or this round already made a series of it
            if any(abs(s.period - gap) <= tol for s in self.series):
                continue  # known (a missed start left the series' phase behind: it resyncs)
            if not self._beyond_chance(q, p, start, gap):
                continue
            period = (start - q) / 2
            outcomes: collections.deque[bool] = collections.deque(
                maxlen=self.params.recent_outcomes
            )
            series = Series(period, float(start), outcomes)
            for index, step in enumerate((q, p, start)):
                series.add(index, step)
            self.series.append(series)
            self.joined.append((series, [q, p, start]))
            matched_periods.append(period)
            periodic = sorted({*periodic, q, p, start})
        if len(self.series) > self.params.max_series:  # keep the best-supported ones
            self.series.sort(key=lambda s: -sum(s.outcomes))
            del self.series[self.params.max_series :]
        self._keep(start, strong)
        return periodic

    def _weak_hits(self, start: int, ratio: float, series: Series) -> bool:
        """Whether a weak event where `series` predicts one counts as a hit: only where
        events as strong (the series' own starts aside) are too rare to land in the
        match window by chance, else a loaded host's noise confirms coincidences."""
        if not ratio > 1.0:  # NaN (no median) is no ratio
            return False
        own = tuple(step for _, step in series.points)
        window = 4 * self.params.tolerance_steps + 3
        return self._alike_rate(start, ratio, own) * window <= self.params.chance_limit

    def _keep(self, start: int, strong: bool) -> None:
        """Remember `start` (its ratio is kept while it is in either deque)."""
        for kept, other in ((self._starts, self._strong), (self._strong, self._starts)):
            if kept is self._strong and not strong:
                continue
            if len(kept) == kept.maxlen and kept[0] not in other:
                del self._ratios[kept[0]]
            kept.append(start)

    def _beyond_chance(self, q: int, p: int, start: int, gap: int) -> bool:
        """Whether starts q, p, start (`gap` apart) are unlikely to line up by chance: all
        strong, or events about as strong as the weakest of them (`_alike_rate`, less q
        and p, whose place is what is in question) are rare enough that a chance triple
        at this gap is not expected."""
        weakest = min(self._ratios[q], self._ratios[p], self._ratios[start])
        if weakest >= self.params.min_ratio:
            return True
        if not weakest > 1.0:  # NaN (no median) is no ratio
            return False
        rate = self._alike_rate(start, weakest, (q, p))
        window = 4 * self.params.tolerance_steps + 1
        return rate * rate * 2 * gap * window <= self.params.chance_limit

    def _alike_rate(self, start: int, ratio: float, left_out: tuple[int, ...]) -> float:
        """Kept events per step about as strong as `ratio` (down to a fifth of the way to
        x1.0, so noise of nearly the same strength counts: a stratum is not picked after
        the fact), `left_out` aside, up to `start`: the highest rate over the latest
        RATE_TAILS kept starts and all of them, so a quiet past does not dilute the noise
        of a host loaded now."""
        floor = 1.0 + SIMILAR_SHARE * (ratio - 1.0)
        starts, ratios = list(self._starts), self._ratios
        best = 0.0
        for tail in (*RATE_TAILS, len(starts)):
            if not 0 < tail <= len(starts):
                continue
            first = len(starts) - tail
            alike = sum(
                1
                for i in range(first, len(starts))
                if ratios[starts[i]] >= floor and starts[i] not in left_out
            )
            best = max(best, alike / (start - starts[first] + 1))
        return best

    def expire(self, through: int) -> None:
        """Count the predictions whose window ended by step `through` with no start as
        misses; drop a series that missed before its first hit, or that misses at least
        as often as it hits, twice or more."""
        tol = self.params.tolerance_steps
        kept = []
        for series in self.series:
            passed = max(0, math.floor((through - 2 * tol - series.anchor) / series.period))
            for _ in range(passed - series.missed_since_anchor):
                series.outcomes.append(False)
            series.missed_since_anchor = max(passed, series.missed_since_anchor)
            misses = sum(1 for hit in series.outcomes if not hit)
            if misses and not series.hits:
                continue  # never hit: three starts lined up by chance
            if misses >= 2 and misses >= len(series.outcomes) - misses:
                continue
            kept.append(series)
        self.series = kept


def weak_event(ratios: Sequence[tuple[int, float]]) -> tuple[int, float] | None:
    """A weak event's start and ratio from its episode's (step, x median) pairs: its peak
    (NaN, infinite and x1.0 or less are no ratio) and its first step about as strong (as
    `SeriesLearner` reckons alike), so a slighter anomaly just before it does not move
    it; None when no step has a ratio. The planner and the report's replay both use it."""
    peak = max((ratio for _, ratio in ratios if 1.0 < ratio < math.inf), default=0.0)
    if not peak:
        return None
    floor = 1.0 + SIMILAR_SHARE * (peak - 1.0)
    return next(step for step, ratio in ratios if ratio >= floor), peak


@dataclass(frozen=True)
class Costs:
    """What tracing costs, in step times: a traced step's extra time, switching on and
    off once, and one traced window of the duty cycle (the governor's unit of credit)."""

    traced_step: float
    switch: float
    window: float

    def tracing(self, steps: int, *, switches: bool = True) -> float:
        """Step times that tracing `steps` steps costs, with a pair of switches or not."""
        return steps * self.traced_step + (self.switch if switches and steps else 0.0)

    def in_windows(self, step_times: float) -> float:
        """`step_times` as traced windows' worth of the governor's credit."""
        return step_times / self.window if self.window > 0 else 0.0


# Before the governor has measured anything: a traced step +25%, a switch pair a step and a
# half (CUPTI's ~13 ms on a ~10 ms launch-bound step): pessimistic, so early plans are few.
DEFAULT_SWITCH_ON, DEFAULT_SWITCH_OFF = 1.0, 0.5
DEFAULT_COSTS = Costs(0.25, DEFAULT_SWITCH_ON + DEFAULT_SWITCH_OFF, window=16 * 0.25)


@dataclass(frozen=True)
class Plan:
    """Steps to trace (sorted) and their cost, in the governor's traced windows."""

    steps: tuple[int, ...] = ()
    charge_windows: float = 0.0


@dataclass
class PlannerCounts:
    """What the planner did over the run (for status.json)."""

    series_learned: int = 0
    periodic_windows: int = 0
    episode_windows: int = 0
    steps_planned: int = 0
    declined: int = 0  # windows the budget could not pay for (a slowdown's once)
    spent_step_times: float = 0.0
    probation_step_times: float = 0.0  # of which on series yet to hit


@dataclass(frozen=True)
class _Wanted:
    """A window the planner would trace: its steps, and the series and predicted start
    it is for (none for a lasting slowdown)."""

    steps: list[int]
    series: Series | None = None
    start: int = -1
    episode: _Episode | None = None  # the lasting slowdown it is for


@dataclass
class _Episode:
    first: int
    last: int
    steps: int = 1
    traced: bool = False
    predicted: bool = False  # a series predicted its start: that window is the series'
    asked: bool = False
    # declined: asked again once it has this many steps (twice as many as then): a
    # lasting slowdown goes on until the budget has grown; a loaded host's noise episodes
    # of a few steps end first, and take nothing more
    ask_again_at: int = 0  # 0: never declined
    strong: bool = False  # holds a strong event (observed as it came)
    ended: bool = False
    ratios: list[tuple[int, float]] = field(default_factory=list)  # of its first steps


@dataclass
class TracePlanner:
    """Plans traced steps around predicted anomalies within a share of the budget."""

    budget_pct: float
    merge_gap_steps: int
    params: PlannerParams = field(default_factory=PlannerParams)
    counts: PlannerCounts = field(default_factory=PlannerCounts)

    def __post_init__(self) -> None:
        if not self.budget_pct > 0 or self.merge_gap_steps < 0:
            raise ValueError("budget_pct > 0 and merge_gap_steps >= 0")
        self.learner = SeriesLearner(self.params)
        self._episode: _Episode | None = None
        self._strong_last: int | None = None  # the latest step of min_ratio or more
        self._planned: set[int] = set()  # planned steps not yet passed

    def plan(
        self,
        judged: Iterable[tuple[int, bool, float]],
        through: int,
        furthest_host: int,
        recorded_steps: int,
        costs: Callable[[], Costs],
    ) -> Plan:
        """One round: the anomalous steps judged in it ((step, traced, x median), in order), the
        last judged step, the furthest rank's host step, the steps recorded so far (the
        budget grows with them) and the measured costs (asked only when a window is
        planned). Returns the steps to trace from now on and their charge."""
        earliest = max(through, furthest_host) + 1 + self.params.lead_steps
        self._planned = {s for s in self._planned if s >= earliest}
        wanted: list[_Wanted] = []
        for step, traced, ratio in judged:
            episode = self._episode
            if episode is None or step - episode.last - 1 > self.merge_gap_steps:
                if episode is not None:
                    self._end(episode)
                episode = self._episode = _Episode(step, step)
            else:
                episode.steps += 1
                episode.last = step
            episode.traced = episode.traced or traced
            if len(episode.ratios) < self.params.lasting_min_steps:
                episode.ratios.append((step, ratio))
            if ratio >= self.params.min_ratio:
                episode.strong = True
                strong = self._strong_last
                self._strong_last = step
                if strong is None or step - strong - 1 > self.merge_gap_steps:
                    episode.predicted |= self._observe(step, ratio)
            if episode.steps >= max(self.params.lasting_min_steps, episode.ask_again_at) and not (
                episode.traced or episode.predicted or episode.asked
            ):
                episode.asked = True  # served, or declined and asked again (`_decline`)
                span = range(earliest, earliest + self.params.episode_steps)
                wanted.append(_Wanted(list(span), episode=episode))
        episode = self._episode
        if episode is not None and through - episode.last - 1 > self.merge_gap_steps:
            self._end(episode)
        # a weak event is observed when it ends: until then its start may still be a hit
        # that a prediction's window has passed (not past `lasting_min_steps`: no event)
        if episode is not None and not episode.ended and self._weak_event(episode):
            self.learner.expire(min(through, episode.first - 1))
        else:
            self.learner.expire(through)
        # the budget goes to the best-proven series first
        for series in sorted(self.learner.series, key=lambda s: -s.hits):
            tol = series.half_width(self.params.tolerance_steps)
            # the first traced step carries the switch (judged as after a flush, by a
            # wider margin): a predicted start is never a window's first step
            start = series.predicted_after(earliest + 1)
            if start <= series.scheduled:
                continue
            if not series.hits and series.scheduled >= 0:
                continue  # a series yet to hit waits for its first prediction's outcome
            steps = list(range(max(start - max(1, tol), earliest), start + tol + 1))
            wanted.append(_Wanted(steps, series, start))
        if not wanted or self.counts.spent_step_times >= self._allowance(recorded_steps):
            if wanted:  # nothing affordable: the costs are not even asked for
                self._decline(wanted)
            return Plan()
        return self._afford(wanted, recorded_steps, costs())

    def _observe(self, start: int, ratio: float) -> bool:
        """Feed an event start to the learner; whether a series predicted it (a window
        was planned for it, or declined). A start that only completes a new series was
        predicted by nothing: its episode still gets its own window (on a loaded host
        two noise spikes and a real slowdown's start can line up). Predictions whose
        window ended before it are counted first, as `run_periods` does, so what is
        learned does not depend on how steps fall into rounds."""
        self.learner.expire(start - 1)
        before = len(self.learner.series)
        self.learner.observe(start, ratio)
        self.counts.series_learned += max(0, len(self.learner.series) - before)
        return any(starts == [start] for _, starts in self.learner.joined)

    def _weak_event(self, episode: _Episode) -> tuple[int, float] | None:
        """`episode` as a weak event (or, not ended yet, as one so far): no strong step,
        shorter than a lasting slowdown, a step with a ratio (`weak_event`)."""
        if episode.strong or episode.steps >= self.params.lasting_min_steps:
            return None
        return weak_event(episode.ratios)

    def _end(self, episode: _Episode) -> None:
        """An episode ended: a weak event is observed now."""
        if not episode.ended:
            episode.ended = True
            event = self._weak_event(episode)
            if event is not None:
                episode.predicted |= self._observe(*event)

    def _allowance(self, recorded_steps: int) -> float:
        """What the planner may have spent by now, in step times."""
        share = self.params.share * self.budget_pct / 100.0
        return share * recorded_steps + self.params.advance_step_times

    def _decline(self, wanted: Sequence[_Wanted]) -> None:
        for want in wanted:
            episode = want.episode
            if episode is not None:
                declined_before = episode.ask_again_at > 0
                episode.asked = False
                episode.ask_again_at = 2 * episode.steps
                if declined_before:
                    continue  # counted once per episode
            series = want.series
            if series is None or series.declined != want.start:
                self.counts.declined += 1  # once per window
            if series is not None:
                series.declined = want.start

    def _afford(
        self,
        wanted: Sequence[_Wanted],
        recorded_steps: int,
        costs: Costs,
    ) -> Plan:
        allowance = self._allowance(recorded_steps)
        # the advance stays open to a new series: its first window is the 4th start
        advance = self.params.advance_step_times
        probation = self.params.probation_share * (allowance - advance) + advance
        # a series yet to hit is a guess (on a loaded host, often a coincidence); a
        # lasting slowdown is happening: guesses leave one episode window's worth unspent
        reserve = costs.tracing(self.params.episode_steps)
        chosen: list[int] = []
        spent = 0.0
        for want in wanted:
            series = want.series
            new = [s for s in want.steps if s not in self._planned]
            adjacent = any(s - 1 in self._planned or s + 1 in self._planned for s in new)
            cost = costs.tracing(len(new), switches=not adjacent)
            unproven = series is not None and not series.hits
            total = self.counts.spent_step_times + spent + cost
            if total > allowance or (
                unproven
                and (
                    self.counts.probation_step_times + cost > probation
                    or total + reserve > allowance
                )
            ):
                self._decline([want])
                continue
            if unproven:
                self.counts.probation_step_times += cost
            spent += cost
            chosen += new
            self._planned.update(new)
            if series is not None:
                series.scheduled = want.start
                self.counts.periodic_windows += 1
            else:
                self.counts.episode_windows += 1
        self.counts.spent_step_times += spent
        self.counts.steps_planned += len(set(chosen))
        return Plan(tuple(sorted(set(chosen))), costs.in_windows(spent))

    def summary(self) -> dict[str, float | int]:
        """JSON-ready counts, for the status file."""
        out: dict[str, float | int] = dict(vars(self.counts))
        out["spent_step_times"] = round(self.counts.spent_step_times, 3)
        out["probation_step_times"] = round(self.counts.probation_step_times, 3)
        out["series"] = len(self.learner.series)
        return out
