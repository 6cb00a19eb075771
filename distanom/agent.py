"""The per-rank agent: installs distanom into a training process and takes it out again.

A small facade over three parts:

- `boundary.StepBoundaries`, on the training thread: counts steps and marks their
  boundaries, doing the least possible at each (one timestamp, the clock's mark, the
  tracer's step mark, the duty cycle's switch, a queue put);
- `control_loop.ControlLoop`, on the `distanom-control` thread: everything that can block
  (forming distanom's group, the run directory, rounds of consensus, capture decisions,
  requests, status and step files); trace files are written by the capture worker's
  thread;
- `health.Health` and `duty_cycle.DutyCycle`, the state both threads read.

Any failure in distanom is logged once and switches the failing part off: training keeps
running and keeps its own exit code. `distanom/__init__.py` reaches the installed agent
through `active_agent()`; `distanom.launch` creates, installs and closes it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

from distanom.boundary import FINAL, StepBoundaries
from distanom.capture import CaptureWorker
from distanom.clock import StepClock
from distanom.config import Config
from distanom.control_loop import FINAL_ROUND_TIMEOUT_S, ControlLoop
from distanom.detect import Detector
from distanom.duty_cycle import DutyCycle
from distanom.graph_capture import CAPTURES
from distanom.hang import HangWatch
from distanom.health import Health
from distanom.inbox import StepInbox
from distanom.log_lines import HEADLINE, end_line
from distanom.records.status import TracerReport
from distanom.rundir import RunDir
from distanom.tracers import Tracer
from distanom.world import WorldInfo

__all__ = ["EXIT_DRAIN_FLOOR_S", "Agent", "active_agent"]

log = logging.getLogger(__name__)

_ACTIVE: Agent | None = None
# The last step boundaries are normally a few ms behind the host: wait for them at least
# this long at exit even when analysis.exit_timeout_s is 0.
EXIT_DRAIN_FLOOR_S = 5.0


def active_agent() -> Agent | None:
    """The installed agent of this process, None when there is none."""
    return _ACTIVE


class Agent:
    """One per rank; see the module docstring."""

    def __init__(
        self, config: Config, world: WorldInfo, run_base: Path, argv: list[str] | None = None
    ) -> None:
        self.config = config
        self.world = world
        # absolute, so a script that changes directory (Hydra's job.chdir) still writes
        # into the run it started; shown to the user the way it was given
        self._run_base_given = run_base
        run_base = run_base.absolute()
        self.health = Health()
        self.duty = DutyCycle(config)
        inbox = StepInbox(FINAL)
        self.boundaries = StepBoundaries(config, world.rank, self.health, self.duty, inbox)
        self.control = ControlLoop(
            config,
            world,
            run_base,
            list(argv or []),
            health=self.health,
            duty=self.duty,
            boundaries=self.boundaries,
            inbox=inbox,
        )
        self._inbox = inbox
        self.hang = HangWatch(
            config.hang,
            world,
            current_step=lambda: self.boundaries.current_step,
            median_ms=lambda: self.control.detector.median_ms,
            run=lambda: self.control.run,
        )
        self.control.hang_watch = self.hang

    # -- installation ------------------------------------------------------------------

    def install(self) -> None:
        """Make this the active agent: hook the optimizers, start the control thread and
        the garbage-collection timer."""
        global _ACTIVE
        _ACTIVE = self
        began = time.perf_counter_ns()  # start-up, reported once (`own_time`)
        from distanom.analysis import trace_io

        trace_io.PAUSE_GC_DURING_LOAD = False  # never touch the GC of the training process
        self.boundaries.install_hook()
        CAPTURES.install()  # steps inside a CUDA graph capture are skipped (graph_capture)
        self.control.start()
        self.hang.start()
        # last: nothing after it can fail and leave it installed
        self.boundaries.gc_pauses.install()
        self.boundaries.meters.install_ns += time.perf_counter_ns() - began

    # -- public API (training thread) --------------------------------------------------

    def own_cost(self) -> dict[str, Any]:
        """distanom's own time per step on this rank, as status.json's `agent_cost`."""
        return self.control.own_cost()

    @property
    def current_step(self) -> int:
        """The index of the step in progress, from 0."""
        return self.boundaries.current_step

    def use_optimizer(self, optimizer: Any) -> None:
        """Count only this optimizer's step() as the end of a step."""
        self.boundaries.use_optimizer(optimizer)

    def manual_step(self) -> None:
        """End a step by hand (`distanom.step()`)."""
        self.boundaries.manual_step()

    @property
    def counted_optimizer(self) -> Any:
        """The optimizer whose step() ends a step, None until one is known."""
        return self.boundaries.counted_optimizer

    # -- views of the parts ------------------------------------------------------------

    @property
    def run(self) -> RunDir | None:
        """The run directory, once the control thread has opened it."""
        return self.control.run

    @property
    def detector(self) -> Detector:
        """The anomaly detector the control thread feeds."""
        return self.control.detector

    @property
    def tracer(self) -> Tracer | None:
        """The running tracer, None before the first step or after a failure."""
        return self.boundaries.tracer

    @tracer.setter
    def tracer(self, tracer: Tracer | None) -> None:
        self.boundaries.use_tracer(tracer)

    @property
    def tracer_note(self) -> str:
        """One line on the tracer backend (or why there is none)."""
        return self.boundaries.tracer_note

    @property
    def clock(self) -> StepClock | None:
        """The step clock, None before the first step or after a failure."""
        return self.boundaries.clock

    @clock.setter
    def clock(self, clock: StepClock | None) -> None:
        if clock is None:
            self.boundaries.clock = None
        else:
            self.boundaries.use_clock(clock)  # a deferred one is then collected

    @property
    def capture(self) -> CaptureWorker | None:
        """The capture worker, made at the first capture decision."""
        return self.health.capture

    @capture.setter
    def capture(self, capture: CaptureWorker | None) -> None:
        self.health.capture = capture

    def tracer_report(self) -> TracerReport:
        """Backend, duty cycle and measured overhead, as written to the status file."""
        return self.control.tracer_report()

    # -- shutdown ----------------------------------------------------------------------

    def _end_line(self, outcome: str, exit_code: int) -> str:
        stats = self.health.capture.stats if self.health.capture else None
        duty = self.duty.report() or {}
        run = self.run
        where = None
        if run is not None:
            where = str(self._run_base_given / run.path.name)
        if where is not None and self.health.check_run_dir():
            where += " (removed during the run)"
        return end_line(
            outcome=outcome if outcome == "finished" else f"{outcome} (exit status {exit_code})",
            steps=self.boundaries.current_step,
            skipped=self.boundaries.skipped_steps,
            kept=stats.kept if stats else 0,
            bytes_written=stats.bytes_written if stats else 0,
            missed=stats.missed if stats else 0,
            where=where,
            overhead_pct=duty.get("measured_overhead_pct"),
            capture_ms=self.boundaries.last_busy_ns / 1e6,
            replaced=stats.dropped if stats else 0,
        )

    def close(self, *, outcome: str = "finished", exit_code: int = 0) -> None:
        """End of training: flush what is pending, within `analysis.exit_timeout_s`;
        the run's state becomes `outcome` (finished, failed, interrupted) with `exit_code`."""
        global _ACTIVE
        boundaries = self.boundaries
        if boundaries.closed:
            return
        boundaries.closed = True
        self.hang.stop()  # training is over: no more steps to wait for
        self.control.set_outcome(outcome, exit_code)
        boundaries.remove_hook()
        tracer = boundaries.tracer
        drain_s = max(self.config.analysis.exit_timeout_s, EXIT_DRAIN_FLOOR_S)
        deadline = time.monotonic() + drain_s
        # stops the tracer on this thread, unless the GPU never reached the last step
        gpu_done = boundaries.drain(drain_s)
        self._inbox.put(FINAL)
        if self.control.is_alive():
            remaining = max(0.0, deadline - time.monotonic())
            self.control.join(remaining + FINAL_ROUND_TIMEOUT_S)
            if self.control.is_alive():
                log.warning("distanom: background work still running at exit; abandoned")
        if tracer is not None and gpu_done:  # else its close could wait on the GPU too
            with contextlib.suppress(Exception):
                tracer.close()
        self.control.close()
        boundaries.gc_pauses.uninstall()
        with contextlib.suppress(Exception):
            log.info(self._end_line(outcome, exit_code), extra=HEADLINE)
        if _ACTIVE is self:
            _ACTIVE = None
        sys.stderr.flush()
