"""A rolling window of step times whose median costs O(1) to read.

The detector reads a window's median at every step on the control thread (holding the
GIL a launch-bound training thread needs): `statistics.median` sorts the whole window
each time, this keeps it sorted as values come and go (`bisect`, O(window) memory moves
in C per append). Used by `distanom.detect`; nothing else.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Iterator


class RollingWindow:
    """The last `maxlen` finite values, in arrival order and sorted."""

    def __init__(self, maxlen: int) -> None:
        self._order: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []
        self.maxlen = maxlen

    def append(self, value: float) -> None:
        """Add a value (non-finite ones are ignored), dropping the oldest when full."""
        if not math.isfinite(value):
            return
        if len(self._order) >= self.maxlen:
            oldest = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._order.append(value)
        bisect.insort(self._sorted, value)

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

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[float]:
        return iter(self._order)
