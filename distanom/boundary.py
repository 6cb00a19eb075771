"""The training thread's side of the agent: step boundaries, and as little work as
possible at each one. Step N is the N-th `optimizer.step()` of the counted optimizer
(or replay of a CUDA graph that captured one: `graph_capture`), from 0, or
`distanom.step()` for loops without one. With several optimizers, the first one that
steps is counted unless `step.optimizer` names a class (and `step.optimizer_index` which
of that class, in the order they first step) or the script calls
`distanom.use_optimizer(opt)`. A global optimizer post-hook finds the counted optimizer
at its first step; from then on a thin wrapper on that instance's `step` marks the
boundary *after* `step()` returns. The post-hook runs inside the optimizer's
`record_function` scope, where starting or stepping torch.profiler corrupts memory, so
no tracer work ever happens there (docs/agent.md).

Skipped optimizer steps: `torch.amp.GradScaler.step(opt)` (and `torch.cuda.amp`'s
subclass) calls `opt.step()` only when the gradients are finite. Mixed-precision loops
call it exactly once per iteration whether or not it steps, so a wrapper on the class's
`step` ends the step itself, flagged `STEP_SKIPPED`, when the counted optimizer's step
did not run inside it. The scaler's own decision is the signal: no private state of the
scaler is read.

At a boundary: one host timestamp, the clock's mark (a CUDA event or a host clock read),
the tracer's step mark, the duty cycle's switch for the next step, and a queue put of
each step whose time became known (`StepRecord`, to the control thread); or, with a
deferred event clock (`DEFER_EVENT_READS`, off), the event and a count, the records made
by the control thread (`collect`, a round at a time). Inside a run of steps the duty
cycle already decided untraced, with the tracer off, the tracer's part is its mark alone
("quiet boundaries", docs/agent.md). Reads the shared `Health` and `DutyCycle`; nothing
here blocks or raises into training.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from distanom.clock import StepClock, resolve_mode
from distanom.config import Config
from distanom.duty_cycle import DutyCycle
from distanom.evidence import EvidenceMarks
from distanom.gc_pauses import GcPauses
from distanom.grad_scaler import patch_grad_scaler
from distanom.graph_capture import CAPTURES
from distanom.health import Health
from distanom.inbox import StepInbox
from distanom.log_lines import HEADLINE, start_notes, step_source
from distanom.own_time import (
    BOOKKEEPING,
    CLOCK,
    CPU_SAMPLE_EVERY,
    HANDOFF,
    PHASES,
    STAMP,
    STARTUP_BOUNDARIES,
    TRACER,
    BoundaryMeters,
)
from distanom.phases import PhaseMarks
from distanom.step_record import (
    STEP_AFTER_FLUSH,
    STEP_DISTURBED,
    STEP_SKIPPED,
    STEP_TRACED,
    StepRecord,
)
from distanom.tracers import Tracer, create_tracer

log = logging.getLogger(__name__)

FINAL = object()  # inbox sentinel: training is over
# The control thread reads the CUDA events and makes the records (`collect`): off, as no
# job was shown faster for it (docs/measurements.md, session 22)
DEFER_EVENT_READS = False
# what is kept of steps the clock has not timed yet is swept every this many steps, back
# to this many: past it the clock (or a deferred reader, `clock.MAX_DEFERRED_EVENTS`) gave
# up on them, and their bookkeeping would grow without bound
KEEP_UNRESOLVED = 2048
_perf_ns = time.perf_counter_ns
_thread_ns = time.thread_time_ns
_new_tuple = tuple.__new__
NO_GC = (0.0, -1)  # no collection during a step: (ms, generation)
# A tracer switch this many times slower than the median of the latest SWITCHES_KEPT is
# the next step's own time (the first after start-up always is): ordinary switches are
# what the after-flush steps' baseline is made of (docs/agent.md)
SLOW_SWITCH_FACTOR = 2.0
SWITCHES_KEPT = 16


class StepBoundaries:
    """Counts steps and marks their boundaries on the training thread; see the module
    docstring. `inbox` receives a `StepRecord` per timed step, then `FINAL`."""

    def __init__(
        self,
        config: Config,
        rank: int,
        health: Health,
        duty: DutyCycle,
        inbox: StepInbox,
    ) -> None:
        self.config = config
        self.rank = rank
        self.health = health
        self.duty = duty
        self.inbox = inbox
        self.current_step = 0
        self.clock: StepClock | None = None
        self.tracer: Tracer | None = None
        self.tracer_note = "tracer: not started"
        self.tracer_started = False
        self.closed = False  # set at the end of training: later boundaries are ignored
        self.own_ns = 0  # time spent in boundaries (this thread's cost of distanom)
        self.meters = BoundaryMeters()  # the same, by kind and part (`distanom.own_time`)
        self.last_busy_ns = 0  # distanom's busy time (Health, capture) at the last boundary
        self._switch_ns = 0  # a slow tracer switch at the last boundary: the next step's time
        self._switches_ns: collections.deque[int] = collections.deque(maxlen=SWITCHES_KEPT)
        self.gc_pauses = GcPauses()
        self.evidence_marks = EvidenceMarks()
        self.phases = PhaseMarks()
        self._evidence_append = self.evidence_marks.marks.append  # bound once: every step
        self._gc_finished = self.gc_pauses.finished  # a deque: empty on nearly every step
        self._phases_on = config.step.phases
        self._capture_is_off = health.capture_is_off  # bound once: called every step
        self._warn_once = health.warn_once
        self._optimizer_ref: weakref.ref[Any] | None = None
        self._manual = config.step.source == "manual"
        self._hook_handle: Any = None
        self._inside_counted_step = False
        self._step_flags: dict[int, int] = {}  # STEP_* bits of steps not yet resolved
        self._next_after_flush = False  # the tracer flushed at the last boundary
        self._first_boundary_done = False
        self._boundaries_off = False  # step bookkeeping failed: training goes on unwatched
        self._self_ms: dict[int, float] = {}  # capture work during steps not yet resolved
        self._gc: dict[int, tuple[float, int]] = {}  # collections during steps not yet resolved
        self._tracing_during = False  # whether the tracer records the step in progress
        # boundaries before this one need only the tracer's mark while the duty cycle's
        # schedule_version is still _quiet_version (`_quiet_from`)
        self._quiet_before = 0
        self._quiet_version = -1
        self._scaler_patch: Any = None  # undoes the GradScaler wrapper
        self._deferred = False  # the clock's events are read by `collect` (control thread)
        self._collect_lock = threading.Lock()  # `collect` against `drain`: never per step
        self._last_began = 0  # perf ns of the last boundary (a deferred clock's slow runs)
        self._booked_through = -1  # the last step whose flags, self_ms, gc and phases are kept
        self._seen_of_class: list[weakref.ref[Any]] = []  # step.optimizer's class, first-step order
        self._optimizer_boundaries = 0  # steps ended by the optimizer before distanom.step()
        self.skipped_steps = 0  # steps whose optimizer step a GradScaler skipped
        self.scaler_seen = False

    # -- hooks -------------------------------------------------------------------------

    def install_hook(self) -> None:
        """Register the global optimizer post-hook that finds the counted optimizer, and
        follow `GradScaler.step` so skipped optimizer steps still end a step."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._hook_handle = register_optimizer_step_post_hook(self._on_optimizer_step)
        CAPTURES.replayed_step = self.replayed
        self._scaler_patch = patch_grad_scaler(self._after_scaler_step)
        if self._phases_on:
            self.phases.install()

    def remove_hook(self) -> None:
        """Remove the global optimizer post-hook and the scaler wrapper (the optimizer
        wrapper stays, inert once closed)."""
        if self._hook_handle is not None:
            self._hook_handle.remove()
        if CAPTURES.replayed_step == self.replayed:
            CAPTURES.replayed_step = None
        if self._scaler_patch is not None:
            self._scaler_patch()
            self._scaler_patch = None
        self.phases.uninstall()

    @property
    def counted_optimizer(self) -> Any:
        """The optimizer whose step() ends a step, None until one is known."""
        ref = self._optimizer_ref
        return None if ref is None else ref()

    def use_optimizer(self, optimizer: Any) -> None:
        """Count this optimizer's step() as the end of a step from now on."""
        if self._optimizer_ref is not None and self._optimizer_ref() is optimizer:
            return
        self._optimizer_ref = weakref.ref(optimizer)
        self._wrap_step(optimizer)

    def _wrap_step(self, optimizer: Any) -> None:
        """Mark boundaries after this optimizer's step() returns (outside its profiler scope)."""
        original = optimizer.step  # bound method, or an LR scheduler's instance wrapper
        boundaries = self

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            boundaries.phases.optimizer_started()
            boundaries._inside_counted_step = True
            try:
                result = original(*args, **kwargs)
            finally:
                boundaries._inside_counted_step = False
            if (
                not boundaries._manual
                and boundaries._optimizer_ref is not None
                and boundaries._optimizer_ref() is optimizer
            ):
                boundaries.boundary()
            return result

        optimizer.step = step

    def _selects(self, optimizer: Any) -> bool:
        """Whether `optimizer` is the one `step.optimizer` / `step.optimizer_index` name."""
        wanted = self.config.step.optimizer
        if wanted is not None and type(optimizer).__name__ != wanted:
            return False
        index = self.config.step.optimizer_index
        if wanted is None or index == 0:
            return True
        seen = self._seen_of_class
        if not any(ref() is optimizer for ref in seen):
            seen.append(weakref.ref(optimizer))
        return len(seen) > index and seen[index]() is optimizer

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._manual or self._inside_counted_step or self._optimizer_ref is not None:
            return
        if not self._selects(optimizer):
            return
        # First step of the counted optimizer: from now on its wrapper marks boundaries.
        self._optimizer_ref = weakref.ref(optimizer)
        self._wrap_step(optimizer)
        self.boundary(inside_optimizer=True)

    def _after_scaler_step(self, optimizer: Any, step_before: int) -> None:
        """After `GradScaler.step(optimizer)`: end the step here when the counted
        optimizer's own step did not run (its gradients held inf/nan)."""
        self.scaler_seen = True
        if self._manual or self.closed or self.current_step != step_before:
            return
        counted = self.counted_optimizer
        if counted is None:
            if self._inside_counted_step or not self._selects(optimizer):
                return
            self._optimizer_ref = weakref.ref(optimizer)  # skipped at its first iteration
            self._wrap_step(optimizer)
        elif counted is not optimizer:
            return
        self.skipped_steps += 1
        self.boundary(skipped=True)

    def step_source(self) -> str:
        """What ends a step, for the start line (`log_lines.step_source`)."""
        counted = self.counted_optimizer
        name = None if counted is None else type(counted).__name__
        return step_source(self._manual, name, self.config.step, self.scaler_seen)

    def replayed(self) -> None:
        """A CUDA graph holding a captured step was replayed: that step ran (graph_capture)."""
        if not self._manual:  # with distanom.step() the script ends replayed steps itself
            self.boundary()

    def manual_step(self) -> None:
        """`distanom.step()`: end a step by hand; optimizer steps stop counting."""
        if not self._manual:
            self._manual = True  # the script marks steps itself: optimizer hooks would double count
            log.debug("distanom.step() called: steps are counted by it, not by optimizer.step()")
            if self.current_step == 1 and self._optimizer_boundaries == 1:
                # a script that calls distanom.step() every iteration makes its first call
                # in iteration 0, whose end the optimizer has just marked: same boundary
                return
        self.boundary()

    # -- the boundary --------------------------------------------------------------------

    def boundary(self, *, inside_optimizer: bool = False, skipped: bool = False) -> None:
        """End the step in progress; never raises (a failure switches bookkeeping off)."""
        if self.closed or self._boundaries_off:
            return
        if CAPTURES.capturing and CAPTURES.here():  # a step inside a CUDA graph capture
            CAPTURES.step_captured()  # runs at its replays (`replayed`), not now
            return
        if not self._manual:
            self._optimizer_boundaries += 1
        try:
            self._boundary_unguarded(inside_optimizer, skipped)
        except Exception as err:  # the last line of defence: never raise into training
            self._warn_once("boundary", "distanom: step bookkeeping failed (%s); disabled", err)
            self._boundaries_off = True  # close() still stops the tracer and finishes
            tracer = self.tracer
            if tracer is not None:
                with contextlib.suppress(Exception):
                    tracer.set_tracing(False)  # unwatched: tracing would only cost

    def _boundary_unguarded(self, inside_optimizer: bool, skipped: bool = False) -> None:
        now = _perf_ns  # a fixed point between each part: `own_time.PARTS`
        began = now()
        step = self.current_step
        self.current_step = step + 1
        host_ns = time.time_ns()
        cpu_began = _thread_ns()
        self._evidence_append((step, host_ns, cpu_began))  # `EvidenceMarks.mark`, inline
        one_off = step < STARTUP_BOUNDARIES
        if not self._first_boundary_done:
            self._first_boundary_done = True  # once: a later clock failure re-creates nothing
            self._first_boundary()
        at_stamp = now()
        resolved: Sequence[tuple[int, float]] = ()
        clock = self.clock
        if clock is not None:
            try:
                resolved = clock.mark(step)
            except Exception as err:
                self._warn_once("clock", "clock: step timing failed (%s); detection stops", err)
                self.clock = clock = None
        at_clock = now()
        self.phases.step_ended(step, began, clock.last_event if clock is not None else None)
        at_phases = now()
        self_ms = self.self_ms_of_ended_step()
        if self._switch_ns:
            self_ms += self._switch_ns / 1e6
            self._switch_ns = 0
        traced = self._tracing_during  # the step that ended
        # traced, after a flush, disturbed by distanom's own capture work (then it is never
        # judged: no feedback loop), skipped by a GradScaler
        flags = (STEP_TRACED if traced else 0) | (STEP_AFTER_FLUSH if self._next_after_flush else 0)
        if self_ms or skipped:
            flags |= (STEP_DISTURBED if self_ms else 0) | (STEP_SKIPPED if skipped else 0)
        if flags:  # most steps have none: `_resolved` reads a missing entry as 0
            self._step_flags[step] = flags
        if self_ms:
            self._self_ms[step] = self_ms
        if self._gc_finished:  # nearly every step has no collection: no call
            self._gc[step] = self.gc_pauses.take()
        at_bookkeeping = now()
        tracer = self.tracer
        switched = False
        if tracer is not None and not inside_optimizer:
            if step < self._quiet_before and self.duty.schedule_version == self._quiet_version:
                # inside a run the duty cycle decided untraced, with the tracer off: its
                # mark is all there is to do (docs/agent.md, "Quiet boundaries")
                try:
                    tracer.mark_step(step, host_ns)
                except Exception as err:
                    self._tracer_failed(err)
                self._next_after_flush = False
            else:
                one_off = one_off or not self.tracer_started
                self._tracer_boundary(tracer, step, host_ns)
                switched = self._next_after_flush or traced != self._tracing_during
        at_tracer = now()
        if switched and not one_off:  # CUPTI's attach or drain, kineto's flush
            self._carry_slow_switch(at_tracer - at_bookkeeping)
        if resolved:
            put, record = self.inbox.put_step, self._resolved
            for resolved_step, duration in resolved:
                put(record(resolved_step, duration), duration)
        elif self._deferred:  # the step's flags, self_ms, gc and phases are kept by now:
            self._booked_through = step  # its reader may make its record
            self.inbox.tick(began - self._last_began)
            self._last_began = began
        if not step % KEEP_UNRESOLVED:
            self._forget_unresolved(step - KEEP_UNRESOLVED)
        end = now()
        self.own_ns += end - began
        meters = self.meters  # one kind per boundary (docs in `distanom.own_time`)
        if one_off:
            meters.startup_ns += end - began
            meters.startup_boundaries += 1
        elif switched:
            meters.switch_ns += end - began
            meters.switches += 1
        elif traced or self._tracing_during:
            meters.traced_ns += end - began
            meters.traced_boundaries += 1
        else:
            meters.steady_ns += end - began
            meters.steady_boundaries += 1
            parts = meters.part_ns
            parts[STAMP] += at_stamp - began
            parts[CLOCK] += at_clock - at_stamp
            parts[PHASES] += at_phases - at_clock
            parts[BOOKKEEPING] += at_bookkeeping - at_phases
            parts[TRACER] += at_tracer - at_bookkeeping
            parts[HANDOFF] += end - at_tracer
            if not step % CPU_SAMPLE_EVERY:  # this thread's CPU in it (a system call: 1 in N)
                meters.cpu_sample_ns += _thread_ns() - cpu_began
                meters.cpu_sample_wall_ns += end - began

    def _tracer_boundary(self, tracer: Tracer, step: int, host_ns: int) -> None:
        """The tracer's part of boundary `step`: its mark, its start, the duty cycle's
        switch for the next step, and how far the steps after it stay quiet."""
        flushes = tracer.boundary_flushes
        try:
            tracer.mark_step(step, host_ns)
            if not self.tracer_started:
                self.tracer_started = True
                tracer.start()
                self._tracing_during = True
                log.info("started: %s; %s", self.step_source(), self._start_notes(), extra=HEADLINE)
            elif self._capture_is_off():
                if tracer.tracing:  # nothing will be captured
                    tracer.set_tracing(False)
            else:
                self._apply_duty_cycle(tracer, step + 1)
            # what is in force for the next step: a backend may defer or refuse a
            # switch, or make one asked for earlier at this boundary
            self._tracing_during = bool(tracer.tracing)
            self._quiet_from(tracer, step + 1)
        except Exception as err:
            self._tracer_failed(err)
        self._next_after_flush = tracer.boundary_flushes != flushes

    def use_clock(self, clock: StepClock) -> None:
        """Time steps with `clock` (before the first boundary: tests, tools); a deferred
        one's steps are made into records by `collect`, called from `StepInbox.take`."""
        self.clock = clock
        self._deferred = clock.deferred
        self.inbox.collect = self.collect if clock.deferred else None

    def use_tracer(self, tracer: Tracer | None) -> None:
        """Put `tracer` in place of the current one (tests, tools): the next boundary
        asks the duty cycle, whatever quiet run the old one was in."""
        self.tracer = tracer
        self._quiet_before = 0

    def _quiet_from(self, tracer: Tracer, next_step: int) -> None:
        """How many boundaries from here on need only the tracer's mark: those whose next
        step the duty cycle decided untraced, while the tracer is off with no switch
        pending. Version first: a request made meanwhile moves it, and the next boundary
        asks again."""
        self._quiet_version = self.duty.schedule_version
        if self._tracing_during or not tracer.quiet:
            self._quiet_before = 0
            return
        # boundary b only marks if step b + 1 is untraced: b + 1 < end
        self._quiet_before = self.duty.untraced_until(next_step) - 1

    def _forget_unresolved(self, before: int) -> None:
        """Drop what is kept of steps before `before` that the clock never timed (it gave
        up on them): normally each entry is gone a few steps after it was made."""
        for kept in (self._step_flags, self._self_ms, self._gc):
            # list(): one C call, so a deferred clock's reader popping meanwhile cannot
            # change the dict under an iteration
            for old in [s for s in list(kept) if s < before]:
                kept.pop(old, None)

    def collect(self) -> list[StepRecord]:
        """The steps a deferred clock's events have timed since the last call, as records
        (the control thread, from `StepInbox.take`; never raises: a failed read stops
        the timing, logged once)."""
        clock = self.clock
        if clock is None or not clock.deferred:
            return []
        with self._collect_lock, CAPTURES.lock:  # no event query inside a graph capture
            if CAPTURES.capturing:
                return []  # read at the next take
            try:
                resolved, passed = clock.collect(self._booked_through)
                records = [self._resolved(step, duration) for step, duration in resolved]
                clock.release(passed)  # after the records: their phase events are read
            except Exception as err:
                self._warn_once("clock", "clock: step timing failed (%s); detection stops", err)
                self.clock = None
                return []
            self.inbox.behind = clock.behind
        return records

    def _resolved(self, step: int, duration: float) -> StepRecord:
        """What the control thread gets of a step whose time is known."""
        gc_ms, gc_generation = self._gc.pop(step, NO_GC) if self._gc else NO_GC
        flags = self._step_flags.pop(step, 0) if self._step_flags else 0
        self_ms = self._self_ms.pop(step, 0.0) if self._self_ms else 0.0
        phases = self.phases.take_raw(step)
        # tuple.__new__: no Python frame of the NamedTuple's own __new__
        fields = (step, duration, flags, self_ms, gc_ms, gc_generation, phases)
        return _new_tuple(StepRecord, fields)

    def self_ms_of_ended_step(self) -> float:
        """How long distanom's own heavy work (capture work, heavy consensus rounds) ran
        during the step that just ended (ms)."""
        capture = self.health.capture
        busy = self.health.control_busy_ns + (capture.busy_ns() if capture is not None else 0)
        if busy <= self.last_busy_ns:  # nearly every step: nothing new
            return 0.0
        # monotone: a reading that ran a little ahead of the worker (it read a lookup
        # as heavy just before the worker measured it under the threshold) is absorbed
        # by later work instead of giving a step a negative share
        busy = max(busy, self.last_busy_ns)
        spent, self.last_busy_ns = busy - self.last_busy_ns, busy
        return spent / 1e6

    def _carry_slow_switch(self, took_ns: int) -> None:
        """A switch runs after the step's clock mark, so its time is in the next step.
        One far slower than the latest ones (the run's first CUPTI attach took 11-13 ms
        against ~2.5 ms for later switches on the H200) is carried into that step's
        `self_ms`, which the detector discounts."""
        usual = self._switches_ns
        if not usual or took_ns > SLOW_SWITCH_FACTOR * sorted(usual)[len(usual) // 2]:
            self._switch_ns = took_ns
        usual.append(took_ns)

    def _apply_duty_cycle(self, tracer: Tracer, next_step: int) -> None:
        """Switch tracing on or off for the next step as the duty cycle decided."""
        want = self.duty.wanted(next_step)
        if want is not None and want != bool(tracer.tracing):
            tracer.set_tracing(want)
            self._tracing_during = want

    def _first_boundary(self) -> None:
        try:
            mode = resolve_mode(self.config.clock.mode)
            clock = self.clock or StepClock(mode, deferred=DEFER_EVENT_READS)
            self.use_clock(clock)  # or the one `use_clock` put in place (tests, tools)
            mode = clock.mode
            if mode in ("cuda_event", "adaptive"):
                self.phases.use_gpu(clock.event_calls)
        except Exception as err:
            self._warn_once("clock", "clock: cannot time steps (%s); detection stops", err)
            return
        use_cuda = mode in ("cuda_event", "host_sync", "adaptive") or (
            torch.cuda.is_available() and torch.cuda.is_initialized()
        )
        try:
            self.tracer, self.tracer_note = create_tracer(
                self.config.tracer, rank=self.rank, use_cuda=use_cuda
            )
        except Exception as err:
            self._warn_once("tracer", "tracer: cannot be created (%s); detection only", err)
            self.tracer, self.tracer_note = None, f"tracer: none ({err})"
        if self.tracer is None:
            log.info("started: %s; %s", self.step_source(), self._start_notes(), extra=HEADLINE)

    def _start_notes(self) -> str:
        """The start line's notes (`log_lines.start_notes`)."""
        budget = self.config.tracer.overhead_budget_pct
        return start_notes(self.tracer_note, self.tracer is not None, budget)

    def _tracer_failed(self, err: BaseException) -> None:
        self._warn_once("tracer", "tracer: failed (%s); capture steps aside", err)
        tracer, self.tracer = self.tracer, None
        self._tracing_during = False
        if tracer is not None:
            with contextlib.suppress(Exception):
                tracer.close()

    # -- end of training (on the training thread) --------------------------------------

    def drain(self, timeout_s: float) -> bool:
        """Queue the last steps' times the GPU reaches within `timeout_s`, then stop the
        tracer; returns whether the GPU reached every boundary (else the tracer is left
        as it is: stopping it could wait on the GPU too)."""
        began = _perf_ns()
        try:
            return self._drain(timeout_s)
        finally:
            self.meters.teardown_ns += _perf_ns() - began

    def _drain(self, timeout_s: float) -> bool:
        gpu_done = True
        if self.clock is not None:
            # polled, never a synchronize: a hung GPU must not hang the exit
            try:
                with self._collect_lock:  # a deferred clock's reader polls too
                    drained, gpu_done = self.clock.drain(timeout_s)
                for step, duration in drained:
                    self.inbox.put(self._resolved(step, duration))
                if not gpu_done:
                    log.warning(
                        "distanom: the GPU did not reach the last step boundaries within "
                        "%.0f s; their timings are dropped and the tracer is left as it is",
                        timeout_s,
                    )
            except Exception as err:
                self._warn_once("clock", "clock: final read failed (%s)", err)
        tracer = self.tracer
        if tracer is not None and gpu_done:
            # on this thread: torch.profiler's state belongs to the thread that started it
            try:
                tracer.end_of_training()  # kineto hands over its last partial window
            except Exception as err:
                self._warn_once("tracer", "tracer: stopping at the end failed (%s)", err)
        return gpu_done
