"""Turns capture decisions into trace files, on a background thread that never blocks training.

The consensus thread hands over `CaptureDecision`s; this worker waits until the tracer
holds the step's events (decisions can arrive before a step's window closes, or for
requested steps still in the future), writes this rank's Kineto chrome trace of the step
atomically into the run directory and records it in the index. The TraceLens-compatible
tables are computed beside each trace when `analysis.on_capture` says: right away, once
training has ended (default: that work would compete with training for the GIL), or
by `distanom report`. A decision that replaces an older
capture (budget, newer reference) deletes this rank's files of the old one (or cancels it
while still pending here), and the step's folder once no rank's files remain in it.

Budgets enforced here are per rank: bytes written (`capture.max_disk_mb`). A failure of
one capture (full disk, a link planted in the run directory, an index lock held by
someone else, a broken export) is counted (`CaptureStats.errors`, `last_error`), logged
once, and the worker goes on with the next; training never sees an exception from here.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from distanom.config import Config
from distanom.detect import CaptureDecision
from distanom.pacing import MIN_SLICE_EVENTS, slice_events, slice_pause_s
from distanom.records.index import IndexDropped, IndexWritten, append_record
from distanom.rundir import CaptureFolderContendedError, RunDir, json_bytes, json_number
from distanom.tracers.base import Availability, StepTrace, Tracer
from distanom.world import WorldInfo

log = logging.getLogger(__name__)

POLL_S = 0.05
# A tracer lookup this long is work to charge to the steps it overlapped (the cupti
# tracer indexing its buffers); a shorter one is a poll.
HEAVY_LOOKUP_NS = 1_000_000


def encode_document(
    document: dict[str, Any],
    pause: Callable[[], None] | None = None,
    slice_events: int = MIN_SLICE_EVENTS,
) -> bytes:
    """A trace document as JSON bytes (`rundir.json_bytes`: orjson first, which holds the
    GIL far shorter than json.dumps, time the training thread would wait, docs/agent.md;
    NaN and infinities as null, so a trace with one is still written).

    `distributedInfo` comes first, written `"rank": N` with a space: HolisticTraceAnalysis
    takes a file's rank from the first match of that pattern in it. With `pause`,
    `traceEvents` is encoded `slice_events` events at a time (`pacing.slice_events`),
    with `pause()` between slices, and written last: one orjson call holds the GIL
    throughout (~1 us an event), and a step's trace in one piece stalled a launch-bound
    training step by milliseconds."""
    events = document.get("traceEvents")
    size = max(1, slice_events)
    if pause is not None and isinstance(events, list) and len(events) > size:
        rest = {key: value for key, value in document.items() if key != "traceEvents"}
        # the unsliced encoding's bytes up to the events' `[`, whichever path wrote them
        head = encode_document({**rest, "traceEvents": []})
        parts = [head[: head.rindex(b"[")], b"["]
        for begin in range(0, len(events), size):
            if begin:
                pause()
                parts.append(b",")
            parts.append(json_bytes(events[begin : begin + size])[1:-1])
        parts.append(b"]}")
        return b"".join(parts)
    info = document.get("distributedInfo")
    if isinstance(info, dict) and len(document) > 1:
        rest = {key: value for key, value in document.items() if key != "distributedInfo"}
        try:
            head = json.dumps({"distributedInfo": info}, allow_nan=False).encode()
        except (TypeError, ValueError):  # not plain JSON: the compact form still writes it
            return json_bytes(document)
        return head[:-1] + b"," + json_bytes(rest)[1:]
    return json_bytes(document)


@dataclass(frozen=True)
class _Fetched:
    """A step's events taken from the tracer, and what finding them cost (ms)."""

    trace: StepTrace
    cost: dict[str, float]


@dataclass
class CaptureStats:
    """This rank's capture counters (status.json shows rank 0's)."""

    written: int = 0
    bytes_written: int = 0
    dropped: int = 0
    missed: int = 0  # decided, but the tracer no longer (or never) held the step
    skipped_disk: int = 0
    skipped_other_ranks: int = 0
    failed: str | None = None
    errors: int = 0  # captures that failed (each logged once per kind of error)
    last_error: str | None = None
    missed_steps: list[int] = field(default_factory=list)

    @property
    def kept(self) -> int:
        """Trace files in the run now: those written less those dropped since (a newer
        reference, a more severe capture when full); `bytes_written` counts the same."""
        return self.written - self.dropped


