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
  evidence is final once a read after its end has been made; a read that took longer
  than `READ_GIVE_UP_MS` three times switches reading off (logged once).
- `AnomalyJournal` (rank 0's control thread): gathers every rank's evidence from the
  rounds, scores stragglers (`distanom.stragglers`), and appends each anomalous step
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from distanom.consensus import EvidenceBlock, RoundResult
from distanom.detect import AnomalyJudgment
from distanom.flight_recorder import (
    DEFAULT_BUFFER,
    FrEntry,
    StepCollectives,
    buffer_size,
    read_entries,
)
from distanom.records.anomalies import (
    AnomalyRecord,
    AnomalyWriter,
    StepEvidence,
    write_stragglers,
)
from distanom.rundir import RunDir
from distanom.stragglers import LATE_SHARE, Straggler, StragglerScorer

log = logging.getLogger(__name__)

READ_MIN_INTERVAL_S = 0.05
READ_MAX_INTERVAL_S = 1.0
# A read converts the whole buffer (about 8 us an entry on CPU): reading when it is this
# full makes each entry read about once (~8 us per collective), leaving room for bursts.
READ_FILL = 0.75
READ_GIVE_UP_MS = 20.0
MAX_PENDING_STEPS = 4096  # evidence and marks kept for steps not yet final / gathered
MEDIAN_STEPS = 64  # per-rank recent arrivals and CPU times the journal keeps


class EvidenceMarks:
    """The training thread's per-boundary reading: O(1), one deque append."""

    def __init__(self) -> None:
        self.marks: collections.deque[tuple[int, int, int]] = collections.deque(
            maxlen=MAX_PENDING_STEPS
        )

    def mark(self, step: int, host_ns: int) -> None:
        """Step `step` ended at `host_ns` (time.time_ns); reads this thread's CPU time."""
        self.marks.append((step, host_ns, time.thread_time_ns()))


@dataclass
class _Open:
    start_ns: int
    end_ns: int
    cpu_ms: float
    collectives: StepCollectives = field(default_factory=StepCollectives)
    overflowed: bool = False


class EvidenceCollector:
    """Builds this rank's `StepEvidence` per step (control thread only)."""

    def __init__(self, marks: EvidenceMarks, *, read_fr: bool | None = None) -> None:
        self._marks = marks
        self._read_fr = buffer_size() > 0 if read_fr is None else read_fr
        self._buffer = max(1, buffer_size() or DEFAULT_BUFFER)
        self._last_mark: tuple[int, int, int] | None = None
        self._open: dict[int, _Open] = {}
        self._gc: dict[int, float] = {}
        self._last_record = -1
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

    def add_gc(self, step: int, gc_ms: float) -> None:
        """The GC time of a step, as the training thread reported it."""
        self._gc[step] = gc_ms
        if len(self._gc) > MAX_PENDING_STEPS:
            self._gc.pop(next(iter(self._gc)))

    def poll(self, *, force: bool = False) -> list[tuple[int, StepEvidence]]:
        """The steps whose evidence became final, in step order."""
        if not self._own_thread:
            self._own_thread = str(threading.get_ident())
        self._take_marks()
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

    def _take_marks(self) -> None:
        marks = self._marks.marks
        while marks:
            mark = marks.popleft()
            prev = self._last_mark
            self._last_mark = mark
            if prev is None or mark[0] != prev[0] + 1:
                continue  # step 0, or a gap: no start for this step
            self._open[mark[0]] = _Open(prev[1], mark[1], (mark[2] - prev[2]) / 1e6)
        while len(self._open) > MAX_PENDING_STEPS:
            self._open.pop(next(iter(self._open)))

    def _read(self, now: float) -> None:
        began = time.perf_counter()
        entries = read_entries()
        spent_ms = (time.perf_counter() - began) * 1e3
        self.reads += 1
        self.read_ms += spent_ms
        if spent_ms > READ_GIVE_UP_MS:
            self._slow_reads += 1
            if self._slow_reads >= 3:
                self._read_fr = False
                log.warning(
                    "evidence: reading Flight Recorder took %.0f ms (buffer %d); collective "
                    "arrival is no longer recorded",
                    spent_ms,
                    self._buffer,
                )
        new = [e for e in entries if e.record_id > self._last_record]
        overflow = False
        if new:
            overflow = new[0].record_id > self._last_record + 1 and self._last_record >= 0
            self._last_record = new[-1].record_id
        carried, self._carry = self._carry, []
        if carried or new:
            self._assign([*carried, *new], overflow)
        rate = len(new) / max(self._interval, 1e-3)
        wanted = READ_FILL * self._buffer / rate if rate > 0 else READ_MAX_INTERVAL_S
        self._interval = min(READ_MAX_INTERVAL_S, max(READ_MIN_INTERVAL_S, wanted))
        self._next_read = now + self._interval

    def _assign(self, entries: Iterable[FrEntry], overflow: bool) -> None:
        steps = sorted(self._open)
        starts = [self._open[s].start_ns for s in steps]
        last_end = self._last_mark[1] if self._last_mark is not None else 0
        oldest = None
        for entry in entries:
            if entry.thread_id == self._own_thread:
                continue  # distanom's own consensus group
            oldest = entry.time_created_ns if oldest is None else oldest
            if entry.time_created_ns >= last_end:
                if len(self._carry) < MAX_PENDING_STEPS:
                    self._carry.append(entry)  # its step has not ended yet
                continue
            at = bisect.bisect_right(starts, entry.time_created_ns) - 1
            if at < 0:
                continue
            step = self._open[steps[at]]
            if entry.time_created_ns < step.end_ns:
                step.collectives.add(entry)
        if overflow and oldest is not None:
            for number in steps:  # entries of these steps were overwritten before the read
                if self._open[number].start_ns < oldest:
                    self._open[number].overflowed = True

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
        # the ring keeps the newest entries: a step with any entry left still has its
        # last collective; one with none left, after an overwrite, is unknown
        if not entry.collectives.count and (not self._read_fr or entry.overflowed):
            return StepEvidence(cpu_ms=entry.cpu_ms, gc_ms=gc_ms)
        summary = entry.collectives
        arrive = math.nan
        if summary.count:
            arrive = (summary.last_created_ns - entry.start_ns) / 1e6
        return StepEvidence(arrive, summary.count, entry.cpu_ms, gc_ms)


@dataclass
class _StepRow:
    values: torch.Tensor  # (world, 4): arrive ms, collectives, cpu ms, gc ms
    filled: int = 0


class AnomalyJournal:
    """Rank 0: every rank's evidence per step, straggler scores, anomaly lines. Works on
    arrays: a round costs O(distinct (first, count) groups x slots) tensor operations,
    not per-rank Python work (docs/evidence.md, Scale)."""

    def __init__(self, world_size: int, writer: AnomalyWriter | None) -> None:
        self.world_size = world_size
        self.writer = writer
        self.scorer = StragglerScorer(world_size)
        self._rows: dict[int, _StepRow] = {}
        self._times: dict[int, tuple[float, ...]] = {}
        self._pending: dict[int, AnomalyJudgment] = {}
        # the last MEDIAN_STEPS complete steps' arrival and CPU time, per rank
        self._history = torch.full((MEDIAN_STEPS, world_size, 2), math.nan, dtype=torch.float64)
        self._history_at = 0
        self.written = 0

    def add_times(self, step: int, times_ms: tuple[float, ...]) -> None:
        """A gathered step's per-rank durations (add a round's judgments first)."""
        self._times[step] = times_ms
        if len(self._times) > MAX_PENDING_STEPS:
            self._times.pop(next(iter(self._times)))
        self._maybe_complete(step)

    def add_judgments(self, judged: Iterable[AnomalyJudgment]) -> None:
        """Anomalous steps the detector judged; written once their evidence is in."""
        for judgment in judged:
            self._pending[judgment.step] = judgment
        while len(self._pending) > MAX_PENDING_STEPS:
            self._write(self._pending.pop(next(iter(self._pending))))

    def add_evidence(self, block: EvidenceBlock | None) -> None:
        """A round's evidence block; completes the steps every rank has sent."""
        if block is None:
            return
        count = torch.tensor(block.count, dtype=torch.int64)
        senders = (count > 0).nonzero().flatten()
        if not len(senders):
            return
        first = torch.tensor(block.first, dtype=torch.int64)
        # one key per (first, count): ranks in lockstep form a handful of groups
        span = int(count.max()) + 1
        keys = first[senders] * span + count[senders]
        groups, which = torch.unique(keys, return_inverse=True)
        touched = []
        for group, key in enumerate(groups.tolist()):
            group_first, group_count = divmod(key, span)
            ranks = senders[which == group]
            for offset in range(group_count):
                step = group_first + offset
                row = self._row(step)
                row.values[ranks] = block.values[ranks, offset]
                row.filled += len(ranks)
                touched.append(step)
        for step in sorted(set(touched)):
            self._maybe_complete(step)
        while len(self._rows) > MAX_PENDING_STEPS:
            self._complete(next(iter(self._rows)))

    def _row(self, step: int) -> _StepRow:
        row = self._rows.get(step)
        if row is None:
            values = torch.full((self.world_size, 4), math.nan, dtype=torch.float64)
            row = self._rows[step] = _StepRow(values)
        return row

    def _maybe_complete(self, step: int) -> None:
        row = self._rows.get(step)
        if row is not None and step in self._times and row.filled >= self.world_size:
            self._complete(step)

    def _complete(self, step: int) -> None:
        row = self._rows.get(step)
        if row is None:
            return
        times = self._times.get(step)
        if times is not None:
            finite = [t for t in times if math.isfinite(t)]
            if finite:
                self.scorer.add_late(step, self._late(row.values[:, 0], max(finite)), max(finite))
        judgment = self._pending.pop(step, None)
        if judgment is not None:
            self._write(judgment)
        del self._rows[step]
        self._times.pop(step, None)
        self._history[self._history_at % MEDIAN_STEPS] = row.values[:, [0, 2]]
        self._history_at += 1

    @staticmethod
    def _late(arrive: torch.Tensor, step_ms: float) -> tuple[tuple[int, float], ...] | None:
        """The ranks late at a step, as `StragglerScorer.add_late` takes them."""
        known = arrive.isfinite()
        if int(known.sum()) < 2:
            return None
        lateness = arrive - arrive[known].median()
        late = (lateness >= LATE_SHARE * step_ms) & known
        ranks = late.nonzero().flatten()
        ms = lateness[ranks].clamp(max=step_ms)
        return tuple(zip(ranks.tolist(), ms.tolist(), strict=True))

    def flush(self) -> None:
        """At the end: write every pending anomaly with the evidence there is."""
        for step in sorted(self._pending):
            self._write(self._pending[step])
        self._pending.clear()

    def _write(self, judgment: AnomalyJudgment) -> None:
        if self.writer is None:
            return
        step = judgment.step
        row = self._rows.get(step)
        times = self._times.get(step) or (math.nan,) * self.world_size
        evidence = [StepEvidence()] * self.world_size
        if row is not None:
            evidence = [
                StepEvidence(a, int(n) if math.isfinite(n) else -1, cpu, gc_ms)
                for a, n, cpu, gc_ms in row.values.tolist()
            ]
        medians = self._history.nanmedian(dim=0).values  # (world, 2)
        record = AnomalyRecord(
            step=step,
            step_ms=judgment.step_ms,
            median_ms=judgment.median_ms,
            threshold_ms=judgment.threshold_ms,
            traced=judgment.traced,
            judged_by=judgment.judged_by,
            slowest_rank=judgment.slowest_rank,
            durations_ms=tuple(times),
            evidence=tuple(evidence),
            arrive_median_ms=tuple(medians[:, 0].tolist()),
            cpu_median_ms=tuple(medians[:, 1].tolist()),
        )
        try:
            self.writer.write(record)
            self.written += 1
        except (OSError, ValueError) as err:
            log.warning("anomalies file: %s; anomalies are no longer recorded", err)
            self.writer = None


class EvidenceTier:
    """The control thread's evidence work behind one face: this rank's collector, and on
    rank 0 the journal. Each part steps aside on a failure (logged once); training and
    detection go on."""

    def __init__(
        self, marks: EvidenceMarks, world_size: int, warn_once: Callable[..., None]
    ) -> None:
        self.collector = EvidenceCollector(marks)
        # with Flight Recorder on (the same on every rank) the final round always runs
        self.final_rounds = self.collector.reading_flight_recorder
        self.journal: AnomalyJournal | None = None
        self._world_size = world_size
        self._warn_once = warn_once
        self._off = False
        self._traced: set[int] = set()

    def add_gc(self, step: int, gc_ms: float) -> None:
        """A step's GC time, from the training thread's record."""
        self.collector.add_gc(step, gc_ms)

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
            self._warn_once("anomalies", "anomalies file: %s; not recorded", err.strerror)
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
            for sample in result.samples:
                journal.add_times(sample.step, sample.times_ms)
            journal.add_evidence(result.evidence)
            if not may_trace:
                return None
            for straggler in journal.scorer.stragglers():
                if straggler.rank not in self._traced:
                    self._traced.add(straggler.rank)
                    return straggler
        except Exception as err:  # records and scores step aside, detection goes on
            self.journal = None
            self._warn_once("journal", "anomaly journal: %s; anomalies are not recorded", err)
        return None

    def scores(self) -> dict[str, Any] | None:
        """Straggler scores and drift for status.json (None: no journal)."""
        return self.journal.scorer.to_json() if self.journal is not None else None

    def write_stragglers(self, run: RunDir | None) -> None:
        """Rewrite stragglers.json (rank 0)."""
        if self.journal is None or run is None:
            return
        try:
            write_stragglers(run, self.journal.scorer.to_json())
        except (OSError, ValueError) as err:
            # written with status.json: one warning for both
            self._warn_once("status", "status file not written (%s)", err)

    def close(self, run: RunDir | None) -> None:
        """At the end (rank 0): pending anomalies written, files closed, scores kept."""
        journal = self.journal
        if journal is None:
            return
        with contextlib.suppress(Exception):
            journal.flush()
            if journal.writer is not None:
                journal.writer.close()
        self.write_stragglers(run)
