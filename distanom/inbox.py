"""The hand-over of resolved steps from the training thread to the control thread.

The training thread appends a `boundary.StepRecord` per resolved step (and `FINAL` at
the end); the control thread takes everything queued at once. Appending wakes the
control thread only when it asked for that many items (`wake_at`), or for the end:
waking it at every step would make it take the GIL from a launch-bound training thread
at every step, which costs that thread more than the work the wake-up does
(docs/agent.md, "The control thread wakes per round, not per step").

With a deferred step clock (`boundary.DEFER_EVENT_READS`, off), the training thread puts
no records at all: each boundary only counts (`tick`), and `take` has the steps
resolved there, on the control thread (`collect`, set by `StepBoundaries`): the event
reads and the records are made once per round, in a warm batch, not at every boundary.

One exception: a run of `SLOW_RUN_STEPS` consecutive steps slower than `slow_ms` (the
control thread sets it from the gathered median; a deferred clock's boundaries are timed
by the host for it) wakes the consumer at once, and that
`take` says so (`took_urgent`), so a lasting slowdown reaches a round early instead of
a whole long round late (`distanom.rounds`, early rounds).
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable
from typing import Any

# consecutive slow steps that wake the control thread early: the trace planner's
# lasting slowdown is as many anomalous steps
SLOW_RUN_STEPS = 4


class StepInbox:
    """A queue whose consumer is woken by count, not by every item (see the module
    docstring). One producer, one consumer; unbounded, as the consumer drains it."""

    def __init__(self, end: object) -> None:
        self._end = end  # the item that always wakes the consumer
        self._items: collections.deque[Any] = collections.deque()
        self._ready = threading.Event()
        self._signalled = False  # set() already called since the consumer last took
        self.wake_at = 1  # wake the consumer once this many items are queued
        self.slow_ms = math.inf  # a step slower than this counts towards a slow run
        # slow runs seen (written by the producer only) and the count the consumer had
        # seen at its last take (written by the consumer only): no flag to lose between
        # a read and a clear on two threads
        self._slow_runs = 0
        self._slow_runs_taken = 0
        self.took_urgent = False  # the last take drained a slow run's last step
        # the end has been taken: nothing follows it, and no take will return it again
        # (a consumer that failed after taking it must not wait for it)
        self.ended = False
        self._slow_run = 0
        # a deferred clock's boundaries since the start (producer) and at the last take
        # (consumer), and what resolves them (`StepBoundaries.collect`, consumer side)
        self._ticks = 0
        self._ticks_taken = 0
        self.collect: Callable[[], list[Any]] | None = None
        self.behind = 0  # boundaries the GPU had not passed at the last collect

    def put(self, item: Any) -> None:
        """Queue an item (training thread); O(1), wakes the consumer only when due."""
        items = self._items
        items.append(item)
        # one set() per wake: the consumer may need a while to get the GIL, and every
        # further set() until then would cost this thread a lock round trip for nothing
        if not self._signalled and (item is self._end or len(items) >= self.wake_at):
            self._wake()

    def _wake(self) -> None:
        self._signalled = True
        self._ready.set()

    def put_step(self, item: Any, duration_ms: float) -> None:
        """`put` for a resolved step: a run of `SLOW_RUN_STEPS` consecutive steps over
        `slow_ms` wakes the consumer at once (once per run)."""
        if duration_ms > self.slow_ms:
            self._slow_run += 1
            if self._slow_run == SLOW_RUN_STEPS:
                self._items.append(item)  # before the count: a take that sees it drains it
                self._slow_runs += 1
                self._wake()
                return
        else:
            self._slow_run = 0
        self.put(item)

    def tick(self, interval_ns: int) -> None:
        """A boundary whose step the consumer resolves (deferred clock; training thread):
        counts towards `wake_at` as a put would, and a host interval over `slow_ms`
        towards a slow run (`put_step`'s rule, inlined as there: both run every step)."""
        self._ticks = ticks = self._ticks + 1
        if interval_ns > self.slow_ms * 1e6:
            self._slow_run += 1
            if self._slow_run == SLOW_RUN_STEPS:
                self._slow_runs += 1
                self._wake()
                return
        else:
            self._slow_run = 0
        # the newest `behind` boundaries are not resolved yet when the consumer looks:
        # waiting for them too makes one wake per round, not two
        if not self._signalled and ticks - self._ticks_taken >= self.wake_at + self.behind:
            self._wake()

    def take(self, timeout_s: float) -> list[Any]:
        """Wait up to `timeout_s` to be woken, then return everything queued (maybe [])."""
        self._ready.wait(timeout_s)
        # before draining: an item queued meanwhile wakes the next wait
        self._ready.clear()
        self._signalled = False
        # before draining too: a slow run counted now has its last step queued already (a
        # deferred clock's: its last boundary ticked; its record may come a take later)
        runs = self._slow_runs
        self.took_urgent = runs != self._slow_runs_taken
        self._slow_runs_taken = runs
        self._ticks_taken = self._ticks
        # resolved here before the queue is drained: the end (after the training
        # thread's last steps, `StepBoundaries.drain`) then comes after them
        collect = self.collect
        out: list[Any] = collect() if collect is not None else []
        items = self._items
        while items:  # what is queued meanwhile is taken too; each popleft is atomic
            pop = items.popleft
            out += [pop() for _ in range(len(items))]
        if out and out[-1] is self._end:  # the one producer puts it last
            self.ended = True
        return out
