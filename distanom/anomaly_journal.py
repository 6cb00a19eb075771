"""Rank 0's anomaly journal: every rank's per-step evidence from the rounds, straggler
scores, and one anomalies.jsonl line per anomalous step the detector judged.

Fed by the control thread (`distanom.evidence.EvidenceTier.fold`) with each round's
judgments (`distanom.detect.AnomalyJudgment`), gathered step times and evidence block
(`distanom.consensus.EvidenceBlock`). A step is complete once every rank's evidence and
its times are in: its late ranks go to the `StragglerScorer` (`distanom.stragglers`),
and a pending judgment of it is written (`distanom.records.anomalies`).

Two storage forms, chosen by world size, give the same results: up to
`consensus.SMALL_WORLD` ranks plain lists (this runs once per round on the control
thread, holding the GIL a launch-bound training thread needs, and a tensor operation's
fixed cost is larger than the whole list work there); beyond, arrays, so a round costs
O(distinct (first, count) groups x slots) tensor operations, not per-rank Python work
(docs/evidence.md, Scale).
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from distanom.consensus import SMALL_WORLD, EvidenceBlock
from distanom.detect import AnomalyJudgment
from distanom.records.anomalies import AnomalyRecord, AnomalyWriter, StepEvidence
from distanom.stragglers import LATE_SHARE, StragglerScorer

log = logging.getLogger(__name__)

MAX_PENDING_STEPS = 4096  # steps whose evidence or times are still incomplete
MEDIAN_STEPS = 64  # per-rank recent arrivals and CPU times the journal keeps
FIELDS = StepEvidence.FIELDS  # per step and rank: `StepEvidence.as_fields`


@dataclass
class _StepRow:
    values: Any  # small worlds: a list (world) of FIELDS floats; large: a (world, FIELDS) tensor
    filled: int = 0


class AnomalyJournal:
    """Rank 0: every rank's evidence per step, straggler scores, anomaly lines."""

    def __init__(self, world_size: int, writer: AnomalyWriter | None) -> None:
        self.world_size = world_size
        self.writer = writer
        self.scorer = StragglerScorer(world_size)
        self.small = world_size <= SMALL_WORLD
        self._rows: dict[int, _StepRow] = {}
        self._times: dict[int, tuple[float, ...]] = {}
        self._pending: dict[int, AnomalyJudgment] = {}
        # the last MEDIAN_STEPS complete steps' fields (`FIELDS` per rank) in small worlds
        self._recent: collections.deque[list[list[float]]] = collections.deque(maxlen=MEDIAN_STEPS)
        self._history = torch.full((MEDIAN_STEPS, world_size, 2), math.nan, dtype=torch.float64)
        self._history_at = 0
        self.written = 0
        # told every completed anomaly record, written or not (the live metrics' causes)
        self.listener: Callable[[AnomalyRecord], None] | None = None

    def add_times(self, step: int, times_ms: tuple[float, ...]) -> None:
        """A gathered step's per-rank durations (add a round's judgments first)."""
        self.add_times_many(((step, times_ms),))

    def add_times_many(self, steps: Iterable[tuple[int, tuple[float, ...]]]) -> None:
        """`add_times` for each (step, times) in order, in one loop: a round's steps pass
        here on the control thread, and their evidence usually comes in a later round,
        so most steps only wait."""
        times, rows, world = self._times, self._rows, self.world_size
        for step, times_ms in steps:
            times[step] = times_ms
            if len(times) > MAX_PENDING_STEPS:
                times.pop(next(iter(times)))
            row = rows.get(step)  # _maybe_complete
            if row is not None and step in times and row.filled >= world:
                self._complete(step)

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
        if not (self.small and self._add_lockstep(block)):
            touched = self._add_lists(block) if self.small else self._add_tensor(block)
            for step in sorted(touched):
                self._maybe_complete(step)
        while len(self._rows) > MAX_PENDING_STEPS:
            self._complete(next(iter(self._rows)))

    def _add_lockstep(self, block: EvidenceBlock) -> bool:
        """`_add_lists` then `_maybe_complete` per step, for the common block where every
        rank sent the same steps (False, nothing done, for any other): each step's row
        comes out full, so one that already has its times completes at once, without a
        `_StepRow` kept and looked up again. Same results, step by step in step order."""
        if len(block.count) != self.world_size:
            return False
        count, first = block.count[0], block.first[0]
        if count <= 0 or block.count.count(count) != self.world_size:
            return False
        if block.first.count(first) != self.world_size:
            return False
        rows, times, world, pending = self._rows, self._times, self.world_size, self._pending
        per_rank = [block.fields(rank) for rank in range(world)]
        for offset, fields in enumerate(zip(*per_rank, strict=True)):
            step = first + offset
            row = rows.get(step)
            if row is None:  # as an empty row with every rank's fields set in turn
                values = [list(f) for f in fields]
                if step not in times or step in pending:  # waits, or is written: as before
                    rows[step] = _StepRow(values, world)
                    self._maybe_complete(step)
                    continue
                # _complete, for a row never stored (no judgment to write from it)
                self._score(step, values, times.pop(step))
                self._keep(values)
                continue
            for rank, f in enumerate(fields):  # a step sent before (a repeat): as before
                row.values[rank] = list(f)
            row.filled += world
            self._maybe_complete(step)
        return True

    def _add_lists(self, block: EvidenceBlock) -> set[int]:
        touched: set[int] = set()
        for rank, first in enumerate(block.first):
            if block.count[rank] <= 0:
                continue
            for offset, fields in enumerate(block.fields(rank)):
                step = first + offset
                row = self._rows.get(step)
                if row is None:
                    empty = [[math.nan] * FIELDS for _ in range(self.world_size)]
                    row = self._rows[step] = _StepRow(empty)
                row.values[rank] = list(fields)
                row.filled += 1
                touched.add(step)
        return touched

    def _add_tensor(self, block: EvidenceBlock) -> set[int]:
        values = block.values
        if values is None:  # lists from a small-world decode: one conversion
            slots = max(1, max(block.count, default=0))
            values = torch.full((self.world_size, slots, FIELDS), math.nan, dtype=torch.float64)
            for rank in range(self.world_size):
                fields = block.fields(rank)
                if fields:
                    values[rank, : len(fields)] = torch.tensor(fields, dtype=torch.float64)
        count = torch.tensor(block.count, dtype=torch.int64)
        senders = (count > 0).nonzero().flatten()
        if not len(senders):
            return set()
        first = torch.tensor(block.first, dtype=torch.int64)
        # one key per (first, count): ranks in lockstep form a handful of groups
        span = int(count.max()) + 1
        keys = first[senders] * span + count[senders]
        groups, which = torch.unique(keys, return_inverse=True)
        touched: set[int] = set()
        for group, key in enumerate(groups.tolist()):
            group_first, group_count = divmod(key, span)
            ranks = senders[which == group]
            for offset in range(group_count):
                step = group_first + offset
                row = self._rows.get(step)
                if row is None:
                    empty = torch.full((self.world_size, FIELDS), math.nan, dtype=torch.float64)
                    row = self._rows[step] = _StepRow(empty)
                row.values[ranks] = values[ranks, offset]
                row.filled += len(ranks)
                touched.add(step)
        return touched

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
            self._score(step, row.values, times)
        judgment = self._pending.pop(step, None)
        if judgment is not None:
            self._write(judgment)  # with the medians of the steps before this one
        del self._rows[step]
        self._times.pop(step, None)
        self._keep(row.values)

    def _score(self, step: int, values: Any, times: tuple[float, ...]) -> None:
        """A complete step's lateness, for the straggler scores."""
        finite = [t for t in times if math.isfinite(t)]
        if finite:
            step_ms = max(finite)
            self.scorer.add_late(step, self._late(values, step_ms), step_ms)

    def _keep(self, values: Any) -> None:
        """A complete step's fields, for the medians later judgments are written with."""
        if self.small:  # kept whole (never changed after): `_medians` reads two fields
            self._recent.append(values)
        else:
            kept = values[:, [0, 2]]  # infinities read as unknown, as in the list form
            self._history[self._history_at % MEDIAN_STEPS] = kept.where(kept.isfinite(), math.nan)
            self._history_at += 1

    def _late(self, values: Any, step_ms: float) -> tuple[tuple[int, float], ...] | None:
        """The ranks late at a step, as `StragglerScorer.add_late` takes them: arrival
        after the (lower) median rank's by `LATE_SHARE` of the step or more."""
        if self.world_size < 2:  # nobody to be late against
            return None
        if self.small:
            arrive = [v[0] for v in values]
            known = [a for a in arrive if math.isfinite(a)]
            if len(known) < 2:
                return None
            median = statistics.median_low(known)
            return tuple(
                (rank, min(a - median, step_ms))
                for rank, a in enumerate(arrive)
                if math.isfinite(a) and a - median >= LATE_SHARE * step_ms
            )
        column = values[:, 0]
        finite = column.isfinite()
        if int(finite.sum()) < 2:
            return None
        lateness = column - column[finite].median()
        ranks = ((lateness >= LATE_SHARE * step_ms) & finite).nonzero().flatten()
        ms = lateness[ranks].clamp(max=step_ms)
        return tuple(zip(ranks.tolist(), ms.tolist(), strict=True))

    def _medians(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per rank, the (lower) median arrival and CPU time of the recent complete steps."""
        if not self.small:
            medians = self._history.nanmedian(dim=0).values  # (world, 2)
            return tuple(medians[:, 0].tolist()), tuple(medians[:, 1].tolist())
        arrive, cpu = [], []
        for rank in range(self.world_size):
            arrive.append(_median_low([step[rank][0] for step in self._recent]))
            cpu.append(_median_low([step[rank][2] for step in self._recent]))
        return tuple(arrive), tuple(cpu)

    def flush(self) -> None:
        """At the end: write every pending anomaly with the evidence there is."""
        for step in sorted(self._pending):
            self._write(self._pending[step])
        self._pending.clear()

    def _write(self, judgment: AnomalyJudgment) -> None:
        if self.writer is None and self.listener is None:
            return
        step = judgment.step
        row = self._rows.get(step)
        times = self._times.get(step) or (math.nan,) * self.world_size
        evidence = [StepEvidence()] * self.world_size
        if row is not None:
            values = row.values if self.small else row.values.tolist()
            evidence = [StepEvidence.from_fields(fields) for fields in values]
        arrive_medians, cpu_medians = self._medians()
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
            arrive_median_ms=arrive_medians,
            cpu_median_ms=cpu_medians,
        )
        if self.listener is not None:
            self.listener(record)
        if self.writer is None:
            return
        try:
            self.writer.write(record)
            self.written += 1
        except (OSError, ValueError) as err:
            log.warning("anomalies file: %s; anomalies are no longer recorded", err)
            self.writer = None


def _median_low(values: Sequence[float]) -> float:
    """The lower median of the finite values (NaN without any), as torch's nanmedian."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median_low(finite) if finite else math.nan
