"""The portable tracer: torch.profiler (Kineto), CUDA activities on GPU, CPU ops without one.

The profiler runs in cycles of `kineto_window_steps` steps. At the end of each cycle
torch hands over the cycle's results; they are kept, unexported, for the last
`history_steps` steps. When a step is to be captured, its window is exported once on
the capture thread and the step is cut out of it:

- GPU events belong to the step whose host interval contains their launch call
  (`cuda_runtime`/`cuda_driver` event with the same correlation id), so a kernel that
  runs late is still counted in the step that launched it; GPU events without a launch
  record fall back to their own timestamp.
- Host events (CPU ops, runtime calls, annotations) belong to the step whose host
  interval contains their start.

Step intervals come from `mark_step`'s host timestamps (`time.time_ns()`, the clock
Kineto's `baseTimeNanoseconds` + `ts` uses). Costs: Kineto records every runtime call,
so on kernel-dense GPU steps it is the expensive backend (see reference measurements).
With CUDA activities a window is written to a private (0700) temporary folder as soon as its
cycle ends: exported after the next cycle has started, torch can give its GPU and
runtime events timestamps near zero instead of Unix-epoch times (docs/cupti.md), which
no cut can use. Without CUDA the export waits until a capture needs it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import orjson
import torch

from distanom.config import TracerConfig
from distanom.tracers.base import Availability, StepTrace

log = logging.getLogger(__name__)

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
FLOW_CATEGORY = "ac2g"
KINETO_QUIET_LEVEL = "6"  # above Kineto's highest level (USDT = 5): nothing printed
# A step whose wall-clock and monotonic lengths differ by more than this saw a clock step.
CLOCK_JUMP_NS = 20_000_000
# Kineto's own top-level keys that a step trace keeps unchanged.
KEPT_METADATA = (
    "schemaVersion",
    "deviceProperties",
    "cupti_version",
    "cuda_runtime_version",
    "cuda_driver_version",
    "displayTimeUnit",
    "trace_id",
)


@dataclass
class _Window:
    first_step: int
    last_step: int
    results: Any  # torch.autograd.profiler.profile, holding unexported kineto results
    document: dict[str, Any] | None = None  # parsed export, kept after the first cut
    saved: str | None = None  # the window's JSON, written when its cycle ended (CUDA)


class KinetoTracer:
    """torch.profiler backend; see the module docstring."""

    name = "kineto"

    def __init__(self, config: TracerConfig, *, use_cuda: bool) -> None:
        self._config = config
        self._use_cuda = use_cuda
        self._window_steps = config.kineto_window_steps
        self._lock = threading.Lock()
        self._windows: list[_Window] = []
        # step -> (host end, time.time_ns(); same instant, time.monotonic_ns())
        self._boundaries: dict[int, tuple[int, int]] = {}
        self._profiler: Any = None
        self._window_first: int | None = None
        self._traced_steps: set[int] = set()
        self._last_step: int | None = None
        self._closed = False
        self.boundary_flushes = 0  # windows handed over at a step boundary (costly)
        self._scratch_dir: str | None = None

    # -- training thread -------------------------------------------------------------

    def start(self) -> None:
        """Begin recording; called right after `mark_step` of the step before the first
        traced one."""
        quiet_kineto()
        self._start_profiler()

    def _start_profiler(self) -> None:
        activities = [
            torch.profiler.ProfilerActivity.CUDA
            if self._use_cuda
            else torch.profiler.ProfilerActivity.CPU
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "won't be using warmup": intended, steps are cycles
            schedule = torch.profiler.schedule(
                wait=0, warmup=0, active=self._window_steps, repeat=0
            )
            self._profiler = torch.profiler.profile(
                activities=activities,
                schedule=schedule,
                on_trace_ready=self._on_window,
                record_shapes=False,
                with_stack=False,
                profile_memory=False,
            )
            self._profiler.start()
        self._window_first = None if self._last_step is None else self._last_step + 1

    def mark_step(self, step: int, host_end_ns: int) -> None:
        """Step `step` ended: record the boundary and advance the profiler schedule (which hands a
        full window over)."""
        with self._lock:
            self._boundaries[step] = (host_end_ns, time.monotonic_ns())
            self._last_step = step
            self._trim()
        if self._profiler is None:
            return
        if self._window_first is None:
            self._window_first = step + 1  # started before any boundary: this step is partial
        elif step >= self._window_first:
            self._traced_steps.add(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._profiler.step()

    def _on_window(self, prof: Any) -> None:
        if self._window_first is None or self._last_step is None:
            return
        self.boundary_flushes += 1
        window = _Window(self._window_first, self._last_step, prof.profiler)
        self._window_first = self._last_step + 1
        if self._use_cuda:
            window.saved = _save(prof.profiler, self._scratch())
            window.results = None  # the file is the window now
        with self._lock:
            if window.last_step >= window.first_step:
                self._windows.append(window)
            self._trim()

    def _stop_profiler(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                profiler.stop()  # hands over the partial window through _on_window

    @property
    def tracing(self) -> bool:
        """Whether the step after the last boundary is being recorded."""
        return self._profiler is not None

    @property
    def quiet(self) -> bool:
        """Off: `mark_step` only notes the boundary (no window to hand over)."""
        return self._profiler is None

    def end_of_training(self) -> None:
        """Hand over the last partial window. torch.profiler's stop synchronizes the
        device: the agent calls this only once the GPU has passed the last boundary."""
        self.set_tracing(False)

    def set_tracing(self, on: bool) -> None:
        """Called at a step boundary (after `mark_step`): stopping hands over the window
        so far, so the steps already ended stay capturable."""
        if on and self._profiler is None and not self._closed:
            self._start_profiler()
        elif not on:
            self._stop_profiler()

    def _trim(self) -> None:
        """Forget windows and boundaries older than the history (lock held)."""
        if self._last_step is None:
            return
        oldest = self._last_step - self._config.history_steps
        while self._windows and self._windows[0].last_step < oldest:
            _discard(self._windows.pop(0))
        # Called at every boundary, traced or not: the boundary marks each step once, in
        # step order, so the dict's first keys are the oldest and one leaves as one comes
        # (a full sweep would cost every boundary the whole history). The traced steps
        # empty out during untraced stretches, and are swept only while there are some.
        boundaries = self._boundaries
        while boundaries:
            first = next(iter(boundaries))
            if first >= oldest - 1:
                break
            del boundaries[first]
        if self._traced_steps:
            self._traced_steps = {s for s in self._traced_steps if s >= oldest}

    # -- capture thread --------------------------------------------------------------

    def _windows_for(self, step: int) -> list[_Window] | None:
        """The window holding `step`, and on GPU also the next one: CUDA activity still in
        flight when a cycle stops (the GPU runs behind the host) is delivered with a
        later cycle. None while a needed window is still open."""
        for position, window in enumerate(self._windows):
            if window.first_step <= step <= window.last_step:
                if not self._use_cuda:
                    return [window]
                if position + 1 < len(self._windows):
                    return [window, self._windows[position + 1]]
                return [window] if self._profiler is None else None
        return None

    def availability(self, step: int) -> Availability:
        """Whether `step_trace(step)` can answer now."""
        with self._lock:
            if self._windows_for(step) is not None and step - 1 in self._boundaries:
                return Availability.READY
            if self._closed or self._last_step is None:
                return Availability.GONE
            oldest = self._last_step - self._config.history_steps
            if step < oldest or (step <= self._last_step and step not in self._traced_steps):
                return Availability.GONE
            return Availability.PENDING

    def step_trace(self, step: int) -> StepTrace:
        """The events of `step` as a `StepTrace`; KeyError unless it is READY."""
        with self._lock:
            windows = self._windows_for(step)
            start = self._boundaries.get(step - 1)
            end = self._boundaries.get(step)
        if windows is None or start is None or end is None:
            raise KeyError(step)
        start_ns, end_ns = start[0], end[0]
        wall_ns, mono_ns = end[0] - start[0], end[1] - start[1]
        jumped = abs(wall_ns - mono_ns) > CLOCK_JUMP_NS
        if jumped:  # the wall clock was stepped during this step: trust the monotonic length
            end_ns = start_ns + mono_ns
        documents = []
        for window in windows:
            window.document = window.document or _load(window, self._scratch())
            documents.append(window.document)  # kept: a second cut from it is cheap
        trace = cut_step(documents, step, start_ns, end_ns)
        if jumped:
            trace.stats["clock_jump"] = 1
        return trace

    def _scratch(self) -> str:
        """A private folder (mode 0700) for window files, removed at close. Every export
        goes here, never to the shared temporary folder: torch writes `<name>.tmp` beside
        the file and follows a link planted there (docs/trust.md)."""
        if self._scratch_dir is None:
            self._scratch_dir = tempfile.mkdtemp(prefix="distanom-kineto-")
        return self._scratch_dir

    def stats(self) -> dict[str, int]:
        """Windows handed over so far (the kineto backend counts nothing else)."""
        return {"boundary_flushes": self.boundary_flushes}

    def close(self) -> None:
        """Stop the profiler, drop the windows and the scratch folder. Idempotent."""
        if self._closed:
            return
        with contextlib.suppress(Exception):
            self._stop_profiler()
        with self._lock:
            self._closed = True
            for window in self._windows:
                _discard(window)
            self._windows.clear()
        if self._scratch_dir is not None:
            shutil.rmtree(self._scratch_dir, ignore_errors=True)


def quiet_kineto() -> None:
    """Keep Kineto from printing a `USDT ... profiler_start/stop` line to stderr at every
    profiler cycle: its levels end at USDT (5), and Kineto reads `KINETO_LOG_LEVEL` when
    the profiler first starts. A level the user set, or distanom's DEBUG level, keeps
    Kineto's lines."""
    if "KINETO_LOG_LEVEL" not in os.environ and not log.isEnabledFor(logging.DEBUG):
        os.environ["KINETO_LOG_LEVEL"] = KINETO_QUIET_LEVEL