class CaptureWorker:
    """One per rank; see the module docstring."""

    def __init__(
        self,
        run: RunDir,
        world: WorldInfo,
        tracer: Tracer,
        config: Config,
        *,
        tracer_name: str,
        warn: Callable[..., None],
    ) -> None:
        self._run = run
        # a failure's warning, once per key (`Health.warn_write_failed`: once for every
        # writer when the whole run directory is gone)
        self._warn = warn
        self._world = world
        self._tracer = tracer
        self._config = config
        self._tracer_name = tracer_name
        self._queue: queue.SimpleQueue[CaptureDecision | None] = queue.SimpleQueue()
        self._pending: list[CaptureDecision] = []
        self._kinds: dict[int, set[str]] = {}  # step -> kinds this rank holds a trace for
        self._max_bytes = int(config.capture.max_disk_mb * 1024 * 1024)
        self._closing = False
        self._close_deadline = math.inf
        self._last_ended_step: int | None = None  # known once training is over
        self.stats = CaptureStats()
        # time spent in heavy work (monotonic ns), and when the current one began: the
        # agent charges it to the steps it overlapped, which detection then discounts
        self._busy_ns = 0
        self._analysis_failed = False  # then the tables are left to the report
        self._busy_since: int | None = None
        self._busy_lookup = False  # the current work is a tracer lookup (see busy_ns)
        # (step, kind) -> time spent asking the tracer for it so far (ns), and how often
        self._lookups: dict[tuple[int, str], tuple[int, int]] = {}
        self.paused_ns = 0  # slept in `_pause` so far
        self._thread = threading.Thread(target=self._loop, name="distanom-capture", daemon=True)
        self._thread.start()

    def busy_ns(self) -> int:
        """Total time spent on captures so far, the current work included: a tracer
        lookup in progress counts once it has run HEAVY_LOOKUP_NS (so that a long one is
        charged to every step it overlaps, not only to the one it ends in)."""
        done = self._busy_ns  # first: work that ends meanwhile is then counted once at most
        since, lookup = self._busy_since, self._busy_lookup
        ongoing = time.monotonic_ns() - since if since is not None else 0
        if lookup and ongoing < HEAVY_LOOKUP_NS:
            ongoing = 0
        return done + ongoing

    def _begin_busy(self, lookup: bool = False) -> int:
        """Mark work begun now (see busy_ns); returns its start."""
        started = time.monotonic_ns()
        self._busy_since, self._busy_lookup = started, lookup
        return started

    def _end_busy(self, lookup: bool = False) -> int:
        """Close the work begun at the last `_begin_busy` (or the end of the latest
        `_pause`; a lookup is charged only if it was heavy); returns its length (ns), 0
        where none was begun. The start is cleared before the total grows, so a reader
        in between sees a little less; the agent keeps its total monotone, so a reader
        that saw a little more (a lookup just over the threshold on its clock) cannot
        make a step's share negative."""
        started = self._busy_since
        if started is None:
            return 0
        spent = time.monotonic_ns() - started
        self._busy_since, self._busy_lookup = None, False
        if not lookup or spent >= HEAVY_LOOKUP_NS:
            self._busy_ns += spent
        return spent

    def _pause(self, pause_s: float) -> None:
        """Let the training thread have the GIL for `pause_s` in the middle of a
        capture's work (`pacing.slice_pause_s`); the pause is not busy time, so each
        slice is charged to the step it overlapped, not the pause to the steps in
        between."""
        if self._closing:  # training is over: nothing to give the GIL to
            return
        busy = self._busy_since is not None
        self._end_busy()
        slept = time.monotonic_ns()
        time.sleep(pause_s)
        # with the wait to take the GIL back: the training thread ran meanwhile
        self.paused_ns += time.monotonic_ns() - slept
        if busy:
            self._begin_busy()

    @property
    def active(self) -> bool:
        """False once capture has stepped aside on this rank for the rest of the run."""
        return self.stats.failed is None

    def submit(self, decisions: list[CaptureDecision]) -> None:
        """Queue decisions for the worker thread (never blocks)."""
        for decision in decisions:
            self._queue.put(decision)

    def close(self, timeout_s: float, *, last_ended_step: int | None = None) -> None:
        """Finish what the tracer can still answer, within `timeout_s`, then stop. A
        decision for a step after `last_ended_step` (training's last) is missed at once:
        that step never ran, and waiting for it would hold the exit for `timeout_s`."""
        self._last_ended_step = last_ended_step
        self._close_deadline = time.monotonic() + timeout_s
        self._closing = True
        self._queue.put(None)
        self._thread.join(timeout_s + 1.0)
        if self._thread.is_alive():
            log.warning(
                "capture: %d capture(s) still pending at exit, abandoned", len(self._pending)
            )

    # -- worker thread ---------------------------------------------------------------

    def _loop(self) -> None:
        stop = False
        while True:
            try:
                item = self._queue.get(timeout=POLL_S if self._pending else 0.5)
                if item is None:
                    stop = True
                else:
                    self._pending.append(item)
                while True:  # take everything queued, in order
                    more = self._queue.get_nowait()
                    if more is None:
                        stop = True
                    else:
                        self._pending.append(more)
            except queue.Empty:
                pass
            self._advance()
            if stop and (not self._pending or time.monotonic() > self._close_deadline):
                if self._config.analysis.on_capture == "exit":
                    self._analyze_written()
                return

    def _analyze_written(self) -> None:
        """Training is over: compute the tables of this rank's captures while time is left
        (whatever is not done here, `distanom report` computes)."""
        for step in sorted(self._kinds):
            if time.monotonic() > self._close_deadline:
                return
            self._analyze(step, self._run.trace_path(step, self._world.rank))

    def _advance(self) -> None:
        # a decision that a later pending one replaces is never built, whether it is READY
        # now or still PENDING: building it (decode, gzip, fsync) only to delete it
        # moments later would compete with training for nothing; every rank holds the
        # same decisions in the same order, so all skip it
        superseded = {
            (d.replaces, d.kind)
            for d in self._pending
            if d.replaces is not None and d.replaces != d.step and self._applies(d)
        }
        still: list[CaptureDecision] = []
        # Every READY step's events are taken from the tracer first, the (paced, slower)
        # encoding and writing after: a step the tracer holds now may have left its
        # history by the time an earlier capture is written.
        built: list[tuple[CaptureDecision, _Fetched]] = []
        again: list[CaptureDecision] = []  # about a step built in this pass
        for decision in self._pending:
            if not self.active:
                continue
            try:
                if (decision.step, decision.kind) in superseded:
                    self._lookups.pop((decision.step, decision.kind), None)
                    self._drop_replaced(decision)  # what it replaced goes all the same
                    continue
                if any(b.step in (decision.step, decision.replaces) for b, _ in built):
                    # after that write: one file, one more label; or the file it replaces
                    # exists to be replaced
                    again.append(decision)
                    continue
                fetched = self._fetch(decision)
                if fetched is False:
                    still.append(decision)
                elif isinstance(fetched, _Fetched):
                    built.append((decision, fetched))
            except Exception as err:  # one capture's failure never stops the next
                self._lookups.pop((decision.step, decision.kind), None)
                self._error(f"capture of step {decision.step} failed: {err}")
        for decision, fetched in built:
            try:
                if self.active:
                    self._written(decision, fetched)
            except Exception as err:
                self._error(f"capture of step {decision.step} failed: {err}")
        for decision in again:
            try:
                if self.active and not self._handle(decision):
                    still.append(decision)
            except Exception as err:
                self._lookups.pop((decision.step, decision.kind), None)
                self._error(f"capture of step {decision.step} failed: {err}")
        self._pending = still

    def _applies(self, decision: CaptureDecision) -> bool:
        return decision.ranks is None or self._world.rank in decision.ranks

    def _drop_replaced(self, decision: CaptureDecision) -> None:
        if decision.replaces is not None and decision.replaces != decision.step:
            self._drop(decision.replaces, decision.kind, decision.step)

    def _handle(self, decision: CaptureDecision) -> bool:
        """Process one decision; False while the tracer does not hold the step yet."""
        fetched = self._fetch(decision)
        if isinstance(fetched, _Fetched):
            self._written(decision, fetched)
            return True
        return fetched

    def _fetch(self, decision: CaptureDecision) -> _Fetched | bool:
        """The step's events and what finding them cost, to write; False while the
        tracer does not hold the step yet; True when there is nothing to write (another
        rank's, already written under another kind, missed)."""
        rank = self._world.rank
        if not self._applies(decision):
            self.stats.skipped_other_ranks += 1
            return True
        self._drop_replaced(decision)
        held = self._kinds.get(decision.step)
        if held is not None:  # already written for another reason: one file, one more label
            held.add(decision.kind)
            self._index(decision, self._run.trace_path(decision.step, rank), 0, {})
            return True
        # Finding the step can be real work (the cupti tracer indexes the buffers that
        # came back since); a cheap poll is not charged, or every step waiting for CUPTI
        # would count as disturbed.
        self._begin_busy(lookup=True)
        try:
            availability = self._tracer.availability(decision.step)
        finally:
            locate_ns = self._end_busy(lookup=True)
        key = (decision.step, decision.kind)
        spent, polls = self._lookups.pop(key, (0, 0))
        spent, polls = spent + locate_ns, polls + 1
        if availability is Availability.PENDING and not (
            self._closing
            and (time.monotonic() > self._close_deadline or self._never_ran(decision.step))
        ):
            if len(self._lookups) < 4096:  # decisions still pending; bounded all the same
                self._lookups[key] = (spent, polls)
            return False
        if availability is not Availability.READY:
            self._missed(decision.step)
            return True
        built = self._begin_busy()
        try:
            trace = self._tracer.step_trace(decision.step)
        except KeyError:
            # READY a moment ago, gone now (a step aged out of the history, a ring
            # buffer recycled while reading): this capture is missed, not the worker
            self._missed(decision.step)
            return True
        finally:
            self._end_busy()
        cost = {
            "locate_ms": spent / 1e6,  # every lookup while it was pending, and the last
            "lookups": polls,
            "build_ms": (time.monotonic_ns() - built) / 1e6,
        }
        return _Fetched(trace, cost)

    def _written(self, decision: CaptureDecision, fetched: _Fetched) -> None:
        """Write a fetched step's trace (busy time, its pauses left out)."""
        self._begin_busy()
        try:
            self._write(decision, fetched.trace, fetched.cost)
        finally:
            self._end_busy()

    def _never_ran(self, step: int) -> bool:
        """Whether training ended before `step` did (known only once it is over)."""
        last = self._last_ended_step
        return last is not None and step > last

    def _missed(self, step: int) -> None:
        self.stats.missed += 1
        self.stats.missed_steps = [*self.stats.missed_steps, step][-100:]
        log.debug("capture: step %d no longer held by the tracer", step)

    def _document(self, decision: CaptureDecision, trace: StepTrace) -> dict[str, Any]:
        world = self._world
        distributed = dict(trace.metadata.get("distributedInfo") or {})
        distributed.update(rank=world.rank, world_size=world.world_size)
        distributed.setdefault("backend", "unknown")
        document: dict[str, Any] = {
            key: value for key, value in trace.metadata.items() if key != "distributedInfo"
        }
        document.setdefault("schemaVersion", 1)
        document["distributedInfo"] = distributed
        document["baseTimeNanoseconds"] = trace.base_time_ns
        document["distanom"] = {
            "step": decision.step,
            "rank": world.rank,
            "host": world.host,
            "kind": decision.kind,
            "step_ms": json_number(decision.step_ms),
            "median_ms": json_number(decision.median_ms),
            "threshold_ms": json_number(decision.threshold_ms),
            "tracer": self._tracer_name,
            "tracer_stats": trace.stats,
        }
        document["traceEvents"] = trace.events
        return document

    def _write(self, decision: CaptureDecision, trace: StepTrace, cost: dict[str, float]) -> None:
        rank = self._world.rank
        if self._over_disk_budget(0):  # full already: not worth a (paced) encode
            return
        before_pauses = self.paused_ns
        pause_s = slice_pause_s(decision.median_ms)  # one median step

        def pause() -> None:
            self._pause(pause_s)

        pause()  # between the tracer's decode and the encode
        started, paused = time.monotonic_ns(), self.paused_ns
        size = slice_events(decision.median_ms, len(trace.events))
        payload = encode_document(self._document(decision, trace), pause, size)
        # zlib drops the GIL while it compresses
        data = gzip.compress(payload, compresslevel=self._config.capture.gzip_level, mtime=0)
        cost["encode_ms"] = (time.monotonic_ns() - started - (self.paused_ns - paused)) / 1e6
        cost["paused_ms"] = (self.paused_ns - before_pauses) / 1e6
        if self._over_disk_budget(len(data)):
            return
        path = self._run.trace_path(decision.step, rank)
        started = time.monotonic_ns()
        try:
            self._run.write_capture_file(path, data)
        except CaptureFolderContendedError as err:
            # a race with other ranks' cleanup, not a broken run directory: this capture
            # is missed, capture goes on
            self._warn(
                "capture-contended",
                "capture of step %d missed (logged once): %s",
                decision.step,
                err,
            )
            self._missed(decision.step)
            return
        except BaseException:
            self._remove_dir_if_empty(decision.step)  # an abandoned folder goes too
            raise
        self.stats.written += 1
        self.stats.bytes_written += len(data)
        self._kinds[decision.step] = {decision.kind}
        cost["write_ms"] = (time.monotonic_ns() - started) / 1e6
        self._index(decision, path, len(data), trace.stats, cost)
        log.info(
            "captured step %d (%s%s) -> %s",
            decision.step,
            decision.kind,
            f", {decision.step_ms:.1f} ms, {decision.ratio:.2f}x median"
            if math.isfinite(decision.ratio)
            else "",
            self._run.relative(path),
        )
        if self._config.analysis.on_capture == "now":
            self._analyze(decision.step, path)

    def _over_disk_budget(self, size: int) -> bool:
        """Whether `size` more bytes would pass `capture.max_disk_mb` on this rank (then
        the capture is counted, not written; said once); a budget already reached takes
        no more, however small."""
        written = self.stats.bytes_written
        if written + size <= self._max_bytes and (size or written < self._max_bytes):
            return False
        self.stats.skipped_disk += 1
        if self.stats.skipped_disk == 1:
            log.warning(
                "capture: capture.max_disk_mb (%.0f MB) reached on this rank; "
                "further captures are counted, not written",
                self._config.capture.max_disk_mb,
            )
        return True

    def _analyze(self, step: int, path: Any) -> None:
        if self._analysis_failed:
            return
        try:
            from distanom.analysis.tables_io import write_rank_tables

            write_rank_tables(self._run, step, self._world.rank, path, self._config.analysis.engine)
        except Exception as err:  # tables can be computed again at report time
            self._analysis_failed = True
            self._warn(
                "capture-tables",
                "capture: tables of step %d not computed (%s); distanom report will compute them",
                step,
                err,
            )

    def _drop(self, step: int, kind: str, replaced_by: int) -> None:
        held = self._kinds.get(step)
        if held is None or kind not in held:
            return
        held.discard(kind)
        rank = self._world.rank
        if held:  # still kept for another reason (e.g. also requested): only the label goes
            self._index_dropped(step, kind, replaced_by)
            return
        del self._kinds[step]
        self.stats.bytes_written -= self._run.remove_rank_files(step, rank)
        self._remove_dir_if_empty(step)
        self.stats.dropped += 1
        self._index_dropped(step, kind, replaced_by)

    def _index_dropped(self, step: int, kind: str, replaced_by: int) -> None:
        append_record(self._run, IndexDropped(step, self._world.rank, kind, replaced_by))

    def _remove_dir_if_empty(self, step: int) -> None:
        """Remove the step's folder if no rank's files are left in it (the last rank out
        does); a failure is logged once and never stops capture."""
        try:
            self._run.remove_capture_dir_if_empty(step)
        except Exception as err:
            self._warn(
                "capture-cleanup",
                "capture: could not remove the emptied folder of step %d (%s); "
                "empty capture folders may be left behind",
                step,
                err,
            )

    def _index(
        self,
        decision: CaptureDecision,
        path: Any,
        size: int,
        stats: dict[str, int],
        cost: dict[str, float] | None = None,
    ) -> None:
        """Record this rank's file of a decided step (`cost`: the worker's time on it)."""
        record = IndexWritten(
            step=decision.step,
            rank=self._world.rank,
            host=self._world.host,
            kind=decision.kind,
            trace=self._run.relative(path),
            bytes=size,
            step_ms=json_number(decision.step_ms),
            median_ms=json_number(decision.median_ms),
            threshold_ms=json_number(decision.threshold_ms),
            slowest_rank=decision.slowest_rank,
            episode=decision.episode,
            request=decision.request_id,
            tracer=self._tracer_name,
            tracer_stats=stats,
            time=time.time(),
            cost_ms={k: round(v, 3) for k, v in cost.items()} if cost else {},
        )
        append_record(self._run, record)

    def _error(self, reason: str) -> None:
        """Count a failed capture; the first is logged, the rest only counted."""
        self.stats.errors += 1
        self.stats.last_error = reason
        self._warn(
            "capture-error",
            "capture: %s (logged once, later failures are counted; capture goes on)",
            reason,
        )
