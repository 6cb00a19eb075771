"""A step's phase marks split into the phases' times: pure functions and the record
shapes they work on, with no torch (the side process writes steps-file rows with them).

`distanom.phases` takes the marks on the training thread and hands each step's raw marks
out (`RawPhases`); `phase_values` turns them into the steps file's phase columns, on the
control thread or in the side process (`distanom.side_main`); `resolve` gives the same
as (host parts, fetch, GPU parts) for tools. The marks' kinds and the parts' order are
defined here, once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# parts of a step, in the order of `PhaseTimes` (host) and `GPU_PARTS` (device)
PARTS = ("data", "forward", "backward", "tail", "optimizer")
DATA, FORWARD, BACKWARD, TAIL, OPTIMIZER = range(5)
# marks
_FWD_START, _FWD_END, _BWD_END, _OPT_START = range(4)
NAN_PARTS: tuple[float, ...] = (math.nan,) * 5
# the GPU's parts: up to the forward's end, the backward, after the backward's end
GPU_PARTS = ("to_forward_end", "backward", "after_backward")
NAN_GPU: tuple[float, ...] = (math.nan,) * 3
# (host parts, fetch_ms, gpu parts): what `take` returns per step
PhaseTimes = tuple[tuple[float, ...], float, tuple[float, ...]]
NO_VALUES: tuple[float, ...] = (*NAN_PARTS, math.nan, *NAN_GPU)  # `phase_values` of nothing
# what `take_raw` hands on, for `resolve` to split on the control thread: (the step's
# marks as (kind, perf ns, event), its start and end (perf ns), fetch ns, GPU parts);
# marks None where nothing is known
RawPhases = tuple[list[tuple[int, int, Any]] | None, int, int, int, tuple[float, ...]]
NO_RAW: RawPhases = (None, 0, 0, 0, NAN_GPU)


def split_gpu(timed: list[tuple[int, float]], end: float) -> tuple[float, ...]:
    """The GPU's three parts (`GPU_PARTS`) of a step from 0 to `end`, given the forward's
    and backward's end marks as (kind, time): up to a forward's end (its data and forward;
    between micro-batches, from a backward's end to the next forward's end), the
    backward (a forward's end to the backward's end), after the last backward's end. Pure."""
    parts = [0.0, 0.0, 0.0]
    current, previous = 0, 0.0
    for kind, at in timed:
        parts[current] += at - previous
        previous = at
        current = 1 if kind == _FWD_END else 0
    parts[2 if current == 0 and timed and timed[-1][0] == _BWD_END else current] += end - previous
    return tuple(parts)


def split_parts(marks: Sequence[Sequence[Any]], start: float, end: float) -> list[float]:
    """The five parts (ms) of a step that began at `start` and ended at `end` (any unit
    per ms, as the marks), given its marks in order, each (kind, time, ...). A backward's
    end followed by a forward is the next micro-batch's data. Pure; runs for every step
    on the control thread, hence one loop with the transitions inline."""
    parts = [0.0, 0.0, 0.0, 0.0, 0.0]
    current, previous, seen_optimizer = DATA, start, False
    last = len(marks) - 1
    for position, mark in enumerate(marks):
        kind, at = mark[0], mark[1]
        parts[current] += at - previous
        previous = at
        if kind == _FWD_START:
            current = FORWARD
        elif kind == _FWD_END:
            current = BACKWARD
        elif kind == _OPT_START:
            current, seen_optimizer = OPTIMIZER, True
        elif seen_optimizer:  # a backward's end inside the optimizer step (Lightning)
            current = OPTIMIZER
        elif position < last and marks[position + 1][0] == _FWD_START:
            current = DATA  # the next micro-batch
        else:
            current = TAIL
    parts[current] += end - previous
    return parts


def told(marks: list[tuple[int, int, Any]]) -> bool:
    """Whether a forward was seen: then the data, forward and backward parts are known."""
    for mark in marks:  # noqa: SIM110 (every step, control thread: no generator frame)
        if mark[0] == _FWD_START:
            return True
    return False


def resolve(raw: RawPhases) -> PhaseTimes:
    """A step's (host parts, fetch ms, GPU parts) from `take_raw`'s answer. Pure."""
    values = phase_values(raw)
    return values[:5], values[5], values[6:]


def phase_values(raw: RawPhases) -> tuple[float, ...]:
    """A step's phase times as the steps file's phase columns, in order: host parts,
    batch fetch, GPU parts (`records.steps.PHASE_COLUMNS`), from `take_raw`'s answer
    (control thread, every step: no generator, no intermediate tuple)."""
    marks, start, end, fetch_ns, gpu = raw
    if marks is None:
        return NO_VALUES
    if told(marks):
        data, forward, backward, tail, optimizer = split_parts(marks, start, end)
        return (data / 1e6, forward / 1e6, backward / 1e6, tail / 1e6, optimizer / 1e6,
                fetch_ns / 1e6, *gpu)  # fmt: skip
    # no forward seen: only the optimizer phase is known
    optimizer_ms = math.nan
    for kind, ns, _event in marks:
        if kind == _OPT_START:
            optimizer_ms = (end - ns) / 1e6
            break
    return (math.nan, math.nan, math.nan, math.nan, optimizer_ms, fetch_ns / 1e6, *gpu)
