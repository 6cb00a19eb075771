"""steps/rank<R>.csv's format and writer: its columns, one row's text and the appending
writer, used where the rows are written (the rank's control thread or its side process,
`step_log`). No numpy here: the side process imports this and nothing heavy. The
reader is `records.steps`.

Columns (`STEPS_CSV_HEADER`): step, its duration (ms, as the clock measured it), traced /
after a tracer flush (0|1), distanom's capture work during it (ms), Python garbage
collection during it (ms, and the highest generation collected, -1 for none), whether the
optimizer step of the iteration was skipped (0|1: a GradScaler found inf/nan gradients),
then the step's phases (`distanom.phases`): host ms of data, forward, backward, tail
(from the backward's end to the optimizer step) and optimizer, the time inside the batch
fetch, and the GPU's time up to the forward's end, in the backward, and after the
backward's end (`distanom.phase_split.GPU_PARTS`); `nan` where not known.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from distanom.rundir import FILE_MODE
from distanom.safe_io import open_append_at, open_dir

PHASE_COLUMNS = (
    "data_ms", "forward_ms", "backward_ms", "tail_ms", "optimizer_ms", "fetch_ms",
    "gpu_to_forward_end_ms", "gpu_backward_ms", "gpu_after_backward_ms",
)  # fmt: skip
# (step, duration_ms, traced, after_flush, self_ms, gc_ms, gc_generation, skipped, then
# the PHASE_COLUMNS' floats)
StepFields = tuple[Any, ...]
STEPS_CSV_HEADER = (
    "step,duration_ms,traced,after_flush,self_ms,gc_ms,gc_gen,skipped,"
    + ",".join(PHASE_COLUMNS)
    + "\n"
)
NO_PHASE_VALUES: tuple[float, ...] = (math.nan,) * len(PHASE_COLUMNS)
MAX_STEP_ROWS = 10_000_000  # a steps file is one short line per step
MAX_STEP = 2**53  # a step number a float still holds exactly; beyond is damage
MAX_DURATION_MS = 1e9  # 11.6 days: a longer (or negative, or not finite) step is damage
MAX_ROW_CHARS = 1024  # a longer row is damage, skipped without reading it whole
MAX_SKIP_CHARS = 1024 * MAX_ROW_CHARS  # a damaged row past this (1 MB) ends the read
# One row as written (`StepRow`'s fields in order, flags as bools), newline included. A
# %-format of a tuple: the control thread writes a round's rows with no StepRow per step.
ROW_FORMAT = "%d,%.4f,%d,%d,%.3f,%.3f,%d,%d" + ",%.3f" * len(PHASE_COLUMNS) + "\n"


@dataclass(frozen=True, slots=True)
class StepRow:
    """One step of one rank as the steps file holds it."""

    step: int
    duration_ms: float
    traced: bool
    after_flush: bool
    self_ms: float  # distanom's own heavy work during the step (capture, heavy rounds)
    gc_ms: float = 0.0  # Python garbage collection during the step (host time)
    gc_generation: int = -1  # the highest generation collected, -1 for none
    skipped: bool = False  # the iteration's optimizer step was skipped (inf/nan gradients)
    phases: tuple[float, ...] = NO_PHASE_VALUES  # PHASE_COLUMNS in order, NaN: not known

    def line(self) -> str:
        """The row as written to the file, newline included."""
        return ROW_FORMAT % (
            self.step,
            self.duration_ms,
            self.traced,
            self.after_flush,
            self.self_ms,
            self.gc_ms,
            self.gc_generation,
            self.skipped,
            *self.phases,
        )

    @property
    def gc_pause(self) -> tuple[float, int] | None:
        """The step's garbage collection (ms, generation), None for none."""
        return (self.gc_ms, self.gc_generation) if self.gc_ms > 0 else None


class StepsWriter:
    """Appends rows to one rank's steps file (the header once, when the file is new).

    Errors (OSError, ValueError on a closed file) reach the caller, which decides whether
    step times stop being recorded.
    """

    def __init__(self, path: Path) -> None:
        # the folder (made if missing) and the file are never followed if links
        with open_dir(path.parent.parent, (path.parent.name,), create=True) as folder:
            fd = open_append_at(folder, path.name, FILE_MODE)
        self._file: IO[str] = os.fdopen(fd, "a", encoding="ascii")
        if self._file.tell() == 0:
            self._file.write(STEPS_CSV_HEADER)

    def write_rows(self, rows: list[StepRow]) -> None:
        """Append rows in one write (buffered until `flush`)."""
        self._file.write("".join([row.line() for row in rows]))

    def write_fields(self, rows: Iterable[StepFields]) -> None:
        """Append rows given as `StepRow`'s fields in order, in one write: the same text
        as `write_rows`, without an object per row (the control thread's per-step work)."""
        self._file.write("".join([ROW_FORMAT % row for row in rows]))

    def flush(self) -> None:
        """Hand the buffered rows to the operating system."""
        self._file.flush()

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()
