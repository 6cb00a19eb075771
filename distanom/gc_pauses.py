"""Python garbage-collection pauses, per step: how long the collector held the process.

Owns one `gc.callbacks` hook (`GcPauses`) that adds up how long collections ran. A
collection holds the GIL from start to end, so every thread, the training loop
included, waits for it; a full (generation 2) collection of a process with torch loaded
walks every tracked object (44 ms for 165k objects on a 2-core VM), as long as several
steps of a launch-bound job: a classic cause of a rare slow step that the GPU trace
shows only as idle time. The agent takes the total at each step boundary (`take`) and
writes it to the rank's step file (`gc_ms`, `gc_gen`), from where `distanom report`
shows it beside a captured step. It only watches: the collector's settings are the
script's own (distanom never disables or freezes it in the training process).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from typing import Any


class GcPauses:
    """Time spent in garbage collections since the last `take`, on any thread."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self._clock = clock
        self._started_ns: int | None = None
        self._total_ns = 0
        self._highest_generation = -1
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_collection)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(self._on_collection)
            self._installed = False

    def take(self) -> tuple[float, int]:
        """(ms collections ran, highest generation collected or -1) since the last call.

        A collection cannot run in the middle of a callback or of this method on another
        thread (both hold the GIL); one started by an allocation inside this method is
        counted at the next call."""
        total, highest = self._total_ns, self._highest_generation
        self._total_ns, self._highest_generation = 0, -1
        return total / 1e6, highest

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        # called by the interpreter around every collection: never raise from here
        try:
            now = self._clock()
            if phase == "start":
                self._started_ns = now
                generation = info.get("generation", -1)
                if isinstance(generation, int) and generation > self._highest_generation:
                    self._highest_generation = generation
            elif self._started_ns is not None:
                self._total_ns += max(0, now - self._started_ns)
                self._started_ns = None
        except Exception:  # escaping, it would be printed at every collection
            pass
