"""The agent's shared health state: what has failed, said once, read by every thread.

The training thread reads it at each step boundary (is capture off? switch tracing off),
the control thread sets it (no run directory, no consensus) and writes it into
status.json. Each field is written by one thread and read by the others as a whole
value, so no lock is needed.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
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
        self.run_dir: Path | None = None  # set by the control thread once it exists
        self.run_dir_gone = False  # removed (or replaced) under the running job
        self._warned: set[str] = set()

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        """Log `message` as a warning the first time `key` is seen, never again."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def warn_write_failed(self, key: str, message: str, *args: Any) -> None:
        """A write into the run directory failed: the writer's warning, once per `key`;
        but if the run directory itself is gone, one warning for every writer (a removed
        run directory fails them all at once, and the cause is one)."""
        if not self.check_run_dir():
            self.warn_once(key, message, *args)

    def check_run_dir(self) -> bool:
        """True if the run directory is gone (no longer a directory at its path, a link
        counting as gone); the first time, capture steps aside and one warning says so."""
        if self.run_dir_gone:
            return True
        run_dir = self.run_dir
        if run_dir is None:
            return False
        try:
            if stat.S_ISDIR(os.lstat(run_dir).st_mode):
                return False
        except OSError:
            pass
        self.run_dir_gone = True
        if self.capture_off_reason is None:
            self.capture_off_reason = f"run directory {run_dir} is gone"
        self.warn_once(
            "run-dir-gone",
            "run directory %s was removed; distanom writes nothing more (training goes on)",
            run_dir,
        )
        return True

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
