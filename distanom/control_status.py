"""Rank 0's status.json body, from the control loop's state (`ControlLoop._write_status`).

Kept apart from `distanom.control_loop` (the thread and its rounds): what the live
status shows of the gathered steps, the detector, captures, tracer and own cost.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

from distanom.boundary import StepBoundaries
from distanom.config import Config
from distanom.detect import Detector, StepSample
from distanom.duty_cycle import DutyCycle
from distanom.health import Health
from distanom.own_time import own_cost_body
from distanom.pacing import RoundPacer
from distanom.records.status import CaptureCounts, Status, TracerReport
from distanom.rundir import RunDir, json_number
from distanom.side_link import SideSteps


def tracer_report(boundaries: StepBoundaries, duty: DutyCycle) -> TracerReport:
    """Backend, duty cycle and measured overhead, for the status file."""
    tracer = boundaries.tracer
    report: TracerReport = {
        "backend": tracer.name if tracer else None,
        "note": boundaries.tracer_note,
    }
    duty_report = duty.report()
    if duty_report is not None:
        report["duty_cycle"] = duty_report
        report["overhead_pct"] = duty_report.get("measured_overhead_pct")
        report["traced_fraction"] = duty_report.get("traced_fraction")
    if tracer is not None:
        with contextlib.suppress(Exception):
            report["stats"] = tracer.stats()
    return report


def status_body(
    state: str,
    *,
    run: RunDir | None,
    world_size: int,
    config: Config,
    boundaries: StepBoundaries,
    duty: DutyCycle,
    detector: Detector,
    health: Health,
    stragglers: dict[str, Any] | None,
    recent_samples: Sequence[StepSample],
    gathered_step: int,
    exit_code: int,
    own_cost: dict[str, Any],
) -> Status:
    """The status file's body in `state` (running, finished, failed, interrupted)."""
    counts = detector.counts
    capture = health.capture
    stats = capture.stats if capture else None
    recent = recent_times(recent_samples, 16)
    slowest = sorted(
        recent,
        key=lambda r: -max((t for t in recent[r] if t is not None), default=0.0),
    )
    captures: CaptureCounts = {
        "written": stats.kept if stats else 0,  # the files in the run, as `bytes` counts
        "replaced": stats.dropped if stats else 0,
        "bytes": stats.bytes_written if stats else 0,
        "missed": stats.missed if stats else 0,
        "skipped_disk": stats.skipped_disk if stats else 0,
        "failed": stats.failed if stats else None,
        "errors": stats.errors if stats else 0,
    }
    return {
        "state": state,
        "run_id": run.run_id if run else None,
        "world_size": world_size,
        "step": boundaries.current_step,
        "gathered_step": gathered_step,
        "median_ms": json_number(detector.median_ms),
        "threshold_ms": json_number(detector.threshold_ms),
        "recent_ms": {str(rank): times for rank, times in recent.items()},
        "slowest_ranks": slowest[:8],
        "detector": vars(counts).copy(),
        "episodes": detector.episode_summaries()[-20:],
        "captures": captures,
        "tracer": tracer_report(boundaries, duty),
        "capture_off": health.capture_off_reason,
        "consensus_error": health.consensus_error,
        "status_interval_s": config.control.status_interval_s,
        "exit_code": exit_code if state != "running" else None,
        "stragglers": stragglers,
        "agent_cost": own_cost,
    }


def recent_times(history: Sequence[StepSample], limit: int) -> dict[int, list[float | None]]:
    """Per rank, the last `limit` step times (None where unknown), for the live status."""
    tail = list(history)[-limit:]
    if not tail:
        return {}
    world = len(tail[0].times_ms)
    return {
        rank: [
            round(s.times_ms[rank], 3) if math.isfinite(s.times_ms[rank]) else None for s in tail
        ]
        for rank in range(world)
    }


def agent_cost(
    boundaries: StepBoundaries,
    control_cpu_ns: int,
    median_ms: float | None,
    pacer: RoundPacer,
    early_rounds: int,
    side: SideSteps | None = None,
) -> dict[str, Any]:
    """What distanom itself costs a rank per step, measured live: time in the step
    boundaries on the training thread (steady ones per step, by part; start-up, the end
    and tracer switches apart: `own_time`), CPU time of the control thread (rounds,
    evidence, files; `control_cpu_ns` since its setup), and their sum as a percentage of
    the step without them (`median_ms`: the run's median step, `run_median`). Capture
    work and the tracer's own cost are not in it (the duty cycle measures those), nor
    the side process's CPU (another core's: given beside, with where the steps file's
    rows are written, from `side`)."""
    steps = boundaries.current_step
    if steps <= 0:
        return {"steps": 0}
    body = own_cost_body(
        boundaries.meters,
        steps=steps,
        boundary_ns=boundaries.own_ns,
        phase_marks_ns=boundaries.phases.own_ns,
        control_cpu_ns=control_cpu_ns,
        median_ms=median_ms,
        phase_marks_sample=(boundaries.phases.cpu_sample[0], boundaries.phases.cpu_sample[1]),
        phase_marks_wait=boundaries.phases.queue_waits_ns(),
    )
    clock = boundaries.clock
    work_ms = pacer.work_ms
    side_cpu = None if side is None else side.cpu_ns()
    return {
        **body,
        "clock_mode": clock.mode if clock is not None else None,  # what each step pays
        # clock.mode adaptive: steps it timed with the host clock instead of events
        "host_timed_steps": clock.host_timed_steps if clock is not None else None,
        # pauses between rounds' phases so far (none where a round's work is small)
        "round_pauses": pacer.pauses,
        "round_work_ms": None if work_ms is None else round(work_ms, 3),
        # rounds some rank ended early, its steps slowed down: the job's count, the same
        # on every rank (consensus.RoundResult.cut_early)
        "early_rounds": early_rounds,
        # where the steps file's rows are written; the side process's CPU is another
        # core's, not in the figures above (docs/design.md, "Processes")
        "steps_written_by": None if side is None else side.state,
        # after its start-up, which is given once (its interpreter and imports)
        "side_process_cpu_us_per_step": (
            None
            if side_cpu is None
            else round((side_cpu[0] - side_cpu[1]) / max(1, boundaries.current_step) / 1e3, 2)
        ),
        "side_process_startup_cpu_ms": None if side_cpu is None else round(side_cpu[1] / 1e6, 1),
    }
