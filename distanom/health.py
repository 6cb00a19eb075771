"""The agent's shared health state: what has failed, said once, read by every thread.

The training thread reads it at each step boundary (is capture off? switch tracing off),
the control thread sets it (no run directory, no consensus) and writes it into
status.json. Each field is written by one thread and read by the others as a whole
value, so no lock is needed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distanom.capture import CaptureWorker

log = logging.getLogger(__name__)


class Health:
    """Why capture stepped aside, the consensus error, the capture worker, warn-once keys."""

    def __init__(self) -> None:
        self.capture_off_reason: str | None = None  # this rank stopped writing captures
        self.consensus_error: str | None = None  # no consensus: no rank captures
        self.capture: CaptureWorker | None = None  # made by the control thread at need
        # the control thread's heavy rounds so far (monotonic ns), charged like capture work
        self.control_busy_ns = 0
        self._warned: set[str] = set()

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        """Log `message` as a warning the first time `key` is seen, never again."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def capture_off(self, reason: str) -> None:
        """Capture steps aside on this rank for the rest of the run (the first reason stays)."""
        if self.capture_off_reason is None:
            self.capture_off_reason = reason
            self.warn_once("capture-off", "capture: %s; capture steps aside", reason)

    def capture_stepped_aside(self) -> bool:
        """This rank stopped writing captures (no run directory, a failed worker)."""
        capture = self.capture
        return self.capture_off_reason is not None or (capture is not None and not capture.active)

    def capture_is_off(self) -> bool:
        """Capture is off for the rest of the run: stepped aside, or no consensus."""
        return self.capture_stepped_aside() or self.consensus_error is not None
