"""The `cupti` tracer backend: raw CUPTI activity records, decoded only for captured steps.

Owns the step bookkeeping of the backend. On the training thread, `mark_step` launches
one tiny marker kernel on the current stream and remembers (step, host times); nothing
else happens there, except when the duty cycle switches tracing (`set_tracing`): off
drains the GPU and detaches CUPTI, whose per-launch cost outlives a mere disable; on
re-attaches it. CUPTI (see `cupti_lib`) collects kernel, memcpy and memset records
into a bounded ring of raw buffers. When the capture worker asks for a step, on its own
thread, `StepResolver` flushes CUPTI if needed, indexes only the buffers that can hold
the step, finds the step's two marker kernels, takes every record whose correlation id
lies between them, and hands Kineto-shaped events on as a `StepTrace`.

How records are numbered to steps (the part that must never be silently wrong):
- Correlation ids are process-wide and increase in launch order while CUPTI stays
  attached (after a detach they start again: records are ordered by attachment epoch,
  then id), so the records of step N are exactly those launched between marker N-1 and
  marker N, whatever the stream and however far the GPU lags the host.
- Each marker encodes `step % K` (K = 16) in its grid size (see `step_marker`: code + 1
  blocks for the driver-launched marker, an input of 1 + code * 4096 elements for the
  jiterator fallback). `start()` launches the K shapes once and reads CUPTI's records
  back to learn grid → code (this also checks the record layout, the marker name and the
  clock against the host), and refuses to run if the K grids are not distinct.
- A marker record is matched to the newest marked step with its code whose host launch
  time is not after the marker's GPU start (a kernel never starts before it is
  launched), walking markers from the newest down, steps strictly decreasing. A lost
  marker or a dropped buffer therefore cannot shift the numbering: the next marker still
  carries its own code. Only a GPU lagging the host by K steps or more could fool it, so
  `mark_step` records a CUDA event after each marker and, every 4th marker, queries the
  one recorded 12 markers earlier: if it has not completed, the GPU lags at least 12 steps
  and the steps around it are flagged ambiguous (GONE, counted as `lag_alarms`). The
  same events tell the reader whether the GPU has passed a step's closing marker, the
  condition for a forced CUPTI flush (see `StepResolver.locate`).
- Step N is served only if markers N-1 and N were both found and no other marker lies
  between them (`marker_verified` = 1 in its stats); else it is GONE, with the reason
  logged and counted. It stays PENDING while CUPTI still holds a buffer it asked for
  before marker N ran (one buffer per launching thread: the autograd thread's may hold
  the backward pass); a forced flush ends the wait, and a buffer even that keeps is
  counted in the step's stats (`held_buffers_at_serve`).

Where the data goes: `step_trace` returns a `StepTrace` to the capture module, which
writes it; nothing here touches disk.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distanom.errors import TracerUnavailableError
from distanom.tracers import cupti_lib
from distanom.tracers.base import Availability, StepTrace
from distanom.tracers.cupti_records import (
    KIND_CONCURRENT_KERNEL,
    KIND_MEMCPY,
    KIND_MEMSET,
    BufferIndex,
    DecodeStats,
    GpuActivity,
    MarkerRecord,
    NameTable,
    RecordIterator,
    buffer_view,
    decode_records,
    index_buffer,
    iterate_by_size,
    kineto_events,
)
from distanom.tracers.step_marker import (
    MARKER_LENGTH_STRIDE,
    MARKER_NAME,
    JiteratorMarker,
    StepMarker,
    create_marker,
    marker_length,
)

if TYPE_CHECKING:
    from distanom.config import TracerConfig

log = logging.getLogger(__name__)

MARKER_PREFIX = MARKER_NAME
MARKER_CODES = 16  # K: markers encode step % K
CLOCK_TOLERANCE_NS = 200_000  # CUPTI vs time.time_ns(): measured within ~3 µs
LAG_PROBE_AGE = 12  # markers after which a marker's event must have completed (< K)
LAG_PROBE_EVERY = 4  # markers between two lag checks (each check is an event query)
MAX_ABANDONED_BUFFERS = 8  # buffers CUPTI may keep through detaches before we stop detaching
STEP_EVENTS = 64  # CUDA events kept, one per recent marker
# A buffer CUPTI asked for up to this long after the closing marker ran may still hold
# the step's records: the marker's GPU time is mapped to the host clock through the
# calibrated offset, which is good to CLOCK_TOLERANCE_NS.
HELD_BUFFER_MARGIN_NS = 5 * CLOCK_TOLERANCE_NS


def is_marker_name(name: str) -> bool:
    return name.startswith(MARKER_PREFIX)


@dataclass(frozen=True)
class StepMark:
    """What the training thread recorded at the end of a step."""

    step: int
    host_end_ns: int  # as the agent passed it (time.time_ns())
    launch_wall_ns: int  # time.time_ns() just before the marker launch: CUPTI's clock
    launch_mono_ns: int  # time.monotonic_ns() at the same moment: compared with buffer arrivals
    code: int
    marker_launched: bool  # tracing was on when the marker was launched
    traced_after: bool  # tracing stayed on after this boundary (the next step is traced)


def assign_markers(
    markers: Sequence[MarkerRecord],
    marks: Sequence[StepMark],
    grid_to_code: Mapping[int, int],
    *,
    clock_offset_ns: int = 0,
    tolerance_ns: int = CLOCK_TOLERANCE_NS,
    correlation_floor: int = 0,
) -> tuple[dict[int, MarkerRecord], int]:
    """Match marker records to marked steps (see the module docstring). Returns
    {step: marker} and how many markers matched no retained step."""
    launched = [m for m in marks if m.marker_launched]
    result: dict[int, MarkerRecord] = {}
    unmatched = 0
    upper = math.inf
    for rec in sorted(markers, key=lambda r: r.correlation, reverse=True):
        if rec.correlation <= correlation_floor:
            continue
        code = grid_to_code.get(rec.grid_x)
        best: StepMark | None = None
        if code is not None:
            for mark in reversed(launched):
                if mark.step >= upper or mark.code != code:
                    continue
                if mark.launch_wall_ns + clock_offset_ns - tolerance_ns > rec.start_ns:
                    continue  # launched after this marker ran: not its step
                best = mark
                break
        if best is None:
            unmatched += 1
            continue
        result[best.step] = rec
        upper = best.step
    return result, unmatched


@dataclass(frozen=True)
class _Located:
    lo_mark: StepMark
    hi_mark: StepMark
    lo: MarkerRecord
    hi: MarkerRecord
    held_buffers: int = 0
    """Buffers CUPTI still held, that may hold records of the step, when it was served
    anyway (after a forced flush that did not return them)."""


class StepResolver:
    """Finds one step's records in the pool's retained buffers. No torch, no CUPTI calls
    except through the injected `flush` and record walker (both refuse to call CUPTI
    while it is detached); runs on the reader's thread."""

    # Each flush hands back a partly filled buffer that then takes a whole ring slot, so
    # a capture worker polling a PENDING step must not flush on every poll.
    MIN_FLUSH_INTERVAL_NS = 50_000_000

    def __init__(
        self,
        pool: cupti_lib.BufferPool,
        iterate: RecordIterator,
        names: NameTable,
        *,
        grid_to_code: Mapping[int, int],
        num_codes: int,
        history_steps: int,
        clock_offset_ns: int = 0,
        correlation_floor: int = 0,
        flush: Callable[[bool], None] | None = None,
        dropped_records: Callable[[], int] | None = None,
        gpu_passed: Callable[[int], bool] | None = None,
        force_flush_after_ns: int = 2_000_000_000,
        mono_clock: Callable[[], int] = time.monotonic_ns,
        num_sms: int | None = None,
        rank: int = 0,
    ) -> None:
        self.pool = pool
        self._iterate = iterate
        self.names = names
        self.grid_to_code = dict(grid_to_code)
        self.num_codes = num_codes
        self.history_steps = history_steps
        self.clock_offset_ns = clock_offset_ns
        self.correlation_floor = correlation_floor
        self._flush = flush
        self._dropped = dropped_records
        self._gpu_passed = gpu_passed
        self._force_after = force_flush_after_ns
        self._now = mono_clock
        self.num_sms = num_sms
        self.rank = rank
        self._marks: deque[StepMark] = deque(maxlen=history_steps + num_codes + 2)
        self._marks_lock = threading.Lock()
        self._indexes: dict[int, BufferIndex] = {}
        self._unindexable: set[int] = set()  # buffers that failed once: not tried again
        self._ambiguous: list[tuple[int, int]] = []  # step ranges the lag probe flagged
        self._last_flush_ns = -(1 << 62)
        self._forced_for: set[int] = set()
        self._kept_before_ns = 0  # buffers asked for before the last forced flush
        self.counters: dict[str, int] = {
            "buffers_indexed": 0,
            "records_indexed": 0,
            "other_kind_records": 0,
            "unmatched_markers_last": 0,
            "inconsistent_markers": 0,
            "missing_markers": 0,
            "steps_served": 0,
            "awaiting_buffer_polls": 0,
            "steps_served_with_held_buffers": 0,
            "flushes": 0,
            "forced_flushes": 0,
            "index_errors": 0,
        }

    # -- training thread -------------------------------------------------------------

    def record_mark(self, mark: StepMark) -> None:
        with self._marks_lock:
            self._marks.append(mark)

    def amend_last_mark(self, mark: StepMark) -> None:
        """Replace the newest mark (same step): tracing was switched right after it."""
        with self._marks_lock:
            if not self._marks or self._marks[-1].step != mark.step:
                raise ValueError(f"no mark of step {mark.step} to amend")
            self._marks[-1] = mark

    def flag_ambiguous(self, first_step: int, last_step: int) -> None:
        """Steps in [first_step, last_step] ran while the GPU lagged too far behind the
        host for marker codes to be unambiguous: never serve them."""
        with self._marks_lock:
            self._ambiguous.append((first_step, last_step))
            del self._ambiguous[:-64]

    def _is_ambiguous(self, step: int) -> bool:
        with self._marks_lock:
            return any(a <= step <= b for a, b in self._ambiguous)

    def last_step(self) -> int | None:
        with self._marks_lock:
            return self._marks[-1].step if self._marks else None

    def last_mark(self) -> StepMark | None:
        with self._marks_lock:
            return self._marks[-1] if self._marks else None

    def _snapshot(self) -> list[StepMark]:
        with self._marks_lock:
            return list(self._marks)

    # -- indexing ----------------------------------------------------------------------

    def _index(self, buf: cupti_lib.CompletedBuffer) -> BufferIndex | None:
        if buf.seq in self._unindexable:
            return None
        if not self.pool.pin(buf.seq):
            return None  # recycled meanwhile
        try:
            offsets = self._iterate(buf.address, buf.valid_size)
            view = buffer_view(buf.address, buf.valid_size)
            idx = index_buffer(view, offsets, buf.seq, self.names, is_marker_name, buf.epoch)
        except Exception as err:  # a malformed buffer costs that buffer, not the tracer
            self.counters["index_errors"] += 1
            if not isinstance(err, cupti_lib.CuptiError):  # e.g. detached now: try later
                if len(self._unindexable) > 4096:
                    self._unindexable.clear()
                self._unindexable.add(buf.seq)
            log.warning("cannot index CUPTI buffer %d (%d bytes): %s", buf.seq, buf.valid_size, err)
            return None
        finally:
            self.pool.unpin(buf.seq)
        self.counters["buffers_indexed"] += 1
        self.counters["records_indexed"] += len(idx.offsets)
        self.counters["other_kind_records"] += idx.other_kinds
        return idx

    def index_since(self, since_mono_ns: int) -> list[BufferIndex]:
        """Index (once) every retained buffer that completed at or after `since_mono_ns`;
        forget buffers the pool recycled. Returns all live indexes, oldest first."""
        retained = self.pool.completed()
        marks = self._snapshot()
        # Buffers that completed before the oldest retained mark hold no servable step.
        horizon = marks[0].launch_mono_ns if marks else 0
        live = {b.seq for b in retained if b.completed_ns >= horizon}
        for seq in [s for s in self._indexes if s not in live]:
            del self._indexes[seq]
        for buf in reversed(retained):
            if buf.completed_ns >= since_mono_ns and buf.seq not in self._indexes:
                idx = self._index(buf)
                if idx is not None:
                    self._indexes[buf.seq] = idx
        return [self._indexes[s] for s in sorted(self._indexes)]

    # -- locating a step -----------------------------------------------------------------

    def _try_locate(
        self, marks: list[StepMark], lo: StepMark, hi: StepMark
    ) -> tuple[_Located | None, str]:
        completed_before = self.pool.counters["buffers_completed"]
        indexes = self.index_since(lo.launch_mono_ns)
        markers = [m for idx in indexes for m in idx.markers]
        assigned, unmatched = assign_markers(
            markers, marks, self.grid_to_code,
            clock_offset_ns=self.clock_offset_ns, correlation_floor=self.correlation_floor,
        )  # fmt: skip
        self.counters["unmatched_markers_last"] = unmatched
        m_lo, m_hi = assigned.get(lo.step), assigned.get(hi.step)
        if m_lo is None or m_hi is None:
            # Markers run in launch order on one stream, so a later marker already
            # delivered while ours is not means ours is lost, not late.
            if (m_hi is not None and m_lo is None) or any(s > hi.step for s in assigned):
                return None, "lost"
            return None, "pending"
        between = [m for m in markers if m_lo.correlation < m.correlation < m_hi.correlation]
        if between:
            self.counters["inconsistent_markers"] += 1
            log.warning(
                "step %d: %d marker record(s) between the markers of steps %d and %d: "
                "numbering inconsistent, step not served", hi.step, len(between), lo.step, hi.step,
            )  # fmt: skip
            return None, "inconsistent"
        # Both markers are back, but CUPTI fills one buffer per launching thread: the
        # backward pass's records (autograd thread) can sit in a buffer it still holds,
        # e.g. behind a collective kernel still waiting for another rank. Measured on 2
        # H200s with DDP: steps served without them lost ~60% of their kernels.
        closed_ns = self._host_mono_of(hi, m_hi.end_ns) + HELD_BUFFER_MARGIN_NS
        # buffers older than the last forced flush survived it: they will not come back,
        # so they are not waited for (but still reported below)
        awaited = self.pool.held_since(closed_ns, self._kept_before_ns)
        held = self.pool.held_since(closed_ns)
        if self.pool.counters["buffers_completed"] != completed_before:
            # a buffer came back after the index was taken and before the held counts:
            # neither indexed nor counted as held; look again at the next poll
            return None, "pending"
        if awaited and hi.step not in self._forced_for:
            return None, "held"
        if held:  # a forced flush did not return them: serve what there is, and say so
            self.counters["steps_served_with_held_buffers"] += 1
        return _Located(lo, hi, m_lo, m_hi, held), "ready"

    def _host_mono_of(self, mark: StepMark, cupti_ns: int) -> int:
        """A CUPTI timestamp on the host's monotonic clock, through `mark`'s pair of
        wall and monotonic launch times."""
        return cupti_ns - self.clock_offset_ns - mark.launch_wall_ns + mark.launch_mono_ns

    def locate(
        self, step: int, allow_flush: bool = True
    ) -> tuple[Availability, _Located | None, str]:
        """Availability of `step`, the markers bounding it when READY, and why."""
        marks = self._snapshot()
        if not marks or step > marks[-1].step:
            return Availability.PENDING, None, "step has not ended"
        if marks[-1].step - step >= self.history_steps:
            return Availability.GONE, None, "older than history_steps"
        steps = [m.step for m in marks]
        i = bisect.bisect_left(steps, step)
        if i >= len(marks) or marks[i].step != step:
            return Availability.GONE, None, "step was never marked"
        if i == 0:
            return Availability.GONE, None, "no marker before this step (first marked step)"
        lo, hi = marks[i - 1], marks[i]
        if lo.step != step - 1:
            # a boundary went unmarked (inside a CUDA graph capture): the records between
            # the two markers belong to more than this step
            return Availability.GONE, None, f"boundary {step - 1} was not marked"
        if self._is_ambiguous(lo.step) or self._is_ambiguous(hi.step):
            return Availability.GONE, None, "GPU lagged the host too far: numbering ambiguous"
        if not lo.traced_after or not hi.marker_launched:
            return Availability.GONE, None, "tracing was off for this step"
        if lo.launch_mono_ns <= self.pool.lost_through_ns:
            return Availability.GONE, None, "its records may be in a recycled ring buffer"
        found, why = self._try_locate(marks, lo, hi)
        if why == "held":
            self.counters["awaiting_buffer_polls"] += 1
        if found is None and why in ("pending", "held") and allow_flush and self._flush is not None:
            now = self._now()
            if now - self._last_flush_ns >= self.MIN_FLUSH_INTERVAL_NS:
                self._last_flush_ns = now
                self._flush(False)
                self.counters["flushes"] += 1
                found, why = self._try_locate(marks, lo, hi)
            age = marks[-1].step - step
            if (
                found is None
                and why in ("pending", "held")
                and (now - hi.launch_mono_ns > self._force_after or 2 * age >= self.history_steps)
                and step not in self._forced_for
                and (self._gpu_passed is None or self._gpu_passed(hi.step))
            ):
                # CUPTI only hands back a buffer whose records are all complete; on a GPU
                # that is never idle that waits for the buffer to fill. Before the step
                # ages out of the history (or after force_flush_after), a forced flush
                # delivers it now; records of kernels still running then come back with
                # zero timestamps (dropped and counted in those later steps' stats). Only
                # once the GPU has run the closing marker: else the marker itself would
                # come back unfinished and the step would be lost.
                if len(self._forced_for) > 4 * self.history_steps:
                    self._forced_for.clear()
                self._forced_for.add(step)
                flushed_at = self._now()
                self._flush(True)
                # what CUPTI still holds now survived a forced flush: not waited for again
                self._kept_before_ns = flushed_at
                self.counters["forced_flushes"] += 1
                log.info(
                    "step %d: forced CUPTI flush after %.1f s pending",
                    step,
                    (now - hi.launch_mono_ns) / 1e9,
                )
                found, why = self._try_locate(marks, lo, hi)
        if found is not None:
            return Availability.READY, found, "ready"
        if why == "lost":
            self.counters["missing_markers"] += 1
            return Availability.GONE, None, "marker record missing (dropped by CUPTI or evicted)"
        if why == "inconsistent":
            return Availability.GONE, None, "marker numbering inconsistent"
        if why == "held":
            return Availability.PENDING, None, "CUPTI still holds a buffer with its records"
        return Availability.PENDING, None, "markers not yet delivered by CUPTI"

    # -- building a trace ------------------------------------------------------------------

    def collect(self, found: _Located) -> tuple[list[GpuActivity], DecodeStats]:
        """Decode every record launched between the two markers."""
        lo_c, hi_c = found.lo.correlation, found.hi.correlation
        stats = DecodeStats()
        records: list[GpuActivity] = []
        by_seq = {b.seq: b for b in self.pool.completed()}
        for seq, idx in sorted(self._indexes.items()):
            if (
                not len(idx.correlation)
                or idx.max_correlation <= lo_c
                or idx.min_correlation >= hi_c
            ):
                continue
            mask = (idx.correlation > lo_c) & (idx.correlation < hi_c)
            if not mask.any():
                continue
            buf = by_seq.get(seq)
            if buf is None or not self.pool.pin(seq):
                raise KeyError(f"a buffer holding the step was recycled while reading (seq {seq})")
            try:
                view = buffer_view(buf.address, buf.valid_size)
                records.extend(
                    decode_records(view, idx.offsets[mask].tolist(), self.names, stats, buf.epoch)
                )
            finally:
                self.pool.unpin(seq)
        return records, stats

    def build(self, step: int, found: _Located, extra_stats: Mapping[str, int]) -> StepTrace:
        t0 = time.perf_counter()
        records, dstats = self.collect(found)
        if self.pool.lost_through_ns >= found.lo_mark.launch_mono_ns:
            raise KeyError(f"step {step}: a buffer holding it was recycled while reading")
        lo_end, hi_start = found.lo.end_ns, found.hi.start_ns
        outside = sum(1 for r in records if r.start_ns < lo_end or r.end_ns > hi_start)
        first = min([r.start_ns for r in records] + [lo_end])
        base = first - first % 1_000_000  # whole milliseconds: short, exact `ts` values
        events = kineto_events(records, base, self.num_sms)
        kinds = dstats.counts
        stats: dict[str, int] = {
            "kernels": kinds.get(KIND_CONCURRENT_KERNEL, 0),
            "memcpys": kinds.get(KIND_MEMCPY, 0),
            "memsets": kinds.get(KIND_MEMSET, 0),
            "zero_timestamp_dropped": dstats.zero_timestamp,
            "end_before_start_dropped": dstats.end_before_start,
            "unknown_kind_dropped": dstats.unknown_kind,
            "outside_bounds": outside,
            "marker_verified": 1,
            "marker_codes": self.num_codes,
            "cupti_dropped_records": self._dropped() if self._dropped is not None else 0,
            "ring_evicted_buffers": self.pool.counters["buffers_evicted"],
            "buffer_requests_refused": self.pool.counters["buffer_requests_refused"],
            "unreadable_names": self.names.unreadable,
            "forced_flushes": self.counters["forced_flushes"],
            "held_buffers_at_serve": found.held_buffers,
            "gpu_lag_ns": max(
                0, found.hi.end_ns - (found.hi_mark.launch_wall_ns + self.clock_offset_ns)
            ),
        }
        stats.update(extra_stats)
        stats["decode_us"] = int((time.perf_counter() - t0) * 1e6)
        metadata: dict[str, Any] = {
            "distanom": {
                "tracer": "cupti",
                "rank": self.rank,
                "step": step,
                "marker_correlation": [found.lo.correlation, found.hi.correlation],
                "marker_gpu_ns": [lo_end, hi_start],
                "host_end_ns": found.hi_mark.host_end_ns,
                "prev_host_end_ns": found.lo_mark.host_end_ns,
            }
        }
        self.counters["steps_served"] += 1
        return StepTrace(
            step=step, events=events, base_time_ns=base, metadata=metadata, stats=stats
        )


# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """What `start()` learned from launching each marker shape once."""

    grid_to_code: dict[int, int]
    lengths: list[int]  # jiterator marker: input length per code (else empty)
    grids: list[int]
    block_work_size: int | None  # jiterator: elements per block if grid == ceil(length / it)
    correlation_floor: int
    clock_offset_ns: int  # CUPTI timestamp - time.time_ns()
    memcpy_checked: bool
    cupti_version: int
    library: str
    marker: str = "driver"  # which StepMarker launched the markers
    size_walk_checked: bool = False  # record sizes agree with cuptiActivityGetNextRecord


def _device_properties(torch: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        entry = {
            "id": i,
            "name": p.name,
            "totalGlobalMem": int(p.total_memory),
            "computeMajor": int(p.major),
            "computeMinor": int(p.minor),
            "numSms": int(p.multi_processor_count),
        }
        for key, attr in (
            ("maxThreadsPerMultiprocessor", "max_threads_per_multi_processor"),
            ("warpSize", "warp_size"),
            ("regsPerMultiprocessor", "regs_per_multiprocessor"),
            ("sharedMemPerBlock", "shared_memory_per_block"),
            ("sharedMemPerBlockOptin", "shared_memory_per_block_optin"),
            ("sharedMemPerMultiprocessor", "shared_memory_per_multiprocessor"),
        ):
            value = getattr(p, attr, None)
            if value is not None:
                entry[key] = int(value)
        out.append(entry)
    return out


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
        buffer_kb: int = cupti_lib.DEFAULT_BUFFER_BYTES >> 10,
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
        self._want_tracing = True
        self._tracing = False
        self._read_lock = threading.Lock()
        self._lib: cupti_lib.CuptiLib | None = None
        self._session: cupti_lib.ActivitySession | None = None
        self._pool: cupti_lib.BufferPool | None = None
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
        if self._state != "new":
            raise RuntimeError(f"CuptiTracer.start() called in state {self._state}")
        reason = _cuda_reason()
        if reason is not None:
            raise TracerUnavailableError(reason)
        import torch

        self._torch = torch
        lib = cupti_lib.CuptiLib.load()
        version = lib.version()
        device = torch.cuda.current_device()
        self._device_properties = _device_properties(torch)
        num_sms = self._device_properties[device]["numSms"]

        # Load and warm the marker before CUPTI sees anything.
        self._marker = create_marker(torch, self._codes)
        for code in range(self._codes):
            self._marker.launch(code)
        cuda: Any = torch.cuda
        self._events = [cuda.Event() for _ in range(STEP_EVENTS)]
        torch.cuda.synchronize()

        pool = cupti_lib.BufferPool.for_ring(
            self.ring_mb, clock=time.monotonic_ns, buffer_bytes=self._buffer_bytes
        )
        session = cupti_lib.ActivitySession(lib, pool)
        session.open()  # raises TracerUnavailableError with CUPTI's message
        names = NameTable()
        try:
            calibration = self._calibrate(torch, lib, session, pool, names, device)
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
        self._resolver = StepResolver(
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

    def _calibrate(
        self,
        torch: Any,
        lib: cupti_lib.CuptiLib,
        session: cupti_lib.ActivitySession,
        pool: cupti_lib.BufferPool,
        names: NameTable,
        device: int,
    ) -> Calibration:
        """Launch every marker shape once (plus one 16-byte host-to-device copy), read
        the records back and check layout, names, ordering and clock."""
        offsets = []
        for _ in range(3):
            offsets.append(lib.timestamp() - time.time_ns())
        clock_offset = sorted(offsets)[1]
        before = time.time_ns()
        assert self._marker is not None
        for code in range(self._codes):
            self._marker.launch(code)
        host = torch.arange(4, dtype=torch.int32)
        copied = host.to(f"cuda:{device}")
        torch.cuda.synchronize()
        after = time.time_ns()
        del copied
        resolver = StepResolver(
            pool, lib.record_offsets, names, grid_to_code={}, num_codes=self._codes, history_steps=2
        )
        markers: list[MarkerRecord] = []
        indexes: list[BufferIndex] = []
        # After a synchronize the records exist, but CUPTI may still be completing them:
        # retry the default flush (which returns only complete buffers) for up to ~2 s
        # before a forced one (which may return unfinished records with zero timestamps).
        for attempt in range(100):
            session.flush(forced=attempt == 99)
            indexes = resolver.index_since(0)
            markers = sorted((m for i in indexes for m in i.markers), key=lambda m: m.correlation)
            if len(markers) >= self._codes:
                break
            time.sleep(0.02)
        log.debug("calibration: %d flush(es) to get %d markers", attempt + 1, len(markers))
        problems: list[str] = []
        if len(markers) != self._codes:
            problems.append(
                f"expected {self._codes} marker records, CUPTI delivered {len(markers)}"
            )
        grids = [m.grid_x for m in markers]
        if len(set(grids)) != len(grids):
            problems.append(f"marker grids not distinct: {grids}")
        lo, hi = (
            before + clock_offset - CLOCK_TOLERANCE_NS,
            after + clock_offset + CLOCK_TOLERANCE_NS,
        )
        for m in markers:
            if not (lo <= m.start_ns <= m.end_ns <= hi):
                problems.append(
                    f"marker timestamps [{m.start_ns}, {m.end_ns}] outside the host "
                    f"window [{lo}, {hi}] (clock or record layout wrong)"
                )
                break
        if problems:
            raise TracerUnavailableError("CUPTI marker calibration failed: " + "; ".join(problems))
        floor = max((idx.max_correlation for idx in indexes), default=0)
        memcpy_checked = self._check_memcpy(indexes, pool, names, markers[-1].correlation)
        size_walk_checked = self._check_size_walk(pool, lib)
        lengths: list[int] = []
        block_work: int | None = None
        if isinstance(self._marker, JiteratorMarker):
            # Report torch's launch formula as observed: grid = ceil(length / block work
            # size), the block work size a multiple of the 128-thread block.
            lengths = [marker_length(c) for c in range(self._codes)]
            for bw in range(128, 16 * MARKER_LENGTH_STRIDE + 1, 128):
                if all(math.ceil(n / bw) == g for n, g in zip(lengths, grids, strict=True)):
                    block_work = bw
                    break
        return Calibration(
            grid_to_code={g: c for c, g in enumerate(grids)},
            lengths=lengths,
            grids=grids,
            block_work_size=block_work,
            marker=self._marker.kind,
            size_walk_checked=size_walk_checked,
            correlation_floor=floor,
            clock_offset_ns=clock_offset,
            memcpy_checked=memcpy_checked,
            cupti_version=lib.version(),
            library=lib.path,
        )

    @staticmethod
    def _check_size_walk(pool: cupti_lib.BufferPool, lib: cupti_lib.CuptiLib) -> bool:
        """Whether walking by distanom's record sizes finds exactly the records CUPTI's
        own walker finds, in the calibration buffers (kernels and a memcpy)."""
        buffers = pool.completed()
        for buf in buffers:
            try:
                ours = iterate_by_size(buffer_view(buf.address, buf.valid_size))
            except ValueError:
                return False
            if ours != lib.record_offsets(buf.address, buf.valid_size):
                return False
        return bool(buffers)

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

    @staticmethod
    def _check_memcpy(
        indexes: list[BufferIndex], pool: cupti_lib.BufferPool, names: NameTable, after_corr: int
    ) -> bool:
        by_seq = {b.seq: b for b in pool.completed()}
        seen: list[str] = []  # other threads may copy meanwhile: not proof of a bad layout
        for idx in indexes:
            buf = by_seq.get(idx.seq)
            if buf is None:
                continue
            mask = (idx.kinds == KIND_MEMCPY) & (idx.correlation > after_corr)
            view = buffer_view(buf.address, buf.valid_size)
            stats = DecodeStats()
            for rec in decode_records(view, idx.offsets[mask].tolist(), names, stats):
                if rec.bytes == 16 and rec.copy_kind == 1:
                    return True
                seen.append(f"{rec.bytes} bytes, copy kind {rec.copy_kind}")
        log.warning(
            "calibration: no record of the 16-byte host-to-device copy (memcpy records seen: "
            "%s); memcpy layout unchecked",
            seen or "none",
        )
        return False

    def close(self) -> None:
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
                    self._resolver.amend_last_mark(dataclasses.replace(last, traced_after=False))
                return
            self._toggle(True)
            if last is not None and last.marker_launched:
                # Switched off and on again at this boundary: its marker, launched before
                # the detach, already opens the next step. A second one would be matched
                # to an older step of the same code and shift the numbering.
                self._resolver.amend_last_mark(dataclasses.replace(last, traced_after=True))
                return
            mark = self._launch_marker(step, host_end_ns=None)
            if last is not None:
                mark = dataclasses.replace(mark, host_end_ns=last.host_end_ns)
                self._resolver.amend_last_mark(mark)
        except Exception as err:  # never into the training loop
            self.counters["mark_errors"] += 1
            self._fail(f"set_tracing({on}) after step {step}: {type(err).__name__}: {err}")

    def mark_step(self, step: int, host_end_ns: int) -> None:
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
            torch = self._torch
            if torch.cuda.is_current_stream_capturing():
                self.counters["marks_while_capturing"] += (
                    1  # a marker inside a CUDA graph would replay
                )
                return
            self._last_step = step
            want = self._want_tracing
            if want and not self._tracing:
                self._toggle(True)  # before the marker: it bounds the first traced step
            if self._tracing:
                mark = self._launch_marker(step, host_end_ns)
            else:
                self.counters["marks_untraced"] += 1
                mark = StepMark(
                    step, host_end_ns, time.time_ns(), time.monotonic_ns(), step % self._codes,
                    marker_launched=False, traced_after=False,
                )  # fmt: skip
            if not want and self._tracing:
                self._toggle(False)  # after the marker: it closes the last traced step
                mark = dataclasses.replace(mark, traced_after=False)
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
                    return bool(event.query())
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
            # The next step carries the attach (~9-13 ms measured on an H200 against a
            # 10-16 ms ResNet18 step): judged under the after-flush condition, or it is
            # an anomaly distanom made (step 145, the first after the probe window, was
            # captured in every H200 run).
        elif self._detach_when_off and session.lib.can_detach:
            self._detach(session)
        else:
            session.disable()
            self.counters["disables"] += 1
        self._tracing = on
        took = time.perf_counter_ns() - t0
        self.counters["toggle_ns_total"] += took
        self.counters["toggle_ns_max"] = max(self.counters["toggle_ns_max"], took)

    def _detach(self, session: cupti_lib.ActivitySession) -> None:
        """Tracing goes off: detach CUPTI, since its per-launch cost outlives a mere
        disable. The synchronize is CUPTI's condition for detaching (every launch it
        instrumented has finished); it costs one drain of the GPU queue per off switch.
        Kinds are disabled first, so a launch from another thread after this point is not
        instrumented. Only the current device is drained: one device per rank."""
        session.disable()
        self._torch.cuda.synchronize()
        # The next step carries the drain and the detach (2-5 ms measured): the agent
        # judges it under the after-flush condition, not as an ordinary untraced step.
        self.boundary_flushes += 1
        try:
            session.detach()
        except cupti_lib.DetachError as err:
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
        out["callback_errors"] = cupti_lib.callback_errors
        return out


def _cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if getattr(torch.version, "hip", None):
        return "ROCm build of torch: CUPTI is NVIDIA-only"
    if torch.version.cuda is None:
        return "torch was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def probe_cupti() -> str | None:
    """None if the cupti backend can work in this process, else a one-line reason
    (no CUDA, no libcupti, another CUPTI subscriber such as torch.profiler)."""
    reason = _cuda_reason()
    if reason is not None:
        return reason
    if cupti_lib._active_pool is not None:
        return "a distanom CUPTI tracer is already running in this process"
    try:
        lib = cupti_lib.CuptiLib.load()
        lib.version()
        lib.subscriber_check()
    except TracerUnavailableError as err:
        return str(err)
    return None
