"""The `cupti` tracer backend: raw CUPTI activity records, decoded only for captured steps.

Owns `CuptiTracer`, the backend's life cycle and its training-thread side. On the
training thread, `mark_step` launches one tiny marker kernel (see `marker`) on the
current stream and records a `StepMark`; nothing else happens there, except when the
duty cycle switches tracing (`set_tracing`): off drains the GPU and detaches CUPTI,
whose per-launch cost outlives a mere disable; on re-attaches it. CUPTI (see `session`)
collects kernel, memcpy and memset records into a bounded ring of raw buffers (see
`buffers`). When the capture worker asks for a step, on its own thread, the
`StepResolver` (see `resolver`) finds the step's records between its two markers and
hands Kineto-shaped events on as a `StepTrace`; nothing here touches disk.

Marker codes repeat every K steps (see `matching`), so only a GPU lagging the host by K
steps or more could be misnumbered: `mark_step` records a CUDA event after each marker
and, every `LAG_PROBE_EVERY` markers, queries the one recorded `LAG_PROBE_AGE` markers
earlier; if it has not completed, the steps around it are flagged ambiguous (GONE,
counted as `lag_alarms`). The same events tell the reader whether the GPU has passed a
step's closing marker, the condition for a forced CUPTI flush.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import distanom.tracers.cupti.callbacks as callbacks
from distanom.errors import TracerUnavailableError
from distanom.graph_capture import CAPTURES
from distanom.tracers.base import Availability, StepTrace
from distanom.tracers.cupti.buffers import DEFAULT_BUFFER_BYTES, BufferPool
from distanom.tracers.cupti.calibration import Calibration, calibrate
from distanom.tracers.cupti.events import device_properties
from distanom.tracers.cupti.library import CuptiLib, DetachError
from distanom.tracers.cupti.marker import StepMarker, create_marker
from distanom.tracers.cupti.matching import MARKER_CODES, StepMark
from distanom.tracers.cupti.names import NameTable
from distanom.tracers.cupti.probe import cuda_reason
from distanom.tracers.cupti.records import buffer_view, iterate_by_size
from distanom.tracers.cupti.resolver import StepResolver
from distanom.tracers.cupti.session import ActivitySession

_monotonic_ns = time.monotonic_ns
_new_tuple = tuple.__new__  # a StepMark with no Python frame of the NamedTuple's __new__


def _unstarted(mark: StepMark) -> None:
    raise RuntimeError("cupti tracer: a mark before start()")


if TYPE_CHECKING:
    from distanom.config import TracerConfig

log = logging.getLogger(__name__)

LAG_PROBE_AGE = 12  # markers after which a marker's event must have completed (< K)
LAG_PROBE_EVERY = 4  # markers between two lag checks (each check is an event query)
MAX_ABANDONED_BUFFERS = 8  # buffers CUPTI may keep through detaches before we stop detaching
STEP_EVENTS = 64  # CUDA events kept, one per recent marker


class CuptiTracer:
    """The `cupti` backend of the Tracer protocol (see the module docstring)."""

    name = "cupti"

    def __init__(
        self,
        config: TracerConfig,
        *,
        rank: int,
        marker_codes: int = MARKER_CODES,
        force_flush_after_s: float = 2.0,
        buffer_kb: int = DEFAULT_BUFFER_BYTES >> 10,
        detach_when_off: bool = True,
    ) -> None:
        # Duck-typed on purpose: only these three fields are read, so device scripts can
        # pass a plain namespace where pydantic is not installed.
        self.history_steps = int(config.history_steps)
        self.ring_mb = int(config.ring_mb)
        self.overhead_budget_pct = config.overhead_budget_pct
        self.rank = rank
        self._codes = int(marker_codes)
        self._force_after_ns = int(force_flush_after_s * 1e9)
        self._buffer_bytes = int(buffer_kb) << 10
        self._detach_when_off = detach_when_off
        self.boundary_flushes = 0  # detaches at a boundary: the next step carries their cost
        self._boundary_before_start: tuple[int, int] | None = None
        self._state = "new"  # new | running | failed | closed
        self._append_mark: Callable[[StepMark], None] = _unstarted  # the resolver's, once running
        self._want_tracing = True
        self._tracing = False
        self._read_lock = threading.Lock()
        self._lib: CuptiLib | None = None
        self._session: ActivitySession | None = None
        self._pool: BufferPool | None = None
        self._resolver: StepResolver | None = None
        self._names: NameTable | None = None
        self._marker: StepMarker | None = None
        self._torch: Any = None
        self._device_properties: list[dict[str, Any]] = []
        self.calibration: Calibration | None = None
        self._last_step: int | None = None
        self._markers_launched = 0
        self._events: list[Any] = []  # STEP_EVENTS CUDA events, used round-robin
        self._step_events: deque[tuple[int, Any]] = deque(maxlen=STEP_EVENTS)
        self._events_lock = threading.Lock()
        self.failure: str | None = None
        self.counters: dict[str, int] = {
            "marks": 0,
            "markers_launched": 0,
            "marks_untraced": 0,
            "marks_out_of_order": 0,
            "marks_while_capturing": 0,
            "mark_errors": 0,
            "enables": 0,
            "disables": 0,
            "detaches": 0,
            "detach_failures": 0,
            "cupti_walks": 0,
            "toggle_ns_max": 0,
            "toggle_ns_total": 0,
            "lag_alarms": 0,
        }

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Load CUPTI, warm the marker, open the session, calibrate, and start tracing;
        TracerUnavailableError when the backend cannot run."""
        if self._state != "new":
            raise RuntimeError(f"CuptiTracer.start() called in state {self._state}")
        reason = cuda_reason()
        if reason is not None:
            raise TracerUnavailableError(reason)
        import torch

        self._torch = torch
        lib = CuptiLib.load()
        version = lib.version()
        device = torch.cuda.current_device()
        self._device_properties = device_properties(torch)
        num_sms = self._device_properties[device]["numSms"]

        # Load and warm the marker before CUPTI sees anything.
        self._marker = create_marker(torch, self._codes)
        for code in range(self._codes):
            self._marker.launch(code)
        cuda: Any = torch.cuda
        self._events = [cuda.Event() for _ in range(STEP_EVENTS)]
        torch.cuda.synchronize()

        pool = BufferPool.for_ring(
            self.ring_mb, clock=time.monotonic_ns, buffer_bytes=self._buffer_bytes
        )
        session = ActivitySession(lib, pool)
        session.open()  # raises TracerUnavailableError with CUPTI's message
        names = NameTable()
        try:
            calibration = calibrate(
                torch, lib, session, pool, names, device, self._marker, self._codes
            )
        except BaseException:
            session.close()
            names.close()
            raise
        self._lib, self._session, self._pool, self._names = lib, session, pool, names
        self.calibration = calibration
        if not calibration.size_walk_checked and self._detach_when_off:
            self._detach_when_off = False
            log.warning(
                "cupti tracer: CUPTI's record sizes differ from distanom's; records are "
                "walked with CUPTI, which must stay attached (off windows keep its cost)"
            )
        self._resolver = resolver = StepResolver(
            pool,
            self._walk,
            names,
            grid_to_code=calibration.grid_to_code,
            num_codes=self._codes,
            history_steps=self.history_steps,
            clock_offset_ns=calibration.clock_offset_ns,
            correlation_floor=calibration.correlation_floor,
            flush=session.flush,
            dropped_records=session.poll_dropped,
            gpu_passed=self.gpu_passed,
            force_flush_after_ns=self._force_after_ns,
            num_sms=num_sms,
            rank=self.rank,
        )
        self._append_mark = resolver.mark_appender()
        self._tracing = True
        self._state = "running"
        # The step after this boundary carries the calibration (a synchronize, flushes):
        # the agent judges it under the after-flush condition.
        self.boundary_flushes += 1
        if self._boundary_before_start is not None:
            # mark the boundary the agent passed just before start(), so the first
            # traced step has a marker on both sides
            step, host_end_ns = self._boundary_before_start
            self._last_step = step
            self._resolver.record_mark(self._launch_marker(step, host_end_ns))
        log.info(
            "cupti tracer on (rank %d): %s, CUPTI version %d, ring %d x %d KB, %s marker grids "
            "%s, clock offset %d ns, memcpy layout checked: %s",
            self.rank, calibration.library, version, pool.max_buffers, pool.buffer_bytes >> 10,
            calibration.marker, calibration.grids, calibration.clock_offset_ns,
            calibration.memcpy_checked,
        )  # fmt: skip

    def _walk(self, address: int, valid_size: int) -> list[int]:
        """Record offsets in a completed buffer, for the reader thread: by record size
        when calibration found the sizes right (no CUPTI call, safe while CUPTI is
        detached), else, or for a buffer that does not walk, CUPTI's walker while it is
        attached."""
        if self.calibration is not None and self.calibration.size_walk_checked:
            try:
                return iterate_by_size(buffer_view(address, valid_size))
            except ValueError:
                pass
        self.counters["cupti_walks"] += 1
        assert self._session is not None
        return self._session.record_offsets(address, valid_size)

    def close(self) -> None:
        """Stop tracing, hand CUPTI's buffers back and free what `start` loaded. Idempotent."""
        with self._read_lock:  # never free buffers under a reader
            if self._state == "closed":
                return
            was = self._state
            self._state = "closed"
            if self._session is not None:
                self._session.close()
            if self._names is not None:
                self._names.close()
            if self._marker is not None:
                self._marker.close()
                self._marker = None
            if was != "new":
                log.info("cupti tracer closed (rank %d): %s", self.rank, self.stats())

    # -- training thread ---------------------------------------------------------------

    @property
    def last_step(self) -> int | None:
        """The last step `mark_step` recorded (None before the first)."""
        return self._last_step

    @property
    def tracing(self) -> bool:
        """Whether the step after the last boundary is being traced."""
        return self._tracing

    @property
    def quiet(self) -> bool:
        """Tracing is off and stays off at the next mark (no switch on deferred)."""
        return not self._tracing and not self._want_tracing and self._state == "running"

    def end_of_training(self) -> None:
        """Training ended: stop recording, without the drain and detach of `set_tracing`
        (a stuck kernel must not hang the exit). The steps already ended stay readable."""
        if self._state != "running" or not self._tracing:
            return
        try:
            assert self._session is not None
            self._session.disable()
        except Exception as err:
            log.warning("cupti tracer: disabling at the end of training: %s", err)
        self._tracing = False

    def set_tracing(self, on: bool) -> None:
        """Switch at the boundary `mark_step` just recorded: the next step is (not)
        traced. Off: CUPTI is detached now (the closing marker is already launched). On:
        CUPTI is attached and the boundary's marker launched now, opening the next step.
        Before the first mark it is remembered and applied there."""
        self._want_tracing = bool(on)
        if self._state != "running" or self._last_step is None or on == self._tracing:
            return
        step = self._last_step
        try:
            if self._torch.cuda.is_current_stream_capturing():
                return  # no marker or synchronize inside a CUDA graph: the next mark applies it
            assert self._resolver is not None
            last = self._resolver.last_mark()
            if last is not None and last.step != step:
                last = None
            if not on:
                self._toggle(False)
                if last is not None:
                    self._resolver.amend_last_mark(last._replace(traced_after=False))
                return
            self._toggle(True)
            if last is not None and last.marker_launched:
                # Switched off and on again at this boundary: its marker, launched before
                # the detach, already opens the next step. A second one would be matched
                # to an older step of the same code and shift the numbering.
                self._resolver.amend_last_mark(last._replace(traced_after=True))
                return
            mark = self._launch_marker(step, host_end_ns=None)
            if last is not None:
                mark = mark._replace(host_end_ns=last.host_end_ns)
                self._resolver.amend_last_mark(mark)
        except Exception as err:  # never into the training loop
            self.counters["mark_errors"] += 1
            self._fail(f"set_tracing({on}) after step {step}: {type(err).__name__}: {err}")

    def mark_step(self, step: int, host_end_ns: int) -> None:
        """Step `step` ended: launch its marker and remember it (training thread; never raises)."""
        last = self._last_step
        if (
            not self._want_tracing
            and not self._tracing
            and self._state == "running"
            and (last is None or step > last)
        ):
            # Untraced and staying so, ~95% of steps at a 1% budget: no marker to launch
            # or switch to make, so no capture check (a CUDA call per step); the mark only
            # tells the resolver where the step ended (inside a CUDA graph capture too:
            # `marks_while_capturing` counts traced marks only). One frame, no lock: it
            # runs at nearly every boundary. Its launch times are the boundary's (no
            # marker was launched); the monotonic one dates what the resolver retains.
            self._last_step = step
            counters = self.counters
            counters["marks"] += 1
            counters["marks_untraced"] += 1
            code = step % self._codes
            mark = (step, host_end_ns, host_end_ns, _monotonic_ns(), code, False, False)
            self._append_mark(_new_tuple(StepMark, mark))
            return
        if self._state == "new":
            self._boundary_before_start = (step, host_end_ns)  # start() marks it
            return
        if self._state != "running":
            return
        try:
            self.counters["marks"] += 1
            if self._last_step is not None and step <= self._last_step:
                self.counters["marks_out_of_order"] += 1
                return
            want = self._want_tracing  # or tracing now: untraced marks took the path above
            if self._torch.cuda.is_current_stream_capturing():
                self.counters["marks_while_capturing"] += (
                    1  # a marker inside a CUDA graph would replay
                )
                return
            self._last_step = step
            if want and not self._tracing:
                self._toggle(True)  # before the marker: it bounds the first traced step
            mark = self._launch_marker(step, host_end_ns)  # tracing is on here
            if not want and self._tracing:
                self._toggle(False)  # after the marker: it closes the last traced step
                mark = mark._replace(traced_after=False)
            assert self._resolver is not None
            self._resolver.record_mark(mark)
        except Exception as err:  # never into the training loop
            self.counters["mark_errors"] += 1
            self._fail(f"mark_step({step}): {type(err).__name__}: {err}")

    def _launch_marker(self, step: int, host_end_ns: int | None) -> StepMark:
        """Launch the marker of boundary `step` (tracing is on) and describe it."""
        code = step % self._codes
        launch_wall, launch_mono = time.time_ns(), time.monotonic_ns()
        assert self._marker is not None
        self._marker.launch(code)
        self.counters["markers_launched"] += 1
        self._probe_lag(step)
        end = launch_wall if host_end_ns is None else host_end_ns
        return StepMark(step, end, launch_wall, launch_mono, code, True, True)

    def _probe_lag(self, step: int) -> None:
        """Record an event after this step's marker; every LAG_PROBE_EVERY markers, alarm
        if the one LAG_PROBE_AGE markers back has not completed yet (the GPU lags that far
        behind the host). The lag grows by at most one step per marker, so a check every
        4 markers still catches it below 12 + 3 < K steps."""
        event = self._events[self._markers_launched % STEP_EVENTS]
        self._markers_launched += 1
        with self._events_lock:
            event.record()
            self._step_events.append((step, event))
            old = (
                self._step_events[-1 - LAG_PROBE_AGE]
                if len(self._step_events) > LAG_PROBE_AGE
                and self._markers_launched % LAG_PROBE_EVERY == 0
                else None
            )
        if old is not None and not old[1].query():
            self.counters["lag_alarms"] += 1
            assert self._resolver is not None
            self._resolver.flag_ambiguous(old[0] - 1, step)
            if self.counters["lag_alarms"] == 1:
                log.warning(
                    "the GPU lags the host by >= %d steps (at step %d): steps from %d on "
                    "cannot be numbered safely while it does, and will not be served",
                    LAG_PROBE_AGE, step, old[0] - 1,
                )  # fmt: skip

    def gpu_passed(self, step: int) -> bool:
        """Whether the GPU has run the marker that closed `step` (reader thread). Steps
        older than the events kept count as passed: a lag that long raises lag alarms."""
        with self._events_lock:
            for s, event in reversed(self._step_events):
                if s == step:
                    # not while the script captures a CUDA graph: the query would break it
                    return CAPTURES.quiet_query(event.query, while_capturing=False)
                if s < step:
                    break
            return True

    def _toggle(self, on: bool) -> None:
        session = self._session
        assert session is not None
        t0 = time.perf_counter_ns()
        if on:
            was_detached = not session.attached
            session.attach()  # re-attaches if detached; refuses if another client came
            self.counters["enables"] += 1
            if was_detached:
                self.boundary_flushes += 1
            # The next step carries the attach (milliseconds, as long as a short step):
            # it is judged under the after-flush condition, or distanom would report an
            # anomaly it caused itself (docs/cupti.md).
        elif self._detach_when_off and session.lib.can_detach:
            self._detach(session)
        else:
            session.disable()
            self.counters["disables"] += 1
        self._tracing = on
        took = time.perf_counter_ns() - t0
        self.counters["toggle_ns_total"] += took
        self.counters["toggle_ns_max"] = max(self.counters["toggle_ns_max"], took)

    def _detach(self, session: ActivitySession) -> None:
        """Tracing goes off: detach CUPTI, since its per-launch cost outlives a mere
        disable. The synchronize is CUPTI's condition for detaching (every launch it
        instrumented has finished); it costs one drain of the GPU queue per off switch.
        Kinds are disabled first, so a launch from another thread after this point is not
        instrumented. Only the current device is drained: one device per rank."""
        session.disable()
        self._torch.cuda.synchronize()
        # The next step carries the drain and the detach (milliseconds): the agent
        # judges it under the after-flush condition, not as an ordinary untraced step.
        self.boundary_flushes += 1
        try:
            session.detach()
        except DetachError as err:
            # Kinds are disabled and buffers flushed; only cuptiFinalize failed: go on
            # disabling instead, at the attached cost, and say so once.
            self._detach_when_off = False
            self.counters["detach_failures"] += 1
            log.warning(
                "cannot detach CUPTI (%s): off windows keep it attached, which keeps part of "
                "its per-kernel cost", err,
            )  # fmt: skip
            self.counters["disables"] += 1
            return
        self.counters["detaches"] += 1
        assert self._pool is not None
        if self._pool.counters["buffers_abandoned"] > MAX_ABANDONED_BUFFERS:
            # CUPTI kept buffers through the forced flush: each detach would leak one.
            self._detach_when_off = False
            log.warning(
                "CUPTI kept %d activity buffers through detaches; off windows now keep it "
                "attached", self._pool.counters["buffers_abandoned"],
            )  # fmt: skip

    def _fail(self, reason: str) -> None:
        """Step aside for the rest of the run (training thread). CUPTI is detached too
        where it can be: merely disabled, it would keep its per-launch cost."""
        self.failure = reason
        self._state = "failed"
        log.error("cupti tracer disabled: %s", reason)
        session = self._session
        try:
            if session is not None and session.attached:
                session.disable()
                # only where reading needs no CUPTI (size walk checked) and detaching works
                if self._detach_when_off and session.lib.can_detach:
                    self._torch.cuda.synchronize()  # raises on a broken context: stays
                    session.detach()
        except Exception as err:
            log.warning("while giving CUPTI up after a failure: %s", err)
        self._tracing = False

    # -- capture thread ----------------------------------------------------------------

    def availability(self, step: int) -> Availability:
        """Whether `step_trace(step)` can answer now."""
        return self.explain(step)[0]

    def explain(self, step: int) -> tuple[Availability, str]:
        """`availability(step)` and the reason for it, in words."""
        with self._read_lock:
            if self._resolver is None or self._state == "closed":
                return Availability.GONE, f"cupti tracer is {self._state}"
            state, _, reason = self._resolver.locate(step)
            if state is Availability.GONE:
                log.debug("step %d gone: %s", step, reason)
            return state, reason

    def step_trace(self, step: int) -> StepTrace:
        """The events of `step` as a `StepTrace`; KeyError unless it is READY."""
        with self._read_lock:
            if self._resolver is None or self._state == "closed":
                raise KeyError(f"step {step}: cupti tracer is not running")
            state, found, reason = self._resolver.locate(step)
            if state is not Availability.READY or found is None:
                raise KeyError(f"step {step} is {state.value}: {reason}")
            trace = self._resolver.build(step, found, {})
            trace.metadata["deviceProperties"] = self._device_properties
            if self.calibration is not None:
                trace.metadata["cupti_version"] = self.calibration.cupti_version
            return trace

    def stats(self) -> dict[str, int]:
        """Tracer-wide counters (marks, toggles, buffers, CUPTI drops, resolver counts)."""
        out = dict(self.counters)
        if self._pool is not None:
            out.update(self._pool.stats())
        if self._resolver is not None:
            out.update(self._resolver.counters)
        if self._session is not None:
            out["cupti_dropped_records"] = self._session.dropped_records
            out["session_flushes"] = self._session.flushes
        out["callback_errors"] = callbacks.callback_errors
        return out
