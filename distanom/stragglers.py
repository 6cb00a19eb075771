"""Persistent stragglers and drift, scored from every rank's collective arrival. Pure.

Rank 0's control thread feeds `StragglerScorer.add` one step at a time, with every
rank's arrival (`StepEvidence.arrive_ms`: when the rank enqueued the step's last
collective, after the step began on that rank) and the step's time. In synchronous
training every rank waits in that collective for the last one to arrive, so the last
rank's lead over the second last (`margin`) is time the whole job waited for it.

- A rank's score is the share of step time the job waited for it: summed margins over
  summed step times, over the run and over the last `window` steps.
- A straggler is a rank that was last in at least `LATE_FRACTION` of the window's
  steps and whose window score is at least `MIN_SCORE`: consistently late, by enough
  to matter. `since_step` is where its current late streak began (the change point
  of its lateness in the window when it was first named); most severe first.
- Drift: the median step time of the last `window` steps against the first `window`
  steps measured; reported from `DRIFT_RATIO` up (a whole job slowing down, which
  moves the detector's median with it and so is never anomalous).

State is O(world + window); each `add` is O(world + window).
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

LATE_FRACTION = 0.6
MIN_SCORE = 0.05
DRIFT_RATIO = 1.2
DEFAULT_WINDOW = 64
MIN_WINDOW_STEPS = 8  # steps the window must hold before anyone is named


@dataclass(frozen=True)
class Straggler:
    """A rank the others keep waiting for."""

    rank: int
    score: float  # share of step time the job waited for it (rolling window)
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
    _run_wait_ms: list[float] = field(init=False)
    _run_late: list[int] = field(init=False)
    _run_ms: float = 0.0
    _recent: collections.deque[tuple[int, int, float, float]] = field(init=False)
    _since: dict[int, int] = field(default_factory=dict)
    _first_ms: list[float] = field(default_factory=list)
    _last_ms: collections.deque[float] = field(init=False)
    _first_step: int = -1

    def __post_init__(self) -> None:
        self._run_wait_ms = [0.0] * self.world_size
        self._run_late = [0] * self.world_size
        self._recent = collections.deque(maxlen=self.window)  # (step, last rank, margin, ms)
        self._last_ms = collections.deque(maxlen=self.window)

    def add(self, step: int, arrive_ms: Sequence[float], step_ms: float) -> None:
        """Fold one step in: every rank's arrival (NaN unknown) and the step's time."""
        if not math.isfinite(step_ms) or step_ms <= 0:
            return
        self.steps += 1
        if self._first_step < 0:
            self._first_step = step
        if len(self._first_ms) < self.window:
            self._first_ms.append(step_ms)
        self._last_ms.append(step_ms)
        arrivals = [(a, r) for r, a in enumerate(arrive_ms) if math.isfinite(a)]
        if len(arrivals) < 2:
            self._recent.append((step, -1, 0.0, step_ms))
            return
        arrivals.sort()
        (second, _), (last, rank) = arrivals[-2], arrivals[-1]
        margin = min(last - second, step_ms)
        self._run_ms += step_ms
        self._run_wait_ms[rank] += margin
        self._run_late[rank] += 1
        self._recent.append((step, rank, margin, step_ms))
        self._update_since()

    def _window_stats(self) -> tuple[dict[int, tuple[int, float]], float, int]:
        per_rank: dict[int, tuple[int, float]] = {}
        total_ms, counted = 0.0, 0
        for _, rank, margin, ms in self._recent:
            if rank < 0:
                continue
            counted += 1
            total_ms += ms
            late, waited = per_rank.get(rank, (0, 0.0))
            per_rank[rank] = (late + 1, waited + margin)
        return per_rank, total_ms, counted

    def _flagged(self) -> dict[int, tuple[int, float, float]]:
        """rank -> (late steps, waited ms, score) for ranks that are stragglers now."""
        per_rank, total_ms, counted = self._window_stats()
        out: dict[int, tuple[int, float, float]] = {}
        if counted < MIN_WINDOW_STEPS or total_ms <= 0:
            return out
        for rank, (late, waited) in per_rank.items():
            score = waited / total_ms
            if late >= LATE_FRACTION * counted and score >= MIN_SCORE:
                out[rank] = (late, waited, score)
        return out

    def _update_since(self) -> None:
        flagged = self._flagged()
        for rank in list(self._since):
            if rank not in flagged:
                del self._since[rank]
        for rank in flagged:
            if rank not in self._since:
                self._since[rank] = self._streak_start(rank)

    def _streak_start(self, rank: int) -> int:
        """Where the rank's late streak began: the window step (one it was late at) that
        maximises the sum, over the steps from it on, of (late ? 1 : 0) - LATE_FRACTION."""
        total, best, start = 0.0, -math.inf, -1
        for step, last_rank, _, _ in reversed(self._recent):
            if last_rank < 0:
                continue
            total += (1.0 if last_rank == rank else 0.0) - LATE_FRACTION
            if last_rank == rank and total >= best:
                best, start = total, step
        return start

    def stragglers(self) -> list[Straggler]:
        """The ranks consistently late now, most severe first."""
        flagged = self._flagged()
        counted = sum(1 for entry in self._recent if entry[1] >= 0)
        out = []
        for rank, (late, waited, score) in flagged.items():
            run_score = self._run_wait_ms[rank] / self._run_ms if self._run_ms > 0 else 0.0
            evidence = {
                "late_steps": late,
                "window_steps": counted,
                "mean_wait_ms": round(waited / late, 3) if late else 0.0,
                "run_score": round(run_score, 4),
                "run_late_steps": self._run_late[rank],
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
            "scored_steps": self.steps,
        }
