"""distanom's own time on the training thread, metered where it is spent, and the
`agent_cost` body of status.json made from it.

Owns `BoundaryMeters`: the training thread (`boundary.StepBoundaries`, `agent.Agent`)
adds to it, the control thread reads it for rank 0's status.json (`agent_cost`, through
`control_status.status_body`), from where `distanom report` words it. Plain integers and
one preallocated list: a boundary adds a few numbers, makes no object.

One-off work is kept apart from the per-step figure, so a short run does not report
start-up as a per-step cost: installing the hooks, the first `STARTUP_BOUNDARIES`
boundaries (the clock and tracer made, the phases' model search, the event pool
filled) and the one that starts the tracer (CUPTI's attach and calibration) are
`startup_ms`; the last steps' drain and the tracer's stop are `teardown_ms`. Boundaries
where tracing switched on or off, or the tracer flushed, are tracing's cost (the duty
cycle measures and charges it: `tracer_switch_ms`), traced boundaries are counted apart,
and the per-step boundary figure is the mean of the other (untraced, steady) ones, split
into `PARTS`.

An event record in the phase marks may wait: for a CUDA launch-queue slot or for the
GIL it let go. That time is charged with the rest (an A/B whose inert half paid the
marks too once made it look free: docs/measurements.md, session 24); how much of it
went beyond the records' median wall is given beside it
(`phase_marks_wait_us_per_step`, `record_floor_us`, `PhaseMarks.queue_waits_ns`), so a
run can show how much of the marks' cost is such waits.

Every `CPU_SAMPLE_EVERY`-th steady boundary, and the phase marks of every
`CPU_SAMPLE_EVERY`-th step, also read this thread's CPU time: `agent_cost` gives the
share of their wall time this thread ran (`boundary_cpu_share`,
`phase_marks_cpu_share`): near 1, the time is work or a spin, not a sleep.
"""

from __future__ import annotations

import math
from typing import Any

# the first boundaries, counted as start-up: the first makes the clock and the tracer,
# the next start the tracer and find the model's forward; by then the clock's event pool
# has filled (its first POLL_EVERY + 2 boundaries make events)
STARTUP_BOUNDARIES = 8
# the parts of an untraced boundary, in order (perf_counter_ns between fixed points):
# stamp: the host timestamp and the evidence mark (this thread's CPU time);
# clock: the step clock's mark (a CUDA event, a poll every few steps; or a host read);
# phases: the phase marks' bookkeeping of the step that ended;
# bookkeeping: the step's flags, distanom's own busy time, GC pauses;
# tracer: the tracer's mark and the duty cycle's question;
# handoff: the resolved steps' records and their queue puts to the control thread
PARTS = ("stamp", "clock", "phases", "bookkeeping", "tracer", "handoff")
STAMP, CLOCK, PHASES, BOOKKEEPING, TRACER, HANDOFF = range(len(PARTS))
CPU_SAMPLE_EVERY = 16  # boundaries (and steps of phase marks) whose thread CPU is read


class BoundaryMeters:
    """What the training thread's boundaries cost, by kind and, for the steady ones, by
    part (`PARTS`); written by the training thread only."""

    __slots__ = (
        "cpu_sample_ns", "cpu_sample_wall_ns", "install_ns", "part_ns", "startup_boundaries",
        "startup_ns", "steady_boundaries", "steady_ns", "switch_ns", "switches", "teardown_ns",
        "traced_boundaries", "traced_ns",
    )  # fmt: skip

    def __init__(self) -> None:
        self.install_ns = 0  # Agent.install on the training thread: hooks, threads started
        self.startup_ns = 0  # start-up boundaries (STARTUP_BOUNDARIES, the tracer's start)
        self.startup_boundaries = 0
        self.switch_ns = 0  # boundaries where tracing switched or the tracer flushed
        self.switches = 0
        self.traced_ns = 0  # other boundaries next to a traced step (its marker)
        self.traced_boundaries = 0
        self.steady_ns = 0  # the rest: untraced, steady
        self.steady_boundaries = 0
        self.part_ns = [0] * len(PARTS)  # the steady boundaries' time by part
        self.teardown_ns = 0  # the end: the last steps drained, the tracer stopped
        # the sampled steady boundaries (CPU_SAMPLE_EVERY): this thread's CPU, and wall
        self.cpu_sample_ns = 0
        self.cpu_sample_wall_ns = 0

    def steady_us(self) -> float | None:
        """Mean us of a steady (untraced) boundary; None before the first."""
        if not self.steady_boundaries:
            return None
        return self.steady_ns / self.steady_boundaries / 1e3

    def parts_us(self) -> dict[str, float]:
        """Mean us of each part of a steady boundary (`PARTS`)."""
        count = max(1, self.steady_boundaries)
        pairs = zip(PARTS, self.part_ns, strict=True)
        return {name: round(ns / count / 1e3, 2) for name, ns in pairs}

    def startup_ms(self) -> float:
        """The one-off start-up work so far (ms): install and the start-up boundaries."""
        return (self.install_ns + self.startup_ns) / 1e6


