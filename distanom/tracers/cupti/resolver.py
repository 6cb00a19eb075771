"""Finding one step's records in the retained CUPTI buffers and building its trace.

Owns `StepResolver`, which runs on the capture worker's thread: it keeps the recent
`StepMark`s (appended by the training thread), indexes each completed buffer once,
matches marker records to steps (see `matching`), decides whether a step is PENDING,
READY or GONE, flushes CUPTI (plainly, or forced once the GPU has passed the step) when
a step waits on it, and decodes the records between a step's two markers into a
`StepTrace` of Kineto-shaped events (see `events`), which goes to the capture module.

- Step N is served only if markers N-1 and N were both found and no other marker lies
  between them (`marker_verified` = 1 in its stats); else it is GONE, with the reason
  logged and counted.
- It stays PENDING while CUPTI still holds a buffer it asked for before marker N ran
  (one buffer per launching thread: the autograd thread's may hold the backward pass);
  a forced flush ends the wait, and a buffer even that keeps is counted in the step's
  stats (`held_buffers_at_serve`).

No torch; CUPTI is only called through the injected `flush` and record walker.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from distanom.tracers.base import Availability, StepTrace
from distanom.tracers.cupti.buffers import BufferPool, CompletedBuffer
from distanom.tracers.cupti.events import kineto_events
from distanom.tracers.cupti.library import (
    KIND_CONCURRENT_KERNEL,
    KIND_MEMCPY,
    KIND_MEMSET,
    CuptiError,
)
from distanom.tracers.cupti.matching import (
    CLOCK_TOLERANCE_NS,
    StepMark,
    assign_markers,
    is_marker_name,
)
from distanom.tracers.cupti.names import NameTable
from distanom.tracers.cupti.records import (
    BufferIndex,
    DecodeStats,
    GpuActivity,
    MarkerRecord,
    RecordIterator,
    buffer_view,
    decode_records,
    index_buffer,
)

log = logging.getLogger(__name__)

# A buffer CUPTI asked for up to this long after the closing marker ran may still hold
# the step's records: the marker's GPU time is mapped to the host clock through the
# calibrated offset, which is good to CLOCK_TOLERANCE_NS.
HELD_BUFFER_MARGIN_NS = 5 * CLOCK_TOLERANCE_NS


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
        pool: BufferPool,
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
        """Remember a step boundary the training thread just marked."""
        with self._marks_lock:
            self._marks.append(mark)

    def mark_appender(self) -> Callable[[StepMark], None]:
        """`record_mark` without the lock, for the training thread's untraced marks (one
        a step): a deque append is one C call, and every other change to the marks
        (`amend_last_mark`) is made on the same thread, so the lock guards nothing there."""
        return self._marks.append

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
        """The newest marked step (None before the first)."""
        with self._marks_lock:
            return self._marks[-1].step if self._marks else None

    def last_mark(self) -> StepMark | None:
        """The newest `StepMark` (None before the first)."""
        with self._marks_lock:
            return self._marks[-1] if self._marks else None

    def _snapshot(self) -> list[StepMark]:
        with self._marks_lock:
            return list(self._marks)

    # -- indexing ----------------------------------------------------------------------

    def _index(self, buf: CompletedBuffer) -> BufferIndex | None:
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
            if not isinstance(err, CuptiError):  # e.g. detached now: try later
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
        # e.g. behind a collective kernel still waiting for another rank: a step served
        # without that buffer misses most of its kernels (docs/cupti.md).
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
        """The `StepTrace` of `step` from its located markers, with its stats plus `extra_stats`;
        KeyError if a buffer was recycled meanwhile."""
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
