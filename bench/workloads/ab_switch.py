"""In-process A/B for the whole-job bench: the installed agent switched between watching
and inert every few hundred milliseconds, so its cost is resolved inside one job.

Whole-process pairs spread by +-15-25% on the H200 machine and block-to-block drift
inside one process reached 10-15% (bench/results/agent_cost_h200_3971307.json): a 1%
cost needs its on and off halves measured side by side. `SegmentedAB` is driven by a
workload's `StepTimer` when WHOLE_JOB_AB_SEGMENT is set (the job runs under
`-m distanom.launch`): after the warm-up it times segments of that many steps, the
GPU synchronized at each segment's ends, in the order on, off, off, on, on, off, ...
(ABBA: a linear drift cancels within every four segments), and switches the agent at
each segment's start.

Inert ("off") is the agent installed but doing nothing at a boundary: its step
boundaries return at once (the state they enter when their bookkeeping fails, in which
`Agent.close` still drains and finishes), its phase marks are paused and the model's
forward hooks lifted (before session 24 the marks went on in off segments, until 256
were pending, so the A/B left out all of their cost on 24-step segments and half on
64-step ones), and the control thread finds no steps to work on. It goes inert only
with tracing off: an on
segment that ends inside a traced window runs on until the duty cycle switches tracing
off (cutting the window would add switches the real job never pays; an earlier version
that did cost ~6x the job's switches), so on segments may be longer than N steps. What
stays in both halves: the optimizer wrapper's one check (and, under a GradScaler, its
count of skipped steps, which counts every inert step), the phase marks' backward
wrapper and batch-fetch timing, the GC callback, the control and hang threads' idle
wake-ups. The first step of every on segment follows a synchronize, and after an off
segment its time would span that segment: the clock is told to drop it (a gap, never
judged), or the trace planner would learn the segments as a periodic anomaly and trace
it (an earlier version did: 3-4 series per job).

Per segment it records the state, ms per step, the agent's boundary time, and the CPU
time of every `distanom-*` thread, so work a round started in an on segment and finished
in an off one (which slows the off half, and would hide cost) is visible and can be
added back (bench/whole_job_ab.py does); and how often the training thread blocked
(Linux's voluntary context switches: mostly the GIL taken from it, a count free of the
wall clock's noise). WHOLE_JOB_AB_NO_PAUSES=1 (whole_job_ab.py's `+nopause` variants)
runs the agent's rounds unpaced. Reaches into the agent's internals: a bench tool, not
an API.

A known cost, to check the estimator against the truth (whole_job_ab.py's `+sham`,
`+spin<N>us`, `+spin<P>pct` tweaks): WHOLE_JOB_AB_SHAM=1 keeps the agent inert in both
halves (an A/A: "on" is only a label), WHOLE_JOB_AB_SPIN_US=N busy-waits N us at every
step boundary of an on segment, WHOLE_JOB_AB_SPIN_PCT=P busy-waits P% of the step's own
time there (a cost of exactly P%, whatever the load does to the step). Each segment also
records the spin it paid, the process's and the training thread's CPU time per step, and
the garbage collections in it.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

try:
    import resource  # POSIX only
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

import torch


def _distanom_threads_cpu_ns() -> int:
    """CPU time so far of every live thread named distanom-* (control, hang, capture)."""
    total = 0
    for thread in threading.enumerate():
        if not thread.name.startswith("distanom") or thread.ident is None:
            continue
        try:
            total += time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return total


def _nothing() -> None:
    return None


def _traced_boundaries(boundaries: Any) -> int:
    """The boundaries so far that sat next to a traced step or switched the tracer
    (`own_time.BoundaryMeters`): a segment with none held no traced step."""
    meters = boundaries.meters
    return int(meters.traced_boundaries + meters.switches)


def thread_blocks() -> int | None:
    """How often the calling thread has blocked so far (Linux: its voluntary context
    switches, `getrusage(RUSAGE_THREAD)`, which keeps the GIL; reading
    /proc/thread-self/status would let it go and so cause a hand-over of its own); None
    elsewhere. A launch-bound training thread blocks mostly when another thread takes the
    GIL from it, so on segments over off ones count the GIL hand-overs the agent causes,
    free of the wall clock's noise. Also bench/probes/control_cost_probe.py's count."""
    who = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None
    if who is None:
        return None
    try:
        return int(resource.getrusage(who).ru_nvcsw)
    except OSError:
        return None


def unpace_rounds() -> Callable[[], None]:
    """Make distanom's rounds run in one piece, no pacer pauses (each pause is a GIL
    hand-over by design); returns the undo. The pacer reads `pace_s` from its module at
    every pass, so this reaches an agent already running."""
    import distanom.pacing

    paced = distanom.pacing.pace_s
    distanom.pacing.pace_s = lambda *_args, **_kwargs: 0.0

    def undo() -> None:
        distanom.pacing.pace_s = paced

    return undo


def _collections() -> int:
    """Garbage collections so far, all generations."""
    return sum(int(stats.get("collections", 0)) for stats in gc.get_stats())


def _env_float(name: str) -> float:
    """A non-negative number from the environment (0 when unset or empty)."""
    value = float(os.environ.get(name, "") or 0.0)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def spin_until(deadline: float) -> None:
    """Busy-wait (holding the GIL, as a boundary's own work would) until perf_counter()
    reaches `deadline`."""
    while time.perf_counter() < deadline:
        pass


def _sync() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


class SegmentedAB:
    """Times segments of `segment` steps after `warmup`, switching the agent on/off."""

    def __init__(self, warmup: int, segment: int) -> None:
        from distanom.agent import active_agent

        self.agent: Any = active_agent()
        if self.agent is None:
            raise RuntimeError("WHOLE_JOB_AB_SEGMENT needs the job under -m distanom.launch")
        self.unpaced = os.environ.get("WHOLE_JOB_AB_NO_PAUSES") == "1"
        if self.unpaced:  # bench/whole_job_ab.py's "+nopause", for the whole job
            unpace_rounds()
        self.warmup = warmup
        self.segment = segment
        self.steps = 0
        self.index = -1  # the segment in progress
        self.on = True
        self.segments: list[dict[str, Any]] = []
        self._began = 0.0
        self._own_ns = 0
        self._marks_ns = 0  # the phase marks' own time at segment start
        self._traced = 0  # the agent's traced and switching boundaries at segment start
        self._threads_ns = 0
        self._blocks: int | None = None  # the training thread's blocks at segment start
        self._inert = False  # the A/B made the boundaries inert (and may undo only that)
        self._marks_paused = False  # the A/B paused the phase marks (likewise)
        self._restore_hooks: Callable[[], None] = _nothing  # puts the model's hooks back
        self._in_segment = 0  # steps of the segment in progress
        self.extended = 0  # steps on segments ran past their length, waiting for tracing off
        # a known cost in the on half only (bench tweaks: the estimator's truth)
        self.sham = os.environ.get("WHOLE_JOB_AB_SHAM") == "1"
        self.spin_us = _env_float("WHOLE_JOB_AB_SPIN_US")
        self.spin_pct = _env_float("WHOLE_JOB_AB_SPIN_PCT")
        self._returned = time.perf_counter()  # when the last step_end returned
        self._spun_s = 0.0  # spin paid in the segment in progress
        self._cpu_s = 0.0  # process CPU time at segment start
        self._thread_cpu_s = 0.0  # training thread's CPU time at segment start
        self._collected = 0  # garbage collections at segment start

    @staticmethod
    def _tracing(boundaries: Any) -> bool:
        """Whether the tracer records the step in progress or will from a coming boundary
        (cupti defers a switch-on asked for during CUDA-graph capture: `_want_tracing`)."""
        tracer = boundaries.tracer
        if tracer is None:
            return False
        wanted = getattr(tracer, "_want_tracing", False)
        return bool(tracer.tracing or boundaries._tracing_during or wanted)

    @staticmethod
    def state_of(index: int) -> bool:
        """Segment `index` watched (True) or inert: on, off, off, on, repeated."""
        return index % 4 in (0, 3)

    def step_end(self) -> None:
        """One optimizer step ended (the StepTimer's callback). In an on segment, first
        the injected spin (if any), so it lands in that segment's time."""
        if self.on and self.index >= 0 and (self.spin_us or self.spin_pct):
            started = time.perf_counter()
            spin = self.spin_us / 1e6 + (started - self._returned) * self.spin_pct / 100
            spin_until(started + spin)
            self._spun_s += time.perf_counter() - started
        try:
            self._step_end()
        finally:
            self._returned = time.perf_counter()

    def _step_end(self) -> None:
        self.steps += 1
        if self.steps < self.warmup:
            return
        self._in_segment += 1
        if self.index >= 0 and self._in_segment < self.segment:
            return
        boundaries = self.agent.boundaries
        if self.on and not self.state_of(self.index + 1) and self._tracing(boundaries):
            # going inert now would cut a traced window short and re-attach the tracer at
            # the resume: switches the real job never pays. The on segment runs on until
            # the duty cycle itself switches tracing off.
            self.extended += 1
            return
        blocks = thread_blocks()  # before the synchronize, which may block
        now = _sync()
        cpu, thread_cpu, collected = time.process_time(), time.thread_time(), _collections()
        if self.index >= 0:
            steps = self._in_segment
            self.segments.append({
                "on": self.on,
                "steps": steps,
                "ms_per_step": round((now - self._began) * 1000 / steps, 5),
                "boundary_us_per_step": round((boundaries.own_ns - self._own_ns) / steps / 1e3, 3),
                "phase_marks_us_per_step": round(
                    (boundaries.phases.own_ns - self._marks_ns) / steps / 1e3, 3
                ),
                "threads_cpu_us_per_step": round(
                    (_distanom_threads_cpu_ns() - self._threads_ns) / steps / 1e3, 3
                ),
                "training_blocks_per_step": (
                    None if blocks is None or self._blocks is None
                    else round((blocks - self._blocks) / steps, 4)
                ),
                "spin_us_per_step": round(self._spun_s / steps * 1e6, 3),
                "cpu_ms_per_step": round((cpu - self._cpu_s) * 1000 / steps, 5),
                "training_cpu_ms_per_step": round(
                    (thread_cpu - self._thread_cpu_s) * 1000 / steps, 5
                ),
                "gc_collections": collected - self._collected,
                # boundaries next to a traced step or switching the tracer: 0, untraced
                "traced_boundaries": _traced_boundaries(boundaries) - self._traced,
            })  # fmt: skip
        self.index += 1
        self._in_segment = 0
        self._switch(self.state_of(self.index))
        self._own_ns = boundaries.own_ns
        self._marks_ns = boundaries.phases.own_ns
        self._traced = _traced_boundaries(boundaries)
        self._threads_ns = _distanom_threads_cpu_ns()
        self._began = _sync()
        self._blocks = thread_blocks()  # after the synchronize: the steps' own
        self._spun_s = 0.0
        self._cpu_s, self._thread_cpu_s = time.process_time(), time.thread_time()
        self._collected = _collections()
        if self.on and not self.sham:
            self._forget_last_boundary(boundaries)

    @staticmethod
    def _forget_last_boundary(boundaries: Any) -> None:
        """The next step starts after a synchronize (its GPU queue drained) and, after an
        inert segment, its time would span that segment: neither is the job's own step
        time. Hand over the durations the GPU has resolved (it is idle: all of them), then
        unpair the last boundary, so the next step gets no duration and is never judged
        (a gap, as for a boundary the clock lost). Judged, it would be an anomaly every
        segment, which the trace planner learns as a periodic series and traces."""
        clock = boundaries.clock
        if clock is None:
            return
        for step, duration in clock.poll():
            boundaries.inbox.put(boundaries._resolved(step, duration))
        clock._previous_event = None  # CUDA-event clock
        clock._last_host_ns = None  # host clock

    def _switch(self, on: bool) -> None:
        """Make the agent watch or go inert. Inert is the boundaries' "bookkeeping off"
        state (`_boundaries_off`: boundaries return at once, while `Agent.close` still
        drains and finishes, so a job that fails in an off segment ends as it would),
        never `closed` (which `close` reads as "already closed"). A state the A/B did not
        set (bookkeeping that really failed) is never cleared. A sham A/B (`+sham`) keeps
        the agent inert in both halves."""
        boundaries = self.agent.boundaries
        marks = boundaries.phases
        if (not on or self.sham) and not self._inert:
            if not boundaries._boundaries_off:  # never while tracing (see step_end)
                boundaries._boundaries_off = True
                self._inert = True
            if not marks.off:  # `off`: no mark is taken (marks switched off for good
                marks.off = True  # also uninstall their hooks; a pause leaves them)
                self._marks_paused = True
                # and the model's forward hooks come off (a hooked module leaves torch's
                # fast call path), as for `make_graphed_callables`; back on resuming
                model = marks._model() if marks._model is not None else None
                self._restore_hooks = marks._lift_hooks([model] if model is not None else [])
        elif on and not self.sham:  # next step dropped: _forget_last_boundary
            if self._inert:
                boundaries._boundaries_off = False
                self._inert = False
            if self._marks_paused and not boundaries.closed:  # a closed agent stays so
                marks.off = False
                self._marks_paused = False
                restore, self._restore_hooks = self._restore_hooks, _nothing
                restore()
        self.on = on

    def finish(self) -> dict[str, Any]:
        """Leave the agent watching (its exit path expects it) and return the segments."""
        sham, self.sham = self.sham, False
        self._switch(True)
        try:
            duty = self.agent.duty.report()  # traced share, measured overhead, switches
        except Exception as err:  # a bench figure, not worth failing the job for
            duty = {"error": repr(err)}
        cost: dict[str, Any]
        try:  # the agent's own account, with the pacer's pauses and measured round work
            cost = {**self.agent.own_cost(), "rounds": self.agent.control.rounds}
        except Exception as err:  # a bench figure, not worth failing the job for
            cost = {"error": repr(err)}
        clock = self.agent.boundaries.clock
        clock_state = None
        if clock is not None:  # which clock timed the steps (an adaptive one switches)
            clock_state = {
                "mode": clock.mode,
                "on_host_clock": clock.on_host_clock,
                "host_timed_steps": clock.host_timed_steps,
            }
        return {
            "clock_at_end": clock_state,
            "duty_cycle_at_end": duty,
            "agent_cost_at_end": cost,
            "ab_segment": self.segment,
            "ab_segments": self.segments,
            "ab_steps_extended": self.extended,
            "ab_unpaced": self.unpaced,
            "ab_injected": {"sham": sham, "spin_us": self.spin_us, "spin_pct": self.spin_pct},
        }
