"""One resolved step as the training thread hands it on (`StepRecord`), and its STEP_*
flags; no torch, no numpy (the side process reads them too).

`boundary.StepBoundaries` makes a record per step once the clock has timed it; the
control thread takes them (`inbox`) for rounds and the steps file (`step_log`), and
with a side process the steps file's share crosses in `side_frames`' frames.
"""

from __future__ import annotations

from typing import NamedTuple

from distanom.phase_split import NO_RAW, RawPhases

# Per-step flags; the first three each rank reports (OR/AND-ed across ranks in `consensus`)
STEP_TRACED = 1  # the tracer recorded the step
STEP_AFTER_FLUSH = 2  # the tracer flushed at the step's start boundary
STEP_DISTURBED = 4  # distanom's own capture work ran during the step
STEP_SKIPPED = 8  # the step's optimizer step was skipped by a GradScaler (not sent in rounds)


class StepRecord(NamedTuple):
    """One resolved step, from the training thread to the control thread."""

    step: int
    duration_ms: float
    flags: int  # STEP_* bits
    self_ms: float  # distanom's capture work during the step
    gc_ms: float  # Python garbage collection during the step (host time)
    gc_generation: int  # the highest generation collected, -1 for none
    phases: RawPhases = NO_RAW  # the step's phases, split on the control thread (distanom.phases)
