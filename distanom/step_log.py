"""This rank's steps file (steps/rank<R>.csv) as the control thread writes it: a row per
resolved step, made from the training thread's `boundary.StepRecord`s (flags as bools,
the phases split by `phase_split.phase_values`), appended a round at a time and flushed about
once a second by the control loop. A write that fails (full disk, a run directory
removed) is said once through `Health` and the log stops; training goes on. The rows'
format and reader are `records.steps`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from distanom.health import Health
from distanom.phase_split import phase_values
from distanom.records.step_rows import StepFields, StepsWriter
from distanom.step_record import STEP_AFTER_FLUSH, STEP_SKIPPED, STEP_TRACED, StepRecord


class StepLog:
    """The steps file of one rank; inert until `open` (no run directory: nothing kept)."""

    def __init__(self, health: Health) -> None:
        self._health = health
        self._writer: StepsWriter | None = None

    def open(self, path: Path) -> None:
        """Start the file (raises OSError: the caller says what it means for the run)."""
        self._writer = StepsWriter(path)

    def write(self, items: list[StepRecord]) -> None:
        """Append the steps' rows, in one write."""
        writer = self._writer
        if writer is None or not items:
            return
        try:
            writer.write_fields(step_fields(items))
        except (OSError, ValueError) as err:
            self._failed(err)

    def flush(self) -> None:
        """Hand what was written to the OS (readers see it)."""
        try:
            if self._writer is not None:
                self._writer.flush()
        except (OSError, ValueError) as err:  # ValueError: closed at exit meanwhile
            self._failed(err)

    def close(self) -> None:
        """Close the file; never raises (at exit)."""
        # taken away first: a thread abandoned at exit then writes nothing more to it
        writer, self._writer = self._writer, None
        with contextlib.suppress(Exception):
            if writer is not None:
                writer.close()

    def _failed(self, err: Exception) -> None:
        reason = (err.strerror if isinstance(err, OSError) else None) or str(err)
        self._health.warn_write_failed("steps", "steps file: %s; step times not recorded", reason)
        self._writer = None


def step_fields(items: list[StepRecord]) -> list[StepFields]:
    """The steps file's fields of each record, in order (flags as bools, the phases split
    by `phase_values`): one list, no object per step."""
    return [
        (
            item.step,
            item.duration_ms,
            (item.flags & STEP_TRACED) != 0,
            (item.flags & STEP_AFTER_FLUSH) != 0,
            item.self_ms,
            item.gc_ms,
            item.gc_generation,
            (item.flags & STEP_SKIPPED) != 0,
            *phase_values(item.phases),
        )
        for item in items
    ]
