"""Per-step evidence on every rank, every step: the cheap signals that explain a slow step
without a trace, folded into the consensus round.

- `EvidenceMarks` (training thread): at each step boundary, one append of the host
  time and the training thread's CPU time (`time.thread_time_ns`, a clock read).
- `EvidenceCollector` (control thread): turns the marks, the step's GC time and the
  Flight Recorder entries (`distanom.flight_recorder`) into one `StepEvidence` per
  step: when the rank enqueued the step's last collective (ms after the step began on
  this rank, so no clock is compared across ranks), how many collectives it enqueued,
  its CPU and GC time. Flight Recorder is read at most every `READ_MAX_INTERVAL_S`,
  sooner when collectives come fast enough to fill `READ_FILL` of the buffer; the entries of
  distanom's own group (enqueued on the control thread) are left out. A step's
  evidence is final once a read after its end has been made; `SLOW_READS_IN_A_ROW`
  reads in a row that each cost more than `READ_GIVE_UP_MS` of the control thread's CPU
  switch reading off (logged once).
- `distanom.anomaly_journal.AnomalyJournal` (rank 0's control thread): gathers every
  rank's evidence from the rounds, scores stragglers, and appends each anomalous step
  the detector judged to anomalies.jsonl once its evidence is in.
- `EvidenceTier`: the control loop's one face on all of it, stepping aside on failure.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterable
from typing import Any

from distanom.anomaly_journal import AnomalyJournal
from distanom.consensus import RoundResult
from distanom.detect import AnomalyJudgment
from distanom.flight_recorder import (
    DEFAULT_BUFFER,
    FrEntry,
    StepCollectives,
    buffer_size,
    read_entries,
)
from distanom.health import Health
from distanom.records.anomalies import (
    AnomalyWriter,
    StepEvidence,
    write_stragglers,
)
from distanom.rundir import RunDir
from distanom.stragglers import Straggler

log = logging.getLogger(__name__)

READ_MIN_INTERVAL_S = 0.05
READ_MAX_INTERVAL_S = 1.0
# A read converts the whole buffer (about 8 us an entry on CPU): reading when it is this
# full makes each entry read about once (~8 us per collective), leaving room for bursts.
READ_FILL = 0.75
# A read's cost to training is the CPU it takes (holding the GIL), not its wall time: on
# a loaded host, preemption and waiting for the GIL made reads of a few ms look slow and
# switched arrival (hence straggler scoring) off for the rest of the run.
READ_GIVE_UP_MS = 20.0
SLOW_READS_IN_A_ROW = 3
MAX_PENDING_STEPS = 4096  # evidence and marks kept for steps not yet final / gathered


class EvidenceMarks:
    """The training thread's per-boundary reading: O(1), one deque append."""

    def __init__(self) -> None:
        self.marks: collections.deque[tuple[int, int, int]] = collections.deque(
            maxlen=MAX_PENDING_STEPS
        )

    def mark(self, step: int, host_ns: int) -> None:
        """Step `step` ended at `host_ns` (time.time_ns); reads this thread's CPU time."""
        self.marks.append((step, host_ns, time.thread_time_ns()))


class _Open:
    """A step ended on this rank whose evidence is not final yet (one per step: slots,
    and its collectives summary made only when a collective is assigned to it)."""

    __slots__ = ("collectives", "cpu_ms", "end_ns", "start_ns")

    def __init__(self, start_ns: int, end_ns: int, cpu_ms: float) -> None:
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.cpu_ms = cpu_ms
        self.collectives: StepCollectives | None = None


