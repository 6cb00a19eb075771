"""The per-rank agent: ties step clock, tracer, consensus and capture together.

On the training thread it does the least possible at each step end (one timestamp, one
CUDA event or host clock read, the tracer's step mark, a queue put). Everything that can
block (forming distanom's group, creating the run directory, the all-gather of step
times, the capture decisions, writing status) runs on the `distanom-control` thread;
trace files are written by the capture worker's thread. Any failure in distanom is
logged once and switches the failing part off: training keeps running and keeps its
own exit code.

Step boundaries: step N is the N-th `optimizer.step()` of the counted optimizer, from 0,
or `distanom.step()` for loops without one. With several optimizers, the first one that
steps is counted unless `step.optimizer` names a class or the script calls
`distanom.use_optimizer(opt)`. A global optimizer post-hook finds the counted optimizer
at its first step; from then on a thin wrapper on that instance's `step` marks the
boundary *after* `step()` returns. The post-hook itself runs inside the optimizer's
`record_function` scope, where starting or stepping torch.profiler corrupts memory
(seen as a crash on torch 2.13), so no tracer work ever happens there.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import platform
import queue
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, NamedTuple

import torch

import distanom
from distanom.capture import CaptureWorker
from distanom.clock import StepClock, resolve_mode
from distanom.config import Config
from distanom.consensus import (
    FLAG_CAPTURE_OFF,
    FLAG_FINAL,
    CaptureRequest,
    LocalRound,
    RoundBuilder,
    RoundResult,
    decide,
    decode_round,
    encode_round,
    recent_times,
)
from distanom.control import answer, pending_requests, validate_request, write_status
from distanom.detect import (
    STEP_AFTER_FLUSH,
    STEP_DISTURBED,
    STEP_TRACED,
    CaptureDecision,
    Detector,
    StepSample,
)
from distanom.errors import CaptureRequestError, RunDirError
from distanom.gc_pauses import GcPauses
from distanom.governor import GovernorNotReadyError, GovernorParams, OverheadGovernor
from distanom.rundir import (
    STEPS_CSV_HEADER,
    RunDir,
    create_run,
    json_number,
    update_latest,
    write_json_atomic,
)
from distanom.tracers import Tracer, create_tracer
from distanom.world import AgentGroup, GroupUnavailableError, WorldInfo

log = logging.getLogger(__name__)

_ACTIVE: Agent | None = None
_FINAL = object()  # inbox sentinel: training is over
RECENT_STEPS = 64
FINAL_ROUND_TIMEOUT_S = 10.0
# The last step boundaries are normally a few ms behind the host: wait for them at least
# this long at exit even when analysis.exit_timeout_s is 0.
EXIT_DRAIN_FLOOR_S = 5.0


class StepRecord(NamedTuple):
    """One resolved step, from the training thread to the control thread."""

    step: int
    duration_ms: float
    flags: int  # STEP_* bits
    self_ms: float  # distanom's capture work during the step
    gc_ms: float  # Python garbage collection during the step (host time)
    gc_generation: int  # the highest generation collected, -1 for none


def active_agent() -> Agent | None:
    return _ACTIVE


class Agent:
    """One per rank; see the module docstring."""

    def __init__(
        self, config: Config, world: WorldInfo, run_base: Path, argv: list[str] | None = None
    ) -> None:
        self.config = config
        self.world = world
        self.run_base = run_base
        self.argv = list(argv or [])
        self.current_step = 0
        self.run: RunDir | None = None
        self.tracer: Tracer | None = None
        self.tracer_note = "tracer: not started"
        self.capture: CaptureWorker | None = None
        self.detector = Detector(config.detect, config.capture)
        self.clock: StepClock | None = None
        self._optimizer_ref: weakref.ref[Any] | None = None
        self._manual = config.step.source == "manual"
        self._hook_handle: Any = None
        self._inside_counted_step = False
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._step_flags: dict[int, int] = {}  # STEP_* bits of steps not yet resolved
        self._next_after_flush = False  # the tracer flushed at the last boundary
        self._first_boundary_done = False
        self._boundaries_off = False  # step bookkeeping failed: training goes on unwatched
        self._last_busy_ns = 0
        self._self_ms: dict[int, float] = {}  # capture work during steps not yet resolved
        self._gc_pauses = GcPauses()
        self._gc: dict[int, tuple[float, int]] = {}  # collections during steps not yet resolved
        self._tracing_during = False  # whether the tracer records the step in progress
        self._tracer_started = False
        self._closed = False
        self._warned: set[str] = set()
        self._capture_off_reason: str | None = None
        self._consensus_error: str | None = None
        self._group: AgentGroup | None = None
        self._recent: collections.deque[StepSample] = collections.deque(maxlen=RECENT_STEPS)
        self._gathered_step = -1
        self._request_numbers: dict[int, str] = {}
        self._next_request_number = 1
        self._offered_request: tuple[CaptureRequest, str] | None = None
        self._steps_file: Any = None
        self._started_at = time.time()
        # The duty cycle: fed with gathered data on the control thread, asked on the
        # training thread; every rank computes the same schedule from the same data.
        self._governor: OverheadGovernor | None = None
        if config.tracer.backend != "none":
            # decisions wait for gathered data: with rounds of batch_steps steps, a lag
            # shorter than a round would leave the governor unready at window boundaries,
            # and the switch would come late, mid-window
            params = GovernorParams(lag_steps=config.consensus.batch_steps + 4)
            self._governor = OverheadGovernor.from_config(config.tracer, params, first_step=1)
        self._governor_lock = threading.Lock()
        self._forced_on: set[int] = set()  # requested steps: traced whatever the duty cycle
        self._control = threading.Thread(
            target=self._control_main, name="distanom-control", daemon=True
        )

    # -- installation ------------------------------------------------------------------

    def install(self) -> None:
        global _ACTIVE
        _ACTIVE = self
        from distanom.analysis import trace_io

        trace_io.PAUSE_GC_DURING_LOAD = False  # never touch the GC of the training process
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._hook_handle = register_optimizer_step_post_hook(self._on_optimizer_step)
        self._control.start()
        self._gc_pauses.install()  # last: nothing after it can fail and leave it installed

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    # -- training thread ---------------------------------------------------------------

    def use_optimizer(self, optimizer: Any) -> None:
        if self._optimizer_ref is not None and self._optimizer_ref() is optimizer:
            return
        self._optimizer_ref = weakref.ref(optimizer)
        self._wrap_step(optimizer)

    def _wrap_step(self, optimizer: Any) -> None:
        """Mark boundaries after this optimizer's step() returns (outside its profiler scope)."""
        original = optimizer.step  # bound method, or an LR scheduler's instance wrapper
        agent = self

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            agent._inside_counted_step = True
            try:
                result = original(*args, **kwargs)
            finally:
                agent._inside_counted_step = False
            if (
                not agent._manual
                and agent._optimizer_ref is not None
                and agent._optimizer_ref() is optimizer
            ):
                agent._boundary()
            return result

        optimizer.step = step

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._manual or self._inside_counted_step or self._optimizer_ref is not None:
            return
        wanted = self.config.step.optimizer
        if wanted is not None and type(optimizer).__name__ != wanted:
            return
        # First step of the counted optimizer: from now on its wrapper marks boundaries.
        self._optimizer_ref = weakref.ref(optimizer)
        self._wrap_step(optimizer)
        self._boundary(inside_optimizer=True)

    def manual_step(self) -> None:
        if not self._manual:
            self._manual = True  # the script marks steps itself: optimizer hooks would double count
            log.info("distanom.step() called: steps are counted by it, not by optimizer.step()")
        self._boundary()

    def _boundary(self, *, inside_optimizer: bool = False) -> None:
        if self._closed or self._boundaries_off:
            return
        try:
            self._boundary_unguarded(inside_optimizer)
        except Exception as err:  # the last line of defence: never raise into training
            self._warn_once("boundary", "distanom: step bookkeeping failed (%s); disabled", err)
            self._boundaries_off = True  # close() still stops the tracer and finishes
            tracer = self.tracer
            if tracer is not None:
                with contextlib.suppress(Exception):
                    tracer.set_tracing(False)  # unwatched: tracing would only cost

    def _boundary_unguarded(self, inside_optimizer: bool) -> None:
        step = self.current_step
        self.current_step = step + 1
        host_ns = time.time_ns()
        if not self._first_boundary_done:
            self._first_boundary_done = True  # once: a later clock failure re-creates nothing
            self._first_boundary()
        resolved: list[tuple[int, float]] = []
        if self.clock is not None:
            try:
                resolved = self.clock.mark(step)
            except Exception as err:
                self._warn_once("clock", "clock: step timing failed (%s); detection stops", err)
                self.clock = None
        self_ms = self._self_ms_of_ended_step()
        self._step_flags[step] = self._flags_of_ended_step() | (STEP_DISTURBED if self_ms else 0)
        if self_ms:
            self._self_ms[step] = self_ms
        gc_ms, gc_generation = self._gc_pauses.take()
        if gc_ms > 0:
            self._gc[step] = (gc_ms, gc_generation)
        tracer = self.tracer
        if tracer is not None and not inside_optimizer:
            flushes = tracer.boundary_flushes
            try:
                tracer.mark_step(step, host_ns)
                if not self._tracer_started:
                    self._tracer_started = True
                    tracer.start()
                    self._tracing_during = True
                    log.info(self.tracer_note)
                elif self._capture_is_off():
                    if tracer.tracing:  # nothing will be captured
                        tracer.set_tracing(False)
                else:
                    self._apply_duty_cycle(tracer, step + 1)
                # what is in force for the next step: a backend may defer or refuse a
                # switch, or make one asked for earlier at this boundary
                self._tracing_during = bool(tracer.tracing)
            except Exception as err:
                self._tracer_failed(err)
            self._next_after_flush = tracer.boundary_flushes != flushes
        for resolved_step, duration in resolved:
            self._inbox.put(self._resolved(resolved_step, duration))
        if len(self._step_flags) > 4096:  # boundaries the clock gave up on
            for old in [s for s in self._step_flags if s < step - 2048]:
                del self._step_flags[old]
                self._self_ms.pop(old, None)
                self._gc.pop(old, None)

    def _resolved(self, step: int, duration: float) -> StepRecord:
        """What the control thread gets of a step whose time is known."""
        gc_ms, gc_generation = self._gc.pop(step, (0.0, -1))
        return StepRecord(
            step, duration, self._step_flags.pop(step, 0), self._self_ms.pop(step, 0.0),
            gc_ms, gc_generation,
        )  # fmt: skip

    def _flags_of_ended_step(self) -> int:
        """STEP_* bits of the step that just ended: traced, after a flush, disturbed by
        distanom's own capture work (then it is never judged: no feedback loop)."""
        flags = STEP_TRACED if self._tracing_during else 0
        if self._next_after_flush:
            flags |= STEP_AFTER_FLUSH
        return flags

    def _self_ms_of_ended_step(self) -> float:
        """How long distanom's capture work ran during the step that just ended."""
        capture = self.capture
        if capture is None:
            return 0.0
        # monotone: a reading that ran a little ahead of the worker (it read a lookup
        # as heavy just before the worker measured it under the threshold) is absorbed
        # by later work instead of giving a step a negative share
        busy = max(capture.busy_ns(), self._last_busy_ns)
        spent, self._last_busy_ns = busy - self._last_busy_ns, busy
        return spent / 1e6

    def _apply_duty_cycle(self, tracer: Tracer, next_step: int) -> None:
        """Switch tracing on or off for the next step as the governor decided."""
        governor = self._governor
        for past in [s for s in list(self._forced_on) if s < next_step]:
            self._forced_on.discard(past)  # scheduled after the host had passed them
        if next_step in self._forced_on:
            self._forced_on.discard(next_step)
            want = True
        elif governor is None:
            return
        else:
            with self._governor_lock:
                if not governor.ready(next_step):
                    return  # gathered data lag behind: keep the current state
                try:
                    want = governor.tracing_on(next_step)
                except GovernorNotReadyError:
                    return
        if want != bool(tracer.tracing):
            tracer.set_tracing(want)
            self._tracing_during = want

    def _first_boundary(self) -> None:
        try:
            mode = resolve_mode(self.config.clock.mode)
            self.clock = StepClock(mode)
        except Exception as err:
            self._warn_once("clock", "clock: cannot time steps (%s); detection stops", err)
            return
        use_cuda = mode in ("cuda_event", "host_sync") or (
            torch.cuda.is_available() and torch.cuda.is_initialized()
        )
        try:
            self.tracer, self.tracer_note = create_tracer(
                self.config.tracer, rank=self.world.rank, use_cuda=use_cuda
            )
        except Exception as err:
            self._warn_once("tracer", "tracer: cannot be created (%s); detection only", err)
            self.tracer, self.tracer_note = None, f"tracer: none ({err})"
        if self.tracer is None:
            log.info(self.tracer_note)

    def _tracer_failed(self, err: BaseException) -> None:
        self._warn_once("tracer", "tracer: failed (%s); capture steps aside", err)
        tracer, self.tracer = self.tracer, None
        self._tracing_during = False
        if tracer is not None:
            with contextlib.suppress(Exception):
                tracer.close()

    # -- control thread ----------------------------------------------------------------

    def _control_main(self) -> None:
        try:
            self._setup()
        except (GroupUnavailableError, RunDirError, OSError, RuntimeError) as err:
            self._consensus_error = f"setup failed: {err}"
            self._warn_once("setup", "distanom: %s; capture steps aside", self._consensus_error)
            self._drain_until_final()
            return
        finished = False
        try:
            self._round_loop()
            finished = True
        except GroupUnavailableError as err:
            self._consensus_error = str(err)
            self._warn_once(
                "consensus",
                "consensus: %s (a rank gone or too slow); capture steps aside",
                err,
            )
        except Exception as err:
            self._consensus_error = f"internal error: {err}"
            log.exception("consensus: internal error; capture steps aside")
        if not finished:
            self._drain_until_final()
        self._finish_capture()
        if self.world.rank == 0:
            self._write_status("finished")

    def _drain_until_final(self) -> None:
        """Without consensus: keep consuming the inbox (the training thread must never fill
        memory) and keep the status fresh until training ends."""
        next_status = 0.0
        while True:
            try:
                item = self._inbox.get(timeout=1.0)
            except queue.Empty:
                item = None
            if item is _FINAL:
                return
            if item is not None:
                self._log_step(item)
            now = time.monotonic()
            if self.world.rank == 0 and now >= next_status:
                next_status = now + self.config.control.status_interval_s
                self._flush_steps()
                self._write_status("running")

    def _setup(self) -> None:
        config, world = self.config, self.world
        self._group = AgentGroup(
            world,
            setup_timeout_s=config.consensus.setup_timeout_s,
            op_timeout_s=config.consensus.timeout_s,
        )
        run_id = ""
        if world.rank == 0:
            try:
                path = create_run(self.run_base, config.run.name)
                run_id = path.name
                with contextlib.suppress(OSError):
                    update_latest(self.run_base, path)
            except RunDirError as err:
                self._capture_off(str(err))
            self._group.publish("run_id", run_id)
        else:
            run_id = self._group.lookup("run_id")
            if not run_id:
                self._capture_off("rank 0 could not create the run directory")
        self._group.publish(f"host/{world.rank}", world.host)
        if not run_id:
            return
        run = RunDir(self.run_base / run_id)
        try:
            run.path.mkdir(parents=True, exist_ok=True)  # other nodes without a shared filesystem
            run.steps_csv(world.rank).parent.mkdir(exist_ok=True)
            self._steps_file = open(run.steps_csv(world.rank), "a", encoding="ascii")  # noqa: SIM115
            if self._steps_file.tell() == 0:
                self._steps_file.write(STEPS_CSV_HEADER)
        except OSError as err:
            self._capture_off(f"{run.path}: not writable ({err.strerror})")
            return
        self.run = run
        if world.rank == 0:
            hosts = [self._group.lookup(f"host/{r}") for r in range(world.world_size)]
            self._write_run_json(hosts)

    def _capture_stepped_aside(self) -> bool:
        """This rank stopped writing captures (no run directory, a failed worker)."""
        capture = self.capture
        return self._capture_off_reason is not None or (capture is not None and not capture.active)

    def _capture_is_off(self) -> bool:
        """Capture is off for the rest of the run: stepped aside, or no consensus."""
        return self._capture_stepped_aside() or self._consensus_error is not None

    def _capture_off(self, reason: str) -> None:
        if self._capture_off_reason is None:
            self._capture_off_reason = reason
            self._warn_once("capture-off", "capture: %s; capture steps aside", reason)

    def _run_json(self, hosts: list[str] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "run_id": self.run.run_id if self.run else None,
            "distanom": distanom.__version__,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "world_size": self.world.world_size,
            "started_at": self._started_at,
            "argv": self.argv,
            "config": self.config.model_dump(mode="json"),
        }
        if hosts is not None:
            body["hosts"] = hosts
            nodes: dict[str, list[int]] = {}
            for rank, host in enumerate(hosts):
                nodes.setdefault(host, []).append(rank)
            body["nodes"] = nodes
        return body

    def _write_run_json(self, hosts: list[str]) -> None:
        if self.run is None:
            return
        try:
            write_json_atomic(self.run.run_json, self._run_json(hosts))
        except OSError as err:
            self._capture_off(f"{self.run.run_json}: cannot write ({err.strerror})")

    def _round_loop(self) -> None:
        builder = RoundBuilder(self.config.consensus.batch_steps)
        control = self.config.control
        next_poll = next_status = 0.0
        final = False
        while not final:
            try:
                item = self._inbox.get(timeout=0.2)
                items = [item]
                with contextlib.suppress(queue.Empty):
                    while True:
                        items.append(self._inbox.get_nowait())
            except queue.Empty:
                items = []
            for item in items:
                if item is _FINAL:
                    final = True
                    continue
                builder.add(item.step, item.duration_ms, item.flags, item.self_ms)
                self._log_step(item)
            self._flush_steps()
            now = time.monotonic()
            if self.world.rank == 0 and now >= next_poll:
                next_poll = now + control.poll_interval_s
                self._poll_requests()
            while builder.ready():
                self._run_round(builder.take(), final=False)
            if final and builder.pending_steps():
                self._run_round(builder.take(final=True), final=True)
            if self.world.rank == 0 and (now >= next_status or final):
                next_status = now + control.status_interval_s
                self._write_status("running")

    def _run_round(self, local: LocalRound, *, final: bool) -> None:
        assert self._group is not None
        flags = FLAG_FINAL if final else 0
        if self._capture_stepped_aside():
            flags |= FLAG_CAPTURE_OFF
        offered = self._offered_request if self.world.rank == 0 else None
        local = LocalRound(
            local.first_step,
            local.durations_ms,
            local.step_flags,
            flags,
            offered[0] if offered else None,
            local.self_ms,
            host_step=self.current_step,
        )
        batch = self.config.consensus.batch_steps
        timeout = None
        if final:
            timeout = min(self.config.consensus.timeout_s, FINAL_ROUND_TIMEOUT_S)
        matrix = self._group.all_gather(encode_round(local, batch), timeout_s=timeout)
        result = decode_round(matrix, batch)
        if offered is not None:
            self._offered_request = None
        self._after_round(result)

    def _after_round(self, result: RoundResult) -> None:
        self._recent.extend(result.samples)
        self._feed_governor(result)
        self._gathered_step = max(self._gathered_step, result.last_step)
        decisions = decide(result, self.detector, self.world.world_size)
        self._forced_on.update(d.step for d in decisions if d.kind == "requested")
        if result.request is not None and self.world.rank == 0:
            self._answer_request(result, decisions)
        if not decisions or self.run is None or self._capture_off_reason is not None:
            return
        if self.capture is None:
            if self.tracer is None:
                self._capture_off("no tracer is running")
                return
            self.capture = CaptureWorker(
                self.run,
                self.world,
                self.tracer,
                self.config,
                tracer_name=self.tracer.name,
            )
        self.capture.submit(decisions)

    def _feed_governor(self, result: RoundResult) -> None:
        governor = self._governor
        if governor is None:
            return
        try:
            with self._governor_lock:
                for sample in result.samples:
                    step_ms = sample.step_ms
                    seconds = step_ms / 1000.0 if math.isfinite(step_ms) else None
                    governor.record(sample.step, seconds, sample.traced, sample.after_flush)
        except ValueError as err:
            self._warn_once("governor", "governor: %s; tracing stays as it is", err)
            self._governor = None

    def tracer_report(self) -> dict[str, Any]:
        """Backend, duty cycle and measured overhead, for the status file."""
        report: dict[str, Any] = {
            "backend": self.tracer.name if self.tracer else None,
            "note": self.tracer_note,
        }
        governor = self._governor
        if governor is not None:
            with self._governor_lock:
                duty = governor.report()
            report["duty_cycle"] = duty
            report["overhead_pct"] = duty.get("measured_overhead_pct")
            report["traced_fraction"] = duty.get("traced_fraction")
        if self.tracer is not None:
            with contextlib.suppress(Exception):
                report["stats"] = self.tracer.stats()
        return report

    def _log_step(self, item: StepRecord) -> None:
        if self._steps_file is None:
            return
        try:
            traced = int(bool(item.flags & STEP_TRACED))
            flushed = int(bool(item.flags & STEP_AFTER_FLUSH))
            self._steps_file.write(
                f"{item.step},{item.duration_ms:.4f},{traced},{flushed},{item.self_ms:.3f},"
                f"{item.gc_ms:.3f},{item.gc_generation}\n"
            )
        except (OSError, ValueError):
            self._steps_file = None

    def _flush_steps(self) -> None:
        if self._steps_file is not None:
            try:
                self._steps_file.flush()
            except OSError as err:
                self._warn_once("steps", "steps file: %s; step times not recorded", err.strerror)
                self._steps_file = None

    # -- on-demand requests (rank 0) ----------------------------------------------------

    def _poll_requests(self) -> None:
        if self.run is None or self._offered_request is not None:
            return
        try:
            requests = pending_requests(self.run)
        except OSError:
            return
        for request in requests:
            if request.request_id in self._request_numbers.values():
                continue
            try:
                validate_request(request.n_steps, request.ranges, self.world.world_size)
            except CaptureRequestError as err:
                answer(self.run, request.request_id, {"status": "refused", "reason": str(err)})
                continue
            number = self._next_request_number
            self._next_request_number += 1
            self._request_numbers[number] = request.request_id
            carried = CaptureRequest(number, request.n_steps, request.ranges)
            self._offered_request = (carried, request.request_id)
            return

    def _answer_request(self, result: RoundResult, decisions: list[CaptureDecision]) -> None:
        request = result.request
        if request is None or self.run is None:
            return
        request_id = self._request_numbers.get(request.number)
        if request_id is None:
            return
        steps = [d.step for d in decisions if d.request_id == str(request.number)]
        ranks = request.ranks(self.world.world_size)
        with contextlib.suppress(OSError):
            answer(
                self.run,
                request_id,
                {
                    "status": "accepted",
                    "request": str(request.number),
                    "steps": steps,
                    "ranks": list(ranks) if ranks is not None else "all",
                    "world_size": self.world.world_size,
                },
            )

    # -- status ------------------------------------------------------------------------

    def _status(self, state: str) -> dict[str, Any]:
        counts = self.detector.counts
        capture = self.capture.stats if self.capture else None
        recent = recent_times(list(self._recent), 16)
        slowest = sorted(
            recent,
            key=lambda r: -max((t for t in recent[r] if t is not None), default=0.0),
        )
        return {
            "state": state,
            "run_id": self.run.run_id if self.run else None,
            "world_size": self.world.world_size,
            "step": self.current_step,
            "gathered_step": self._gathered_step,
            "median_ms": json_number(self.detector.median_ms),
            "threshold_ms": json_number(self.detector.threshold_ms),
            "recent_ms": {str(rank): times for rank, times in recent.items()},
            "slowest_ranks": slowest[:8],
            "detector": vars(counts).copy(),
            "episodes": self.detector.episode_summaries()[-20:],
            "captures": {
                "written": capture.written if capture else 0,
                "bytes": capture.bytes_written if capture else 0,
                "missed": capture.missed if capture else 0,
                "skipped_disk": capture.skipped_disk if capture else 0,
                "failed": capture.failed if capture else None,
            },
            "tracer": self.tracer_report(),
            "capture_off": self._capture_off_reason,
            "consensus_error": self._consensus_error,
            "status_interval_s": self.config.control.status_interval_s,
        }

    def _write_status(self, state: str) -> None:
        if self.run is None:
            return
        try:
            write_status(self.run, self._status(state))
        except (OSError, ValueError) as err:
            self._warn_once("status", "status file not written (%s)", err)

    def _finish_capture(self) -> None:
        if self.capture is not None:
            self.capture.close(self.config.analysis.exit_timeout_s)

    # -- shutdown ----------------------------------------------------------------------

    def close(self) -> None:
        """End of training: flush what is pending, within `analysis.exit_timeout_s`."""
        global _ACTIVE
        if self._closed:
            return
        self._closed = True
        if self._hook_handle is not None:
            self._hook_handle.remove()
        tracer = self.tracer
        drain_s = max(self.config.analysis.exit_timeout_s, EXIT_DRAIN_FLOOR_S)
        deadline = time.monotonic() + drain_s
        gpu_done = True
        if self.clock is not None:
            # Polled, never a synchronize: a hung GPU (a crash, a stuck collective) must
            # not hang the exit. It also tells whether stopping the tracer is safe below.
            try:
                drained, gpu_done = self.clock.drain(drain_s)
                for step, duration in drained:
                    self._inbox.put(self._resolved(step, duration))
                if not gpu_done:
                    log.warning(
                        "distanom: the GPU did not reach the last step boundaries within "
                        "%.0f s; their timings are dropped and the tracer is left as it is",
                        drain_s,
                    )
            except Exception as err:
                self._warn_once("clock", "clock: final read failed (%s)", err)
        if tracer is not None and gpu_done:
            # on this thread: torch.profiler's state belongs to the thread that started
            # it (stopping it from another one loses the last window, and can crash)
            try:
                tracer.end_of_training()  # kineto hands over its last partial window
            except Exception as err:
                self._warn_once("tracer", "tracer: stopping at the end failed (%s)", err)
        self._inbox.put(_FINAL)
        if self._control.is_alive():
            remaining = max(0.0, deadline - time.monotonic())
            self._control.join(remaining + FINAL_ROUND_TIMEOUT_S)
            if self._control.is_alive():
                log.warning("distanom: background work still running at exit; abandoned")
        if tracer is not None and gpu_done:  # else its close could wait on the GPU too
            with contextlib.suppress(Exception):
                tracer.close()
        if self._group is not None and not self._control.is_alive():
            self._group.close()
        self._gc_pauses.uninstall()
        if _ACTIVE is self:
            _ACTIVE = None
        with contextlib.suppress(Exception):
            if self._steps_file is not None:
                self._steps_file.close()
        sys.stderr.flush()