def _save(results: Any, folder: str) -> str:
    """Write one window's Kineto results with torch's own JSON writer; returns the path."""
    fd, path = tempfile.mkstemp(prefix="window-", suffix=".json", dir=folder)
    os.close(fd)
    results.kineto_results.save(path)
    return path


def _load(window: _Window, folder: str) -> dict[str, Any]:
    """The parsed export of a window (written now into the private `folder` if its cycle
    did not write it)."""
    path = window.saved
    temporary = path is None
    if path is None:
        path = _save(window.results, folder)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
        # on the capture worker, holding the GIL while it parses: orjson takes a fraction
        # of json's time; what it refuses (a NaN constant) json still reads
        try:
            document: dict[str, Any] = orjson.loads(data)
        except orjson.JSONDecodeError:
            document = json.loads(data)
        return document
    finally:
        if temporary:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _discard(window: _Window) -> None:
    if window.saved is not None:
        with contextlib.suppress(OSError):
            os.unlink(window.saved)


def cut_step(documents: list[dict[str, Any]], step: int, start_ns: int, end_ns: int) -> StepTrace:
    """Select the events of the step whose host interval is [start_ns, end_ns).

    The documents are consecutive window exports, pooled: a host event belongs to the
    step if it starts inside the interval, a GPU event if its launch call does (matched
    by correlation id, in whichever document each was delivered), or, with no launch
    record at all, if it starts inside the interval itself.
    """
    main = documents[0]
    base_ns = int(main.get("baseTimeNanoseconds", 0))
    start_us = (start_ns - base_ns) / 1000.0
    end_us = (end_ns - base_ns) / 1000.0

    def inside(ts: Any) -> bool:
        return isinstance(ts, (int, float)) and start_us <= ts < end_us

    pooled: list[dict[str, Any]] = []
    for document in documents:
        shift_us = (int(document.get("baseTimeNanoseconds", base_ns)) - base_ns) / 1000.0
        for event in document.get("traceEvents", []):
            if shift_us and isinstance(event.get("ts"), (int, float)):
                event = {**event, "ts": event["ts"] + shift_us}
            pooled.append(event)

    launched: set[Any] = set()
    launch_ids: set[Any] = set()
    for event in pooled:
        if event.get("cat") in LAUNCH_CATEGORIES:
            correlation = (event.get("args") or {}).get("correlation")
            if correlation is None:
                continue
            launch_ids.add(correlation)
            if inside(event.get("ts")):
                launched.add(correlation)

    kept: list[dict[str, Any]] = [e for e in main.get("traceEvents", []) if e.get("ph") == "M"]
    seen: set[tuple[Any, ...]] = set()
    stats = {"gpu_events": 0, "gpu_by_launch": 0, "gpu_by_time": 0, "outside_bounds": 0}
    for event in pooled:
        category = event.get("cat")
        if event.get("ph") == "M":
            continue
        key = (category, event.get("name"), event.get("ts"), event.get("pid"), event.get("tid"))
        if key in seen:  # the same event delivered twice
            continue
        if category in GPU_CATEGORIES:
            correlation = (event.get("args") or {}).get("correlation")
            if correlation in launched:
                stats["gpu_by_launch"] += 1
            elif correlation not in launch_ids and inside(event.get("ts")):
                stats["gpu_by_time"] += 1
            else:
                continue
            stats["gpu_events"] += 1
            if not start_us <= event.get("ts", start_us) <= end_us:
                stats["outside_bounds"] += 1  # launched in this step, ran after its host end
        elif category == FLOW_CATEGORY:
            if event.get("id") not in launched:
                continue
        elif str(event.get("name", "")).startswith("ProfilerStep#"):
            continue  # the profiler's own cycle counter, not our step number: misleading
        elif not inside(event.get("ts")):
            continue
        seen.add(key)
        kept.append(event)
    kept.append(_step_annotation(step, start_us, end_us, kept))
    metadata = {key: main[key] for key in KEPT_METADATA if key in main}
    if "distributedInfo" in main:
        metadata["distributedInfo"] = main["distributedInfo"]
    return StepTrace(step=step, events=kept, base_time_ns=base_ns, metadata=metadata, stats=stats)


def _step_annotation(
    step: int, start_us: float, end_us: float, events: list[dict[str, Any]]
) -> dict[str, Any]:
    """A span naming the step on the host timeline, so Perfetto shows where it starts and ends."""
    host_pid: Any = os.getpid()
    for event in events:
        if event.get("cat") in LAUNCH_CATEGORIES or event.get("cat") == "cpu_op":
            host_pid = event.get("pid", host_pid)
            break
    return {
        "ph": "X",
        "cat": "user_annotation",
        "name": f"distanom step {step}",
        "pid": host_pid,
        "tid": 0,
        "ts": start_us,
        "dur": end_us - start_us,
        "args": {"step": step},
    }
