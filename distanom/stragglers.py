"""Persistent stragglers and drift, scored from every rank's collective arrival. Pure.

Rank 0's control thread feeds `StragglerScorer.add` one step at a time, with every
rank's arrival (`StepEvidence.arrive_ms`: when the rank enqueued the step's last
collective, after the step began on that rank) and the step's time. In synchronous
training the ranks wait in that collective for the last to arrive, so a rank's arrival
after the median rank's (`late`; the lower median) is time the typical rank waited for it. Measured
against the median, several slow ranks (a slow node) are each seen, not just the last.

- A rank is late at a step when `late` is at least `LATE_SHARE` of the step's time.
- A rank's score is the share of step time the typical rank waited for it over the last
  `window` steps: the median over those steps of its `late` as a share of the step (0 at
  a step it was not late), so one stall, however long, moves it by one step's place at
  most. Its run score is the mean over the run: summed `late` over summed step times.
- A straggler was late at `LATE_FRACTION` or more of the window's steps (once it holds
  half a window of steps at least), with a score of at least `MIN_SCORE` and at least
  `SPREAD_LEAD` robust standard deviations of the window's step time (1.4826 x its
  median absolute deviation, as a share of its median): consistently late, by enough to
  matter and by more than the host's jitter (on a loaded host some rank is a little
  late at most steps). `since_step` is where its late streak began (the change point of
  how late it was, in the window when it was first named). Most severe (highest score)
  first.
- A rank that stops being a straggler is kept in `earlier` (since, until, its highest
  window score), the last `EARLIER_KEPT`: the job's log named it, and the report must
  say so after it caught up. Named again within a window, it continues that entry.
- Drift: the median step time of the last `window` steps against the first `window`
  steps measured; reported from `DRIFT_RATIO` up (a whole job slowing down moves the
  detector's median with it, so no single step is anomalous).

State is O(world + window x late ranks); `add` is O(world log world) (one median);
`add_late`, for a caller that found the late ranks itself, O(late ranks + window), and
O(window log window) more per rank late at `LATE_FRACTION` of the window (the medians).
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

LATE_FRACTION = 0.6
LATE_SHARE = 0.05
MIN_SCORE = 0.05
# a straggler's score is at least this many robust standard deviations of the window's
# step time (relative to its median): a lead the jitter does not make
SPREAD_LEAD = 2.0
MAD_TO_SIGMA = 1.4826
WINSOR_QUANTILE = 0.9  # a share above this quantile of the window's counts as at it
DRIFT_RATIO = 1.2
DEFAULT_WINDOW = 64
# steps the window must hold before anyone is named: this many, and half the window.
# A job's first ~10-15 steps skew the ranks (start-up, allocation, first collectives):
# over 8 steps that named a rank in every 2-core demo run, which later kept up.
MIN_WINDOW_STEPS = 8
EARLIER_KEPT = 16  # stragglers that caught up, kept for the report


@dataclass(frozen=True)
class Straggler:
    """A rank the others keep waiting for."""

    rank: int
    score: float  # share of step time the typical rank waited for it (rolling window)
    since_step: int
    evidence: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "rank": self.rank,
            "score": round(self.score, 4),
            "since_step": self.since_step,
            "evidence": self.evidence,
        }


@dataclass
class StragglerScorer:
    """Run and rolling-window straggler scores (see the module docstring)."""

    world_size: int
    window: int = DEFAULT_WINDOW
    steps: int = 0
    _run_late_ms: dict[int, float] = field(default_factory=dict)
    _run_late_steps: dict[int, int] = field(default_factory=dict)
    _run_ms: float = 0.0
    # (step, step ms, ((rank, late ms), ...) of the ranks late at it)
    _recent: collections.deque[tuple[int, float, tuple[tuple[int, float], ...]]] = field(init=False)
    _window_late_ms: dict[int, float] = field(default_factory=dict)
    _window_late_steps: dict[int, int] = field(default_factory=dict)
    # per late rank, its late shares of the step in the window, oldest first
    _window_shares: dict[int, collections.deque[float]] = field(default_factory=dict)
    _window_ms: float = 0.0
    _since: dict[int, int] = field(default_factory=dict)
    # while named: rank -> (the latest step it was named at, its highest window score)
    _named: dict[int, tuple[int, float]] = field(default_factory=dict)
    _earlier: collections.deque[dict[str, Any]] = field(init=False)
    _first_ms: list[float] = field(default_factory=list)
    _last_ms: collections.deque[float] = field(init=False)
    _first_step: int = -1

    def __post_init__(self) -> None:
        self._recent = collections.deque()
        self._last_ms = collections.deque(maxlen=self.window)
        self._earlier = collections.deque(maxlen=EARLIER_KEPT)

    def add(self, step: int, arrive_ms: Sequence[float], step_ms: float) -> None:
        """Fold one step in: every rank's arrival (NaN unknown) and the step's time."""
        finite = [a for a in arrive_ms if math.isfinite(a)]
        late: tuple[tuple[int, float], ...] | None = None
        if len(finite) >= 2 and math.isfinite(step_ms):
            typical = statistics.median_low(finite)
            floor = LATE_SHARE * step_ms
            late = tuple(
                (rank, min(a - typical, step_ms))
                for rank, a in enumerate(arrive_ms)
                if math.isfinite(a) and a - typical >= floor
            )
        self.add_late(step, late, step_ms)

    def add_late(
        self, step: int, late: tuple[tuple[int, float], ...] | None, step_ms: float
    ) -> None:
        """Fold one step in as the ranks late at it: (rank, ms after the median rank) for
        those at least `LATE_SHARE` of `step_ms` late (None: arrival unknown)."""
        if not math.isfinite(step_ms) or step_ms <= 0:
            return
        self.steps += 1
        if self._first_step < 0:
            self._first_step = step
        if len(self._first_ms) < self.window:
            self._first_ms.append(step_ms)
        self._last_ms.append(step_ms)
        if late is None:
            return
        self._run_ms += step_ms
        for rank, ms in late:
            self._run_late_ms[rank] = self._run_late_ms.get(rank, 0.0) + ms
            self._run_late_steps[rank] = self._run_late_steps.get(rank, 0) + 1
        self._push((step, step_ms, late))
        self._update_since(step)

    def _push(self, entry: tuple[int, float, tuple[tuple[int, float], ...]]) -> None:
        self._recent.append(entry)
        self._window_ms += entry[1]
        for rank, ms in entry[2]:
            self._window_late_ms[rank] = self._window_late_ms.get(rank, 0.0) + ms
            self._window_late_steps[rank] = self._window_late_steps.get(rank, 0) + 1
            shares = self._window_shares.setdefault(rank, collections.deque())
            shares.append(min(1.0, ms / entry[1]))
        if len(self._recent) > self.window:
            _, old_ms, old_late = self._recent.popleft()
            self._window_ms -= old_ms
            for rank, ms in old_late:
                self._window_late_ms[rank] -= ms
                self._window_late_steps[rank] -= 1
                self._window_shares[rank].popleft()
                if self._window_late_steps[rank] <= 0:
                    del self._window_late_steps[rank], self._window_late_ms[rank]
                    del self._window_shares[rank]

    def _flagged(self) -> dict[int, tuple[int, float, float]]:
        """rank -> (late steps, late ms, score) for the ranks that are stragglers now."""
        counted = len(self._recent)
        out: dict[int, tuple[int, float, float]] = {}
        if counted < max(MIN_WINDOW_STEPS, self.window // 2) or self._window_ms <= 0:
            return out
        floor: float | None = None  # the jitter's bar, measured once a rank may pass it
        for rank, late in self._window_late_steps.items():
            if late < LATE_FRACTION * counted:
                continue
            score = self.window_score(rank)
            if score < MIN_SCORE:
                continue
            if floor is None:
                floor = SPREAD_LEAD * self.step_spread()
            if score >= floor:
                out[rank] = (late, self._window_late_ms[rank], score)
        return out

    def step_spread(self) -> float:
        """The window's step time jitter: 1.4826 x the median absolute deviation of its
        step times, as a share of their median (0 for an empty window). Robust while
        under half the window is slow, so a straggler's own slow steps, once they are
        most of the window (as when it is named), set its median, not its spread."""
        times = [step_ms for _, step_ms, _ in self._recent]
        if not times:
            return 0.0
        median = statistics.median(times)
        if median <= 0:
            return 0.0
        mad = statistics.median(abs(t - median) for t in times)
        return MAD_TO_SIGMA * mad / median

    def _update_since(self, step: int) -> None:
        flagged = self._flagged()
        for rank in list(self._since):
            if rank not in flagged:
                until, peak = self._named.pop(rank, (step, 0.0))
                self._earlier.append(
                    {
                        "rank": rank,
                        "since_step": self._since.pop(rank),
                        "until_step": until,
                        "peak_score": round(peak, 4),
                    }
                )
        for rank, (_, _, score) in flagged.items():
            if rank not in self._since:
                self._since[rank] = self._streak_start(rank)
                self._resume(rank, step)
            self._named[rank] = (step, max(score, self._named.get(rank, (step, 0.0))[1]))

    def _resume(self, rank: int, step: int) -> None:
        """A rank named again within a window of when it was last dropped continues that
        entry of `earlier` (its start and peak): a rank late at about `LATE_FRACTION` of
        the steps crosses the line again and again, and is one straggler, not many."""
        last = next((e for e in reversed(self._earlier) if e["rank"] == rank), None)
        if last is None or step - last["until_step"] > self.window:
            return
        self._earlier.remove(last)
        self._since[rank] = min(self._since[rank], last["since_step"])
        self._named[rank] = (step, last["peak_score"])

    def _streak_start(self, rank: int) -> int:
        """Where the rank's late streak began: the window step (one it was late at) that
        maximises the sum, over the steps from it on, of its lateness (share of the step)
        less half its mean lateness over the window. Weighing by how late, not whether:
        a loaded host makes every rank late by a little at many steps, and counted alike
        those moved the start of a real straggler's streak back by tens of steps. Each
        step's share is capped at the window's 90th percentile of them (winsorized), so a
        stall or two before the streak weigh as its typical late steps, not as tens."""
        shares = [
            (step, sum(ms for r, ms in late if r == rank) / step_ms)
            for step, step_ms, late in self._recent
        ]
        ordered = sorted(share for _, share in shares)
        cap = ordered[int(WINSOR_QUANTILE * (len(ordered) - 1))] if ordered else 0.0
        shares = [(step, min(share, cap)) for step, share in shares]
        half_level = 0.5 * sum(share for _, share in shares) / max(1, len(shares))
        total, best, start = 0.0, -math.inf, -1
        for step, share in reversed(shares):
            total += share - half_level
            if share > 0 and total >= best:
                best, start = total, step
        return start

    def window_score(self, rank: int) -> float:
        """The rank's score over the rolling window: the median over its steps of the
        rank's late share of the step, 0 at a step it was not late (0 when it was never
        late there). One step moves a median by one place: a single stall cannot make it."""
        shares = self._window_shares.get(rank)
        counted = len(self._recent)
        if not shares or counted == 0:
            return 0.0
        return statistics.median([0.0] * (counted - len(shares)) + list(shares))

    def stragglers(self) -> list[Straggler]:
        """The ranks consistently late now, most severe first."""
        out = []
        for rank, (late, waited, score) in self._flagged().items():
            run_score = self._run_late_ms.get(rank, 0.0) / self._run_ms if self._run_ms else 0.0
            evidence = {
                "late_steps": late,
                "window_steps": len(self._recent),
                "mean_late_ms": round(waited / late, 3) if late else 0.0,
                "run_score": round(run_score, 4),
                "run_late_steps": self._run_late_steps.get(rank, 0),
            }
            out.append(Straggler(rank, score, self._since.get(rank, -1), evidence))
        return sorted(out, key=lambda s: (-s.score, s.rank))

    def drift(self) -> dict[str, Any] | None:
        """The job's slowdown from its first to its last window of steps (None below
        `DRIFT_RATIO`, or before two windows were measured)."""
        if self.steps < 2 * self.window or not self._first_ms:
            return None
        first = statistics.median(self._first_ms)
        last = statistics.median(self._last_ms)
        if first <= 0 or last / first < DRIFT_RATIO:
            return None
        return {
            "first_ms": round(first, 3),
            "last_ms": round(last, 3),
            "ratio": round(last / first, 3),
            "window_steps": self.window,
            "from_step": self._first_step,
        }

    def to_json(self) -> dict[str, Any]:
        """The body of stragglers.json / the status field."""
        return {
            "stragglers": [s.to_json() for s in self.stragglers()],
            "drift": self.drift(),
            "earlier": list(self._earlier),
            "scored_steps": self.steps,
        }
