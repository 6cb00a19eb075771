"""CaptureWorker against a tracer whose steps can vanish between two calls."""

from __future__ import annotations

import time
from pathlib import Path

from distanom.capture import CaptureWorker
from distanom.config import load_config
from distanom.detect import CaptureDecision
from distanom.rundir import RunDir, create_run
from distanom.tracers.base import Availability, StepTrace
from distanom.world import WorldInfo


class VanishingTracer:
    """READY when asked, gone when read: the step aged out of the history in between."""

    name = "vanishing"

    def __init__(self) -> None:
        self.reads = 0

    def availability(self, step: int) -> Availability:
        return Availability.READY

    def step_trace(self, step: int) -> StepTrace:
        self.reads += 1
        if step == 5:
            raise KeyError(f"step {step} is gone: older than history_steps")
        return StepTrace(step=step, events=[], base_time_ns=0, metadata={}, stats={})


def decision(step: int) -> CaptureDecision:
    return CaptureDecision(step, "anomaly", 30.0, 10.0, 15.0, slowest_rank=0)


def test_a_step_gone_between_two_calls_is_missed_and_capture_goes_on(tmp_path: Path) -> None:
    run = RunDir(create_run(tmp_path, "race"))
    config = load_config(None, ["analysis.on_capture=report"])
    tracer = VanishingTracer()
    worker = CaptureWorker(run, WorldInfo.from_env({}), tracer, config, tracer_name="vanishing")
    worker.submit([decision(5), decision(9)])
    deadline = time.monotonic() + 10
    while tracer.reads < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.close(5.0)
    assert worker.active, worker.stats.failed
    assert worker.stats.missed == 1 and worker.stats.missed_steps == [5]
    assert run.trace_path(9, 0).exists() and not run.trace_path(5, 0).exists()
