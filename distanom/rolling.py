"""A rolling window of step times whose median costs O(1) to read, and its spread (the
median absolute deviation) at most every `SPREAD_EVERY` appends.

The detector reads a window's median at every step on the control thread (holding the
GIL a launch-bound training thread needs): `statistics.median` sorts the whole window
each time, this keeps it sorted as values come and go (`bisect`, O(window) memory moves
in C per append). The spread is read off the sorted values in O(log window) steps
(`kth_deviation`): sorting the deviations took ~22 us a time for 200 values, the
detector's largest part. Used by `distanom.detect`; nothing else.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Iterator

SPREAD_EVERY = 8  # appends between two computations of the spread


class RollingWindow:
    """The last `maxlen` finite values, in arrival order and sorted."""

    def __init__(self, maxlen: int) -> None:
        self._order: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []
        self.maxlen = maxlen
        self._appended = 0
        self._spread: float | None = None
        self._spread_at = 0

    def append(self, value: float) -> None:
        """Add a value (non-finite ones are ignored), dropping the oldest when full."""
        if not math.isfinite(value):
            return
        if len(self._order) >= self.maxlen:
            oldest = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._order.append(value)
        bisect.insort(self._sorted, value)
        self._appended += 1

    def median(self) -> float:
        """The median (the mean of the two middle values for an even count), as
        `statistics.median`; ValueError when empty."""
        values = self._sorted
        n = len(values)
        if not n:
            raise ValueError("no values")
        middle = n // 2
        if n % 2:
            return values[middle]
        return (values[middle - 1] + values[middle]) / 2

    def spread(self) -> float:
        """The median absolute deviation from the median, recomputed every
        `SPREAD_EVERY` appends (O(log window) each time, `kth_deviation`; a step's worth
        of drift in between does not matter to a fence); ValueError when empty."""
        if self._spread is None or self._appended - self._spread_at >= SPREAD_EVERY:
            values = self._sorted
            middle = self.median()
            n = len(values)
            half = n // 2
            if n % 2:
                self._spread = kth_deviation(values, middle, half)
            else:
                low = kth_deviation(values, middle, half - 1)
                self._spread = (low + kth_deviation(values, middle, half)) / 2
            self._spread_at = self._appended
        return self._spread

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[float]:
        return iter(self._order)


def kth_deviation(values: list[float], middle: float, k: int) -> float:
    """The k-th smallest (from 0) of |v - middle| over sorted `values`, without sorting
    them: the deviations below `middle`, read from it outwards, and those from it
    upwards are two ascending runs; a binary search finds how many of the k + 1 smallest
    come from the lower run. Equal to `sorted(abs(v - middle) for v in values)[k]`."""
    split = bisect.bisect_left(values, middle)  # values[:split] < middle <= values[split:]
    below, above = split, len(values) - split
    lo, hi = max(0, k + 1 - above), min(k + 1, below)
    while lo < hi:  # taking i from below and k + 1 - i from above
        i = (lo + hi) // 2
        if middle - values[split - 1 - i] < values[split + k - i] - middle:
            lo = i + 1  # the lower run's next is smaller than the upper run's last taken
        else:
            hi = i
    taken_below, taken_above = lo, k + 1 - lo
    last = middle - values[split - taken_below] if taken_below else -math.inf
    if taken_above:
        last = max(last, values[split + taken_above - 1] - middle)
    return last