class EvidenceCollector:
    """Builds this rank's `StepEvidence` per step (control thread only)."""

    def __init__(self, marks: EvidenceMarks, *, read_fr: bool | None = None) -> None:
        self._marks = marks
        self._read_fr = buffer_size() > 0 if read_fr is None else read_fr
        self._buffer = max(1, buffer_size() or DEFAULT_BUFFER)
        self._last_mark: tuple[int, int, int] | None = None
        self._open: dict[int, _Open] = {}
        self._gc: dict[int, float] = {}
        self._last_record: dict[str, int] = {}  # per recorder (each numbers its own)
        self._last_seen_ns: dict[str, int] = {}  # per recorder, its last entry's creation
        # host-time spans whose entries were overwritten before a read (newest kept)
        self._lost: collections.deque[tuple[int, int]] = collections.deque(maxlen=64)
        self._next_read = 0.0
        self._interval = READ_MIN_INTERVAL_S
        self._slow_reads = 0
        self._own_thread = ""
        self._carry: list[FrEntry] = []  # enqueued during a step that had not ended yet
        self.reads = 0
        self.read_ms = 0.0

    @property
    def reading_flight_recorder(self) -> bool:
        """Whether collective arrival is being read."""
        return self._read_fr

    def next_read_at(self) -> float:
        """When (time.monotonic) the next Flight Recorder read is due; inf when nothing
        waits for one (not reading, or no step ended since the last read)."""
        waiting = self._open or self._marks.marks  # steps not taken in yet count too
        return self._next_read if self._read_fr and waiting else math.inf

    def add_gc(self, step: int, gc_ms: float) -> None:
        """The GC time of a step, as the training thread reported it."""
        self._gc[step] = gc_ms
        if len(self._gc) > MAX_PENDING_STEPS:
            self._gc.pop(next(iter(self._gc)))

    def add_gc_many(self, steps: Iterable[tuple[int, float]]) -> None:
        """`add_gc` for each (step, gc_ms), in one loop (a round's steps at once)."""
        gc = self._gc
        for step, gc_ms in steps:
            gc[step] = gc_ms
            if len(gc) > MAX_PENDING_STEPS:
                gc.pop(next(iter(gc)))

    def poll(self, *, force: bool = False) -> list[tuple[int, StepEvidence]]:
        """The steps whose evidence became final, in step order."""
        if not self._own_thread:
            self._own_thread = str(threading.get_ident())
        marks = self._marks.marks
        taken = []
        while marks:
            taken.append(marks.popleft())
        if not self._read_fr and not self._open:
            done = self._unread_evidence(taken)
            if done is not None:
                return done
        self._take_marks(taken)
        if not self._open:
            return []
        if not self._read_fr:
            return self._finish(lambda _o: True)
        now = time.monotonic()
        if not force and now < self._next_read:
            return []
        read_at = time.time_ns()
        self._read(now)
        return self._finish(lambda o: o.end_ns <= read_at)

    def _unread_evidence(
        self, taken: list[tuple[int, int, int]]
    ) -> list[tuple[int, StepEvidence]] | None:
        """Without Flight Recorder reads and no step open, `_take_marks` then `_finish`
        for marks of consecutive steps (the common case), without an `_Open` per step:
        every step they end is final at once. None, nothing done, for any other marks."""
        if not taken or len(taken) > MAX_PENDING_STEPS:
            return None
        first = taken[0][0]
        if [mark[0] for mark in taken] != list(range(first, first + len(taken))):
            return None  # gaps or repeats: the general path
        prev = self._last_mark
        self._last_mark = taken[-1]
        if prev is None or first != prev[0] + 1:
            prev, taken = taken[0], taken[1:]  # step 0, or a gap: no start for this step
        gc, nan, new = self._gc, math.nan, StepEvidence.of_values
        done = []
        for mark in taken:  # as `_evidence` of an `_Open` without collectives
            step, end_ns, cpu_ns = mark
            cpu_ms = (cpu_ns - prev[2]) / 1e6
            done.append((step, new(nan, -1, cpu_ms, gc.pop(step, 0.0), (end_ns - prev[1]) / 1e6)))
            prev = mark
        return done

    def _take_marks(self, taken: list[tuple[int, int, int]]) -> None:
        for mark in taken:
            prev = self._last_mark
            self._last_mark = mark
            if prev is None or mark[0] != prev[0] + 1:
                continue  # step 0, or a gap: no start for this step
            self._open[mark[0]] = _Open(prev[1], mark[1], (mark[2] - prev[2]) / 1e6)
        while len(self._open) > MAX_PENDING_STEPS:
            self._open.pop(next(iter(self._open)))

    def _read(self, now: float) -> None:
        began, began_cpu = time.perf_counter(), time.thread_time()
        entries = read_entries(after=self._last_record)
        cpu_ms = (time.thread_time() - began_cpu) * 1e3
        self.reads += 1
        self.read_ms += (time.perf_counter() - began) * 1e3
        self._slow_reads = self._slow_reads + 1 if cpu_ms > READ_GIVE_UP_MS else 0
        if self._slow_reads >= SLOW_READS_IN_A_ROW:
            self._read_fr = False
            log.warning(
                "evidence: reading Flight Recorder took %.0f ms of CPU %d times in a row "
                "(buffer %d); collective arrival is no longer recorded",
                cpu_ms,
                self._slow_reads,
                self._buffer,
            )
        new = self._new_entries(entries)
        carried, self._carry = self._carry, []
        if carried or new:
            self._assign([*carried, *new])
        rate = len(new) / max(self._interval, 1e-3)
        wanted = READ_FILL * self._buffer / rate if rate > 0 else READ_MAX_INTERVAL_S
        self._interval = min(READ_MAX_INTERVAL_S, max(READ_MIN_INTERVAL_S, wanted))
        self._next_read = now + self._interval

    def _new_entries(self, entries: Iterable[FrEntry]) -> list[FrEntry]:
        """The entries not seen before; where a recorder's numbering has a gap since the
        last read, the span of host time whose entries were overwritten unseen (from its
        last entry seen to its first entry now) is remembered in `_lost`."""
        before = dict(self._last_record)
        new = [e for e in entries if e.record_id > before.get(e.source, -1)]
        checked: set[str] = set()
        for entry in new:
            source = entry.source
            if source not in checked:
                checked.add(source)
                previous = before.get(source, -1)
                if previous >= 0 and entry.record_id > previous + 1:
                    self._lost.append((self._last_seen_ns.get(source, 0), entry.time_created_ns))
            self._last_record[source] = max(self._last_record.get(source, -1), entry.record_id)
            seen = self._last_seen_ns.get(source, 0)
            self._last_seen_ns[source] = max(seen, entry.time_created_ns)
        return new

    def _assign(self, entries: Iterable[FrEntry]) -> None:
        steps = sorted(self._open)
        starts = [self._open[s].start_ns for s in steps]
        last_end = self._last_mark[1] if self._last_mark is not None else 0
        for entry in entries:
            if entry.thread_id == self._own_thread:
                continue  # distanom's own consensus group
            if entry.time_created_ns >= last_end:
                if len(self._carry) < MAX_PENDING_STEPS:
                    self._carry.append(entry)  # its step has not ended yet
                continue
            at = bisect.bisect_right(starts, entry.time_created_ns) - 1
            if at < 0:
                continue
            step = self._open[steps[at]]
            if entry.time_created_ns < step.end_ns:
                if step.collectives is None:
                    step.collectives = StepCollectives()
                step.collectives.add(entry)

    def _lost_until(self, step: _Open) -> int | None:
        """The end of the latest overwritten span that overlaps the step, if any."""
        ends = [hi for lo, hi in self._lost if lo < step.end_ns and step.start_ns < hi]
        return max(ends) if ends else None

    def _finish(self, is_final: object) -> list[tuple[int, StepEvidence]]:
        done: list[tuple[int, StepEvidence]] = []
        check = is_final if callable(is_final) else (lambda _o: True)
        for step in sorted(self._open):
            entry = self._open[step]
            if not check(entry):
                break
            del self._open[step]
            done.append((step, self._evidence(step, entry)))
        return done

    def _evidence(self, step: int, entry: _Open) -> StepEvidence:
        gc_ms = self._gc.pop(step, 0.0)
        host_ms = (entry.end_ns - entry.start_ns) / 1e6
        summary = entry.collectives
        count = 0 if summary is None else summary.count
        # the arrival: when the step's last collective was enqueued, if one was seen
        last_ns = None if summary is None or not count else summary.last_created_ns
        if not count and not self._read_fr:
            return StepEvidence(cpu_ms=entry.cpu_ms, gc_ms=gc_ms, host_ms=host_ms)
        lost_until = self._lost_until(entry)
        if lost_until is not None:
            # entries of the step were overwritten unseen: its count is short, and its
            # last collective is known only if one created after the loss survived
            arrive = math.nan
            if last_ns is not None and last_ns >= lost_until:
                arrive = (last_ns - entry.start_ns) / 1e6
            return StepEvidence(arrive, -1, entry.cpu_ms, gc_ms, host_ms)
        arrive = math.nan if last_ns is None else (last_ns - entry.start_ns) / 1e6
        return StepEvidence(arrive, count, entry.cpu_ms, gc_ms, host_ms)


