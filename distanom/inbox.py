"""The hand-over of ended steps from the training thread to the control thread.

The training thread appends a `StepRecord` per ended step (and `boundary.FINAL` at the
end); the control thread takes everything queued at once, and `PendingSteps` holds the
records whose duration the clock gives later (`clock.StepClock.poll`: CUDA events are
read on the control thread, not at the boundary). Appending wakes the
control thread only when it asked for that many items (`wake_at`), or for the end:
waking it at every step would make it take the GIL from a launch-bound training thread
at every step, which costs that thread more than the work the wake-up does
(docs/agent.md, "The control thread wakes per round, not per step").
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Any, NamedTuple

# Records waiting for their duration are bounded: past this many, the oldest are given up
# (a clock that stopped giving durations must not grow memory).
MAX_WAITING = 8192


class StepRecord(NamedTuple):
    """One ended step, from the training thread to the control thread."""

    step: int
    duration_ms: float  # NaN until known (cuda_event: `StepClock.poll` gives it)
    flags: int  # STEP_* bits
    self_ms: float  # distanom's capture work during the step
    gc_ms: float  # Python garbage collection during the step (host time)
    gc_generation: int  # the highest generation collected, -1 for none


class PendingSteps:
    """Joins step records with durations that come later (control thread only)."""

    def __init__(self) -> None:
        self._waiting: dict[int, StepRecord] = {}  # by step, in step order

    def __len__(self) -> int:
        return len(self._waiting)

    def join(
        self, records: list[StepRecord], durations: list[tuple[int, float]] | None
    ) -> list[StepRecord]:
        """The records whose duration is known now, in step order: those that came with
        one, and waiting ones `durations` (step order, from the clock) complete; None: no
        durations come later (a host clock), records without one are dropped. A record
        older than a step just timed can get no duration any more (a clock passes steps
        in order): it is dropped too."""
        out = []
        waiting = self._waiting
        for record in records:
            if not math.isnan(record.duration_ms):
                out.append(record)
            elif durations is not None:
                waiting[record.step] = record
        for step, duration in durations or ():
            while waiting:
                oldest = next(iter(waiting))
                if oldest >= step:
                    break
                del waiting[oldest]
            timed = waiting.pop(step, None)
            if timed is not None:
                out.append(timed._replace(duration_ms=duration))
        while len(waiting) > MAX_WAITING:
            del waiting[next(iter(waiting))]
        return out


class StepInbox:
    """A queue whose consumer is woken by count, not by every item (see the module
    docstring). One producer, one consumer; unbounded, as the consumer drains it."""

    def __init__(self, end: object) -> None:
        self._end = end  # the item that always wakes the consumer
        self._items: collections.deque[Any] = collections.deque()
        self._ready = threading.Event()
        self._signalled = False  # set() already called since the consumer last took
        self.wake_at = 1  # wake the consumer once this many items are queued

    def put(self, item: Any) -> None:
        """Queue an item (training thread); O(1), wakes the consumer only when due."""
        items = self._items
        items.append(item)
        # one set() per wake: the consumer may need a while to get the GIL, and every
        # further set() until then would cost this thread a lock round trip for nothing
        if not self._signalled and (item is self._end or len(items) >= self.wake_at):
            self._signalled = True
            self._ready.set()

    def take(self, timeout_s: float) -> list[Any]:
        """Wait up to `timeout_s` to be woken, then return everything queued (maybe [])."""
        self._ready.wait(timeout_s)
        # before draining: an item queued meanwhile wakes the next wait
        self._ready.clear()
        self._signalled = False
        items = self._items
        out = []
        while items:
            out.append(items.popleft())
        return out
