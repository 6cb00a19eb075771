"""One resolved step as the training thread hands it on (`StepRecord`), and the STEP_*
flag a boundary adds to the detector's; no torch (the side process reads them too).

`boundary.StepBoundaries` makes a record per step once the clock has timed it; the
control thread takes them (`inbox`) for rounds and the steps file (`step_log`), and
with a side process the steps file's share crosses in `side_frames`' frames.
"""

from __future__ import annotations

from typing import NamedTuple

from distanom.phase_split import NO_RAW, RawPhases

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