def own_cost_body(
    meters: BoundaryMeters,
    *,
    steps: int,
    boundary_ns: int,
    phase_marks_ns: int,
    control_cpu_ns: int,
    median_ms: float | None,
    phase_marks_sample: tuple[int, int] = (0, 0),
    phase_marks_wait: tuple[int, float | None] = (0, None),
) -> dict[str, Any]:
    """The per-step and one-off figures of `agent_cost` (status.json): the boundary's
    steady mean and its parts, the phase marks and the control thread's CPU per step,
    their sum as a percentage of the step without them (`median_ms`, the run's median
    step, less their sum: what a whole-job A/B's ratio reads); start-up and the end once, in ms;
    tracer switches and traced boundaries apart. `boundary_ns`: every boundary's time;
    `phase_marks_sample`: the sampled marks' (CPU ns, wall ns); `phase_marks_wait`: the
    part of the marks' time their records took beyond their median (ns), and that
    median (us), from `PhaseMarks.queue_waits_ns`: given beside, not taken off."""
    steady = meters.steady_us()
    # no steady boundary yet (a run of a few steps): the mean of all of them, said so
    boundary_us = steady if steady is not None else boundary_ns / steps / 1e3
    wait_ns, record_floor_us = phase_marks_wait
    wait_ns = min(max(0, wait_ns), phase_marks_ns)  # counters read a moment apart
    marks_us = phase_marks_ns / steps / 1e3  # phase marks between boundaries
    control_us = control_cpu_ns / steps / 1e3
    boundary_share = _share(meters.cpu_sample_ns, meters.cpu_sample_wall_ns)
    marks_share = _share(*phase_marks_sample)
    pct = None
    if median_ms is not None and math.isfinite(median_ms) and median_ms > 0:
        # of the step without it, as a whole-job A/B's ratio is (with it, over without)
        own_ms = (boundary_us + marks_us + control_us) / 1e3
        if median_ms > own_ms:
            pct = round(own_ms / (median_ms - own_ms) * 100, 4)
    traced = meters.traced_boundaries
    return {
        "steps": steps,
        "boundary_ns": boundary_ns,
        "control_cpu_ns": control_cpu_ns,
        "boundary_us_per_step": round(boundary_us, 2),
        "boundary_parts_us": meters.parts_us(),
        "steady_boundaries": meters.steady_boundaries,
        "phase_marks_us_per_step": round(marks_us, 2),
        # of the marks' time, their event records' beyond their median (waits for a
        # launch-queue slot or the GIL, and jitter): inside the figure above
        "phase_marks_wait_us_per_step": round(wait_ns / steps / 1e3, 2),
        "record_floor_us": None if record_floor_us is None else round(record_floor_us, 3),
        "control_us_per_step": round(control_us, 2),
        "pct_of_median_step": pct,
        # its base: the run's median step so far (`run_median`), distanom's time in it
        "median_step_ms": (
            round(median_ms, 4) if median_ms is not None and math.isfinite(median_ms) else None
        ),
        # how much of the training thread's wall time in them it ran (module docstring)
        "boundary_cpu_share": None if boundary_share is None else round(boundary_share, 4),
        "phase_marks_cpu_share": None if marks_share is None else round(marks_share, 4),
        "startup_ms": round(meters.startup_ms(), 3),
        "startup_boundaries": meters.startup_boundaries,
        "teardown_ms": round(meters.teardown_ns / 1e6, 3),
        "tracer_switches": meters.switches,
        "tracer_switch_ms": round(meters.switch_ns / 1e6, 3),
        "traced_boundaries": traced,
        "traced_boundary_us": round(meters.traced_ns / traced / 1e3, 2) if traced else None,
    }


def _share(cpu_ns: int, wall_ns: int) -> float | None:
    """CPU time over wall time of a sample, at most 1 (None: no sample yet)."""
    return min(1.0, cpu_ns / wall_ns) if wall_ns > 0 else None
