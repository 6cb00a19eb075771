"""Python garbage-collection pauses, per step: how long the collector held the process.

Owns one `gc.callbacks` hook (`GcPauses`) that records how long each collection ran.
The thread that runs a collection does nothing else meanwhile and holds the GIL (other
threads may get it only while finalisers the collection calls run Python code), so a
collection on any thread stalls the training loop. A full (generation 2) collection of
a process with torch loaded walks every tracked object (44 ms for 165k objects on a
2-core VM), as long as several steps of a launch-bound job: a classic cause of a rare
slow step that the GPU trace shows only as idle time.

The agent takes the finished collections at each step boundary (`take`) and writes them
to the rank's step file (`gc_ms`, `gc_gen`), from where `distanom report` shows them
beside a captured step. A collection is charged whole to the step in which it ends. It
only watches: the collector's settings are the script's own (distanom never disables or
freezes it in the training process).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import time
from collections.abc import Callable
from typing import Any


class GcPauses:
    """The collections that ended since the last `take`, on any thread."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self._clock = clock
        # one collection runs at a time in a process: its start and generation
        self._started: tuple[int, int] | None = None
        # (ns, generation) of finished collections: a deque's append and popleft are
        # atomic, so the callback (any thread) and `take` (the training thread) never
        # see a half-made update, whichever thread the interpreter switches to
        self.finished: collections.deque[tuple[int, int]] = collections.deque(maxlen=4096)
        self._installed = False

    def install(self) -> None:
        """Add the hook to `gc.callbacks` (once)."""
        if not self._installed:
            gc.callbacks.append(self._on_collection)
            self._installed = True

    def uninstall(self) -> None:
        """Remove the hook from `gc.callbacks`, if present."""
        if self._installed:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(self._on_collection)
            self._installed = False

    def take(self) -> tuple[float, int]:
        """(ms the collections that ended since the last call ran, the highest generation
        among them or -1)."""
        if not self.finished:  # nearly every step: no exception raised for nothing
            return 0.0, -1
        total_ns, highest = 0, -1
        while True:
            try:
                spent, generation = self.finished.popleft()
            except IndexError:
                return total_ns / 1e6, highest
            total_ns += spent
            highest = max(highest, generation)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        # called by the interpreter around every collection: never raise from here
        try:
            now = self._clock()
            if phase == "start":
                generation = info.get("generation", -1)
                self._started = (now, generation if isinstance(generation, int) else -1)
            elif self._started is not None:
                began, generation = self._started
                self._started = None
                self.finished.append((max(0, now - began), generation))
        except Exception:  # escaping, it would be printed at every collection
            pass
