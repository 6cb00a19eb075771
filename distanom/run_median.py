"""The median of every step time this rank has had since the run began, the base of the
own-cost percentage (`own_time.own_cost_body`, status.json's `agent_cost`).

The per-step figures it divides are averages over the whole run, so the step they are
a share of is the whole run's too. The detector's median is its window's, the last few
hundred steps, and step times drift over a run: in session 26's on/off jobs on the
H200 (docs/measurements.md) the detector's median at the end read 2.9 and 5.5 ms where
the run's steps took a median 2.7 and 4.3 ms, so the cost read 8-30% low. Kept as counts in
bins 0.5% wide on a log scale: O(1) per step, a few thousand bins at most, the median
within 0.25%. Fed a round's durations at a time by the control thread.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

BIN_RATIO = 1.005  # one bin's upper edge over its lower: the median within 0.25%
MAX_STEP_MS = 1e12  # 31 years: a longer duration is no step's (and would overflow a bin)
_PER_LOG = 1.0 / math.log(BIN_RATIO)


class RunMedian:
    """Step times (ms) counted in log-spaced bins; `median_ms` reads the median back."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self.steps = 0

    def add_many(self, durations_ms: Iterable[float]) -> None:
        """Count each finite, positive duration (others are steps nobody could time)."""
        counts, log, per_log = self._counts, math.log, _PER_LOG
        added = 0
        for ms in durations_ms:
            if 0.0 < ms < MAX_STEP_MS:  # NaN compares false; a longer step is damage
                key = math.floor(log(ms) * per_log)
                counts[key] = counts.get(key, 0) + 1
                added += 1
        self.steps += added

    def median_ms(self) -> float | None:
        """The median step time so far (a bin's geometric middle), None before any."""
        if not self.steps:
            return None
        half = self.steps / 2
        seen = 0
        for key in sorted(self._counts):
            seen += self._counts[key]
            if seen >= half:
                return float(BIN_RATIO ** (key + 0.5))
        return None  # not reached: the counts sum to `steps`