class EvidenceTier:
    """The control thread's evidence work behind one face: this rank's collector, and on
    rank 0 the journal. Each part steps aside on a failure (logged once); training and
    detection go on."""

    def __init__(self, marks: EvidenceMarks, world_size: int, health: Health) -> None:
        # one rank has no other to arrive before it: arrival is never compared, and a
        # read would only hold the GIL (milliseconds, docs/measurements.md)
        self.collector = EvidenceCollector(marks, read_fr=False if world_size < 2 else None)
        self.journal: AnomalyJournal | None = None
        self._world_size = world_size
        self._warn_once = health.warn_once
        self._warn_write_failed = health.warn_write_failed  # writes into the run directory
        self._off = False
        # the body last written, less scored_steps
        self._stragglers_written: dict[str, Any] | None = None
        self._traced: set[int] = set()

    def add_gc(self, step: int, gc_ms: float) -> None:
        """A step's GC time, from the training thread's record."""
        self.collector.add_gc(step, gc_ms)

    def add_gc_many(self, steps: Iterable[tuple[int, float]]) -> None:
        """Steps' (step, GC time), from the training thread's records."""
        self.collector.add_gc_many(steps)

    def next_read_at(self) -> float:
        """When (time.monotonic) the next Flight Recorder read is due (inf: none)."""
        return math.inf if self._off else self.collector.next_read_at()

    def poll(self, final: bool) -> list[tuple[int, StepEvidence]]:
        """This rank's newly final evidence ([] once stepped aside)."""
        if self._off:
            return []
        try:
            return self.collector.poll(force=final)
        except Exception as err:
            self._off = True
            self._warn_once("evidence", "evidence: %s; per-step evidence steps aside", err)
            return []

    def open_journal(self, run: RunDir) -> None:
        """Rank 0: start recording anomalies into the run directory."""
        try:
            writer: AnomalyWriter | None = AnomalyWriter(run)
        except OSError as err:
            self._warn_write_failed("anomalies", "anomalies file: %s; not recorded", err.strerror)
            writer = None
        self.journal = AnomalyJournal(self._world_size, writer)

    def fold(
        self, judged: list[AnomalyJudgment], result: RoundResult, *, may_trace: bool
    ) -> Straggler | None:
        """Rank 0: a round's judgments, times and evidence; returns a straggler named for
        the first time (worth one trace on every rank) when `may_trace`."""
        journal = self.journal
        if journal is None:
            return None
        try:
            journal.add_judgments(judged)
            journal.add_times_many((sample.step, sample.times_ms) for sample in result.samples)
            journal.add_evidence(result.evidence)
            if not may_trace:
                return None
            for straggler in journal.scorer.stragglers():
                if straggler.rank not in self._traced:
                    self._traced.add(straggler.rank)
                    return straggler
        except Exception as err:  # records and scores step aside, detection goes on
            self.journal = None
            self._warn_write_failed(
                "journal", "anomaly journal: %s; anomalies are not recorded", err
            )
        return None

    def scores(self) -> dict[str, Any] | None:
        """Straggler scores and drift for status.json (None: no journal)."""
        return self.journal.scorer.to_json() if self.journal is not None else None

    def write_stragglers(self, run: RunDir | None, *, final: bool = False) -> dict[str, Any] | None:
        """Rewrite stragglers.json (rank 0) when the stragglers or the drift changed, or
        at the end; `scored_steps` alone, which grows every round, is no reason (its
        value in the live file is that of the last change). Returns the scores
        (`scores()`, built once for the file and status.json)."""
        body = self.scores()
        if body is None or run is None:
            return body
        news = {key: value for key, value in body.items() if key != "scored_steps"}
        if news == self._stragglers_written and not final:
            return body
        try:
            write_stragglers(run, body, final=final)
            self._stragglers_written = news
        except (OSError, ValueError) as err:
            # written with status.json: one warning for both
            self._warn_write_failed("status", "status file not written (%s)", err)
        return body

    def close(self, run: RunDir | None) -> None:
        """At the end (rank 0): pending anomalies written, files closed, scores kept."""
        journal = self.journal
        if journal is None:
            return
        with contextlib.suppress(Exception):
            journal.flush()
            if journal.writer is not None:
                journal.writer.close()
        self.write_stragglers(run, final=True)
