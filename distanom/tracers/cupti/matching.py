"""Matching step-marker records to the step boundaries the training thread marked.

Owns the numbering rule, the part of the cupti backend that must never be silently
wrong, and the values it works on: `StepMark` (what `mark_step` recorded) and
`assign_markers` (marker records -> steps). Read by `resolver`; pure (no CUPTI, no torch).

- Correlation ids are process-wide and increase in launch order while CUPTI stays
  attached (after a detach they start again: records are ordered by attachment epoch,
  then id), so the records of step N are exactly those launched between marker N-1 and
  marker N, whatever the stream and however far the GPU lags the host.
- Each marker encodes `step % K` (K = `MARKER_CODES`) in its grid size (see `marker`);
  calibration learns grid -> code at start-up.
- A marker record is matched to the newest marked step with its code whose host launch
  time is not after the marker's GPU start (a kernel never starts before it is
  launched), walking markers from the newest down, steps strictly decreasing. A lost
  marker or a dropped buffer therefore cannot shift the numbering: the next marker still
  carries its own code. Only a GPU lagging the host by K steps or more could fool it;
  the tracer's lag probe flags such steps (see `tracer`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from distanom.tracers.cupti.marker import MARKER_NAME
from distanom.tracers.cupti.records import MarkerRecord

MARKER_PREFIX = MARKER_NAME
MARKER_CODES = 16  # K: markers encode step % K
# CUPTI's clock vs time.time_ns(): they agree within a few µs; this bound leaves margin.
CLOCK_TOLERANCE_NS = 200_000


def is_marker_name(name: str) -> bool:
    """Whether a kernel name is distanom's step marker."""
    return name.startswith(MARKER_PREFIX)


class StepMark(NamedTuple):
    """What the training thread recorded at the end of a step (a tuple: one is made at
    every boundary, and a frozen dataclass costs three times as much to build)."""

    step: int
    host_end_ns: int  # as the agent passed it (time.time_ns())
    launch_wall_ns: int  # time.time_ns() just before the marker launch: CUPTI's clock
    launch_mono_ns: int  # time.monotonic_ns() at the same moment: compared with buffer arrivals
    code: int
    marker_launched: bool  # tracing was on when the marker was launched
    traced_after: bool  # tracing stayed on after this boundary (the next step is traced)


def assign_markers(
    markers: Sequence[MarkerRecord],
    marks: Sequence[StepMark],
    grid_to_code: Mapping[int, int],
    *,
    clock_offset_ns: int = 0,
    tolerance_ns: int = CLOCK_TOLERANCE_NS,
    correlation_floor: int = 0,
) -> tuple[dict[int, MarkerRecord], int]:
    """Match marker records to marked steps (see the module docstring). Returns
    {step: marker} and how many markers matched no retained step."""
    launched = [m for m in marks if m.marker_launched]
    result: dict[int, MarkerRecord] = {}
    unmatched = 0
    upper = math.inf
    for rec in sorted(markers, key=lambda r: r.correlation, reverse=True):
        if rec.correlation <= correlation_floor:
            continue
        code = grid_to_code.get(rec.grid_x)
        best: StepMark | None = None
        if code is not None:
            for mark in reversed(launched):
                if mark.step >= upper or mark.code != code:
                    continue
                if mark.launch_wall_ns + clock_offset_ns - tolerance_ns > rec.start_ns:
                    continue  # launched after this marker ran: not its step
                best = mark
                break
        if best is None:
            unmatched += 1
            continue
        result[best.step] = rec
        upper = best.step
    return result, unmatched
