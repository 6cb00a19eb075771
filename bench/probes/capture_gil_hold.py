"""How long a capture's write keeps a launch-bound training thread waiting, paced or not.

    python3 bench/probes/capture_gil_hold.py [--events 5000,20000] [--reps 6] [--out FILE]

One process. A "training" thread runs steps of pure Python (~1 ms each, holding the GIL
like a launch-bound loop) and records each step's time. Meanwhile a real `CaptureWorker`
writes captures of a synthetic trace of N kernel events, alternately with its pauses on
(as shipped: `pacing.slice_pause_s` between slices of the encode) and off (the same
worker with `_pause` doing nothing: the encode holds the GIL throughout, as before).
Per variant: the training steps that overlapped a capture, their worst time, and how many
were over 1.5x and 3x the median step (what the detector would see). Runs on CPU; on a
GPU host the numbers are the host's, as the CUDA loop's would be.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from distanom.capture import CaptureWorker
from distanom.config import load_config
from distanom.detect import CaptureDecision
from distanom.health import Health
from distanom.records.index import read_index
from distanom.rundir import RunDir, create_run
from distanom.tracers.base import Availability, StepTrace
from distanom.world import WorldInfo

STEP_WORK = 20000  # Python loop iterations a training step: ~1-2 ms on the hosts tried


class SyntheticTracer:
    """Every step READY, each holding `events` kernel events shaped like cupti's."""

    name = "synthetic"

    def __init__(self, events: int) -> None:
        self.events = events
        self._events: list[dict[str, Any]] | None = None

    def availability(self, step: int) -> Availability:
        return Availability.READY

    def step_trace(self, step: int) -> StepTrace:
        # built once, before the capture is timed: the decode is the tracer's (cupti's
        # took ~1 ms a capture on the H200), the encode and write are the worker's
        events = self._events or [
            {
                "ph": "X",
                "cat": "kernel",
                "name": "void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>",
                "pid": 0,
                "tid": 7,
                "ts": 1_700_000_000_000.125 + i,
                "dur": 3.2,
                "args": {"correlation": i, "stream": 7, "device": 0, "grid": [1, 1, 1]},
            }
            for i in range(self.events)
        ]
        return StepTrace(step=step, events=events, base_time_ns=0, metadata={}, stats={})


class UnpacedWorker(CaptureWorker):
    """The worker as it was: no pause anywhere in a capture's write."""

    def _pause(self, pause_s: float) -> None:
        return


def training(stop: threading.Event, spans: list[tuple[int, int]]) -> None:
    while not stop.is_set():
        began = time.perf_counter_ns()
        total = 0
        for i in range(STEP_WORK):
            total += i * i
        spans.append((began, time.perf_counter_ns()))


def one_capture(
    worker_type: type[CaptureWorker], events: int, step: int, median_ms: float
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(create_run(Path(tmp), "probe"))
        config = load_config(None, ["analysis.on_capture=report"])
        tracer = SyntheticTracer(events)
        tracer._events = tracer.step_trace(0).events
        worker = worker_type(
            run,
            WorldInfo.from_env({}),
            tracer,  # type: ignore[arg-type]
            config,
            tracer_name="synthetic",
            warn=Health().warn_write_failed,
        )
        spans: list[tuple[int, int]] = []
        stop = threading.Event()
        thread = threading.Thread(target=training, args=(stop, spans))
        thread.start()
        time.sleep(0.3)  # the training thread's own median first
        began = time.perf_counter_ns()
        worker.submit(
            [
                CaptureDecision(
                    step, "anomaly", 3 * median_ms, median_ms, 1.5 * median_ms, slowest_rank=0
                )
            ]
        )
        deadline = time.monotonic() + 30
        while not read_index(run)[0] and time.monotonic() < deadline:
            time.sleep(0.005)
        ended = time.perf_counter_ns()
        time.sleep(0.05)
        stop.set()
        thread.join()
        worker.close(1.0)
        [written] = read_index(run)[0]
    before = [(b - a) / 1e6 for a, b in spans if b < began]
    median = statistics.median(before)
    during = [(b - a) / 1e6 for a, b in spans if b > began and a < ended]
    return {
        "median_step_ms": round(median, 3),
        "steps_during": len(during),
        "capture_wall_ms": round((ended - began) / 1e6, 1),
        "worst_step_ms": round(max(during), 2) if during else None,
        "worst_ratio": round(max(during) / median, 2) if during else None,
        "over_1.5x": sum(d > 1.5 * median for d in during),
        "over_3x": sum(d > 3 * median for d in during),
        "cost_ms": written.raw.get("cost_ms"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", default="5000,20000")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    # the training step's median, for the decision (the pause is one median step)
    spans: list[tuple[int, int]] = []
    stop = threading.Event()
    thread = threading.Thread(target=training, args=(stop, spans))
    thread.start()
    time.sleep(0.5)
    stop.set()
    thread.join()
    median_ms = statistics.median((b - a) / 1e6 for a, b in spans)
    runs: list[dict[str, Any]] = []
    for events in (int(n) for n in args.events.split(",")):
        for rep in range(args.reps):
            order = [("paced", CaptureWorker), ("unpaced", UnpacedWorker)]
            for variant, worker_type in order if rep % 2 == 0 else order[::-1]:
                found = one_capture(worker_type, events, 10 + rep, median_ms)
                runs.append({"events": events, "variant": variant, "rep": rep, **found})
                print(json.dumps(runs[-1]), flush=True)
    summary: dict[str, Any] = {}
    for events in sorted({r["events"] for r in runs}):
        for variant in ("paced", "unpaced"):
            mine = [r for r in runs if r["events"] == events and r["variant"] == variant]
            summary[f"{variant}_{events}"] = {
                "worst_ratio_median": statistics.median(r["worst_ratio"] for r in mine),
                "worst_ratio_max": max(r["worst_ratio"] for r in mine),
                "over_1.5x_per_capture": statistics.mean(r["over_1.5x"] for r in mine),
                "over_3x_per_capture": statistics.mean(r["over_3x"] for r in mine),
                "capture_wall_ms_median": statistics.median(r["capture_wall_ms"] for r in mine),
            }
    result = {
        "bench": "capture_gil_hold",
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "median_step_ms": round(median_ms, 3),
        "summary": summary,
        "runs": runs,
    }
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
