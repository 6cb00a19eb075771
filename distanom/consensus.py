"""Cross-rank agreement: gather every rank's step times in rounds, decide the same on all.

Runs on distanom's background thread, never on the training thread. Rounds cover
consecutive steps from step 1 (step 0 has no duration), as many as every rank agreed
(`distanom.rounds`; B, at most `batch_steps`, is the round's agreed length and its row's
room, the same on every rank). Each rank submits a round once its clock has resolved the
round's last step, or earlier when its steps slowed down (`FLAG_EARLY`: it sends the
steps it has), as one float64 row of B's shape:

    [magic, first_step, n_steps, flags, req_id, host_step, req_n_steps, req_n_ranges,
     ranges (16: start,end pairs), durations (B), step flags (B), self ms (B),
     evidence first step, evidence n, evidence (E x 4: arrive ms, collectives, cpu ms,
     gc ms)]

The evidence block (`distanom.evidence`) lags the durations: a rank sends the steps
whose evidence became final since its last round, up to E = B + `EVIDENCE_EXTRA_SLOTS`
consecutive steps, so a backlog drains; its steps may differ from rank to rank.

`self ms` is how long distanom's own capture work ran on the rank during the step;
`host_step` the step the rank's training loop was in when it submitted (the gathered
steps lag it: requested captures are scheduled after the furthest rank's).

The all-gather over `AgentGroup` returns the same (world_size x row) matrix on every
rank; decoding it and feeding the `Detector` is deterministic, so every rank takes the
same capture decisions with no broadcast. Rank 0 also carries on-demand capture
requests in its row: every rank reads them from rank 0's row and schedules the same
steps. A failed or timed-out round raises `GroupUnavailableError` to the caller (the
agent), which logs once and steps capture aside.
"""

from __future__ import annotations

import array
import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from distanom.detect import CaptureDecision, Detector, StepSample
from distanom.records.anomalies import StepEvidence
from distanom.step_record import STEP_AFTER_FLUSH, STEP_DISTURBED, STEP_TRACED

# up to this many ranks a round is decoded from plain lists, beyond by tensor columns
SMALL_WORLD = 64
MAGIC = 7011.0  # a wrong-shaped or foreign row is refused, not misread
HEADER = 8
MAX_RANGES = 8
RANGE_SLOTS = 2 * MAX_RANGES
FLAG_CAPTURE_OFF = 1
FLAG_FINAL = 2
FLAG_MORE_EVIDENCE = 4  # the rank has evidence left after this round: one more at the end
# the rank sent the steps it had, fewer than the round's length, because its steps slowed
# down: the round covers the fewest steps any rank sent (unless a rank sent its final)
FLAG_EARLY = 8
# Requested steps start this many steps after the round that carried the request, so
# every rank learns of them before it reaches them and can make sure they are traced.
REQUEST_LEAD_STEPS = 4
# ... and at least this long at the median step: on short steps a round's own work and the
# gather's skew last more than 4 steps, and a rank must not pass them before it learns
REQUEST_LEAD_MS = 50.0
EVIDENCE_FIELDS = StepEvidence.FIELDS
EVIDENCE_EXTRA_SLOTS = 3
MAX_EVIDENCE_BACKLOG = 4096  # steps of evidence waiting for a round; the oldest go first


@dataclass(frozen=True)
class CaptureRequest:
    """An on-demand request as carried in rank 0's row."""

    number: int  # > 0; rank 0 maps it back to the request file's id
    n_steps: int
    ranges: tuple[tuple[int, int], ...] = ()  # inclusive rank ranges; () = every rank

    def ranks(self, world_size: int) -> tuple[int, ...] | None:
        """The requested ranks that exist in this world, sorted (None: every rank)."""
        if not self.ranges:
            return None
        chosen = {r for lo, hi in self.ranges for r in range(lo, hi + 1) if 0 <= r < world_size}
        return tuple(sorted(chosen))


@dataclass(frozen=True)
class LocalRound:
    """What this rank submits for one round."""

    first_step: int
    durations_ms: tuple[float, ...]
    step_flags: tuple[int, ...]  # STEP_* bits per step
    flags: int = 0
    request: CaptureRequest | None = None
    self_ms: tuple[float, ...] = ()  # per step; () = none
    host_step: int = -1  # the training loop's current step when submitted (-1: unknown)
    evidence: tuple[tuple[int, StepEvidence], ...] = ()  # consecutive steps
    # the row's room in steps: the round's agreed length (a final or an early round may
    # hold fewer steps); 0: the caller's batch_steps
    room: int = 0


@dataclass(frozen=True)
class EvidenceBlock:
    """Every rank's evidence of one round: rank r sent steps first[r] .. first[r] +
    count[r] - 1, their fields (`StepEvidence.as_fields`) at slot offset,
    as plain lists in `lists` (small worlds: no tensor work per round) or as a
    (world, slots, EVIDENCE_FIELDS) float64 tensor in `values` (large worlds)."""

    first: tuple[int, ...]
    count: tuple[int, ...]
    values: torch.Tensor | None = None
    lists: tuple[list[list[float]], ...] | None = None  # per rank, its sent slots

    def fields(self, rank: int) -> list[list[float]]:
        """The fields of the steps `rank` sent, in step order."""
        count = self.count[rank]
        if self.lists is not None:
            return self.lists[rank][:count]
        assert self.values is not None
        return list(self.values[rank, :count].tolist())

    def items(self) -> list[tuple[int, int, StepEvidence]]:
        """(rank, step, evidence) for every step sent (O(world x slots) objects)."""
        out = []
        for rank, first in enumerate(self.first):
            for offset, values in enumerate(self.fields(rank)):
                out.append((rank, first + offset, StepEvidence.from_fields(values)))
        return out

    @classmethod
    def from_items(
        cls, world_size: int, items: Sequence[tuple[int, int, StepEvidence]], *, lists: bool = False
    ) -> EvidenceBlock:
        """The block of (rank, step, evidence) items, each rank's steps consecutive; with
        `lists`, in the small-world form."""
        per_rank: dict[int, list[tuple[int, StepEvidence]]] = {}
        for rank, step, evidence in items:
            per_rank.setdefault(rank, []).append((step, evidence))
        slots = max((len(v) for v in per_rank.values()), default=0)
        rows = [
            [[math.nan] * EVIDENCE_FIELDS for _ in range(max(slots, 1))] for _ in range(world_size)
        ]
        first, count = [-1] * world_size, [0] * world_size
        for rank, steps in per_rank.items():
            steps.sort(key=lambda item: item[0])
            first[rank], count[rank] = steps[0][0], len(steps)
            for offset, (_, ev) in enumerate(steps):
                rows[rank][offset] = ev.as_fields()
        if lists:
            return cls(tuple(first), tuple(count), lists=tuple(rows))
        values = torch.tensor(rows, dtype=torch.float64)
        return cls(tuple(first), tuple(count), values=values)


@dataclass(frozen=True)
class RoundResult:
    """One gathered round, identical on every rank."""

    samples: tuple[StepSample, ...]
    rank_flags: tuple[int, ...]
    request: CaptureRequest | None
    host_steps: tuple[int, ...] = ()  # per rank, as submitted
    evidence: EvidenceBlock | None = None  # every rank's evidence (rank 0 decodes it)

    @property
    def last_step(self) -> int:
        """The round's last step (-1 for an empty round)."""
        return self.samples[-1].step if self.samples else -1

    def ranks_with(self, flag: int) -> list[int]:
        """The ranks whose round flags include `flag`."""
        return [rank for rank, flags in enumerate(self.rank_flags) if flags & flag]

    @property
    def cut_early(self) -> bool:
        """Some rank ended this round early and none sent its final (`_early_cut`)."""
        return _is_cut_early(self.rank_flags)


def evidence_slots(batch_steps: int) -> int:
    """Steps of evidence one row carries."""
    return batch_steps + EVIDENCE_EXTRA_SLOTS


def row_length(batch_steps: int) -> int:
    """Length of one rank's row for rounds of `batch_steps` steps."""
    evidence = 2 + EVIDENCE_FIELDS * evidence_slots(batch_steps)
    return HEADER + RANGE_SLOTS + 3 * batch_steps + evidence


def _encode_evidence(row: array.array[float], local: LocalRound, batch_steps: int) -> None:
    items = local.evidence
    slots = evidence_slots(batch_steps)
    first = items[0][0] if items else -1
    if len(items) > slots or [s for s, _ in items] != list(range(first, first + len(items))):
        raise ValueError("evidence steps must be consecutive and fit the round")
    base = HEADER + RANGE_SLOTS + 3 * batch_steps
    row[base] = float(first)
    row[base + 1] = float(len(items))
    if items:
        values = array.array("d", [v for _, ev in items for v in ev.as_fields()])
        row[base + 2 : base + 2 + len(values)] = values


def _decode_evidence(matrix: torch.Tensor, batch_steps: int) -> EvidenceBlock:
    base = HEADER + RANGE_SLOTS + 3 * batch_steps
    slots = evidence_slots(batch_steps)
    block = matrix[:, base : base + 2 + EVIDENCE_FIELDS * slots]
    counts = torch.nan_to_num(block[:, 1], nan=0.0).clamp(0, slots).to(torch.int64)
    first = torch.nan_to_num(block[:, 0], nan=-1.0).to(torch.int64)
    values = block[:, 2:].reshape(matrix.shape[0], slots, EVIDENCE_FIELDS)
    return EvidenceBlock(tuple(first.tolist()), tuple(counts.tolist()), values=values)


def _evidence_of_rows(rows: list[list[float]], batch_steps: int) -> EvidenceBlock:
    """The evidence block from plain rows (small worlds)."""
    base = HEADER + RANGE_SLOTS + 3 * batch_steps
    slots = evidence_slots(batch_steps)
    first: list[int] = []
    count: list[int] = []
    lists: list[list[list[float]]] = []
    for row in rows:
        n = row[base + 1]
        n_int = min(slots, max(0, int(n))) if math.isfinite(n) else 0
        start = row[base]
        first.append(int(start) if math.isfinite(start) else -1)
        count.append(n_int)
        at = base + 2
        lists.append(
            [row[at + EVIDENCE_FIELDS * k : at + EVIDENCE_FIELDS * (k + 1)] for k in range(n_int)]
        )
    return EvidenceBlock(tuple(first), tuple(count), lists=tuple(lists))


@functools.lru_cache(maxsize=32)  # a round's room varies: near traced steps, rows are shorter
def _empty_row(batch_steps: int) -> array.array[float]:
    return array.array("d", [math.nan] * row_length(batch_steps))


def encode_round(local: LocalRound, batch_steps: int) -> torch.Tensor:
    """This rank's round as its float64 row for rounds of `batch_steps` (NaN where
    empty): `encode_row`, not copied (the tensor keeps the array; nothing else holds it
    to resize it)."""
    return torch.frombuffer(encode_row(local, batch_steps), dtype=torch.float64)


def encode_row(local: LocalRound, batch_steps: int) -> array.array[float]:
    """`encode_round`'s row as an `array`: built in a copy of an empty row, as a handful
    of tensor writes, or `torch.tensor` of a list (a conversion per float), would cost
    the control thread more GIL time than the whole row."""
    n = len(local.durations_ms)
    if n > batch_steps or len(local.step_flags) != n:
        raise ValueError("round larger than batch_steps or flags/durations mismatch")
    row = _empty_row(batch_steps)[:]
    request = local.request
    ranges = request.ranges if request is not None else ()
    if len(ranges) > MAX_RANGES:
        raise ValueError(f"at most {MAX_RANGES} rank ranges per request")
    row[:HEADER] = array.array(
        "d",
        [
            MAGIC,
            float(local.first_step),
            float(n),
            float(local.flags),
            float(request.number) if request else 0.0,
            float(local.host_step),
            float(request.n_steps) if request else 0.0,
            float(len(ranges)),
        ],
    )
    for slot, (lo, hi) in enumerate(ranges):
        row[HEADER + 2 * slot] = float(lo)
        row[HEADER + 2 * slot + 1] = float(hi)
    start = HEADER + RANGE_SLOTS
    if n:
        row[start : start + n] = array.array("d", local.durations_ms)
        row[start + batch_steps : start + batch_steps + n] = array.array("d", local.step_flags)
        own = local.self_ms or (0.0,) * n
        if len(own) != n:
            raise ValueError("self_ms and durations mismatch")
        row[start + 2 * batch_steps : start + 2 * batch_steps + n] = array.array("d", own)
    _encode_evidence(row, local, batch_steps)
    return row


def decode_round(
    matrix: torch.Tensor, batch_steps: int, *, with_evidence: bool = True
) -> RoundResult:
    """Turn the gathered (world_size x row) matrix into samples (same on every rank).

    Up to `SMALL_WORLD` ranks the matrix is read into plain lists once and decoded by
    Python loops (a handful of tensor operations would cost the control thread more GIL
    time than the loops); beyond, by column-wise tensor operations, so a round costs
    O(steps) Python work, not O(world x steps). `with_evidence=False` skips the per-rank
    evidence (only rank 0 keeps the journal that reads it)."""
    if matrix.dim() != 2 or matrix.shape[1] != row_length(batch_steps):
        raise ValueError(f"gathered round has shape {tuple(matrix.shape)}")
    if matrix.shape[0] <= SMALL_WORLD:
        return _decode_rows(matrix.tolist(), batch_steps, with_evidence)
    bad = (matrix[:, 0] != MAGIC).nonzero()
    if len(bad):
        raise ValueError(f"rank {int(bad[0, 0])} sent a malformed round")
    apart = (matrix[:, 1] != matrix[0, 1]).nonzero()
    if len(apart):  # rounds out of step: an error, never misread samples
        raise ValueError(f"rank {int(apart[0, 0])} sent a round of another first step")
    head = matrix[0].tolist()
    samples = _samples_of_matrix(matrix, int(head[1]), batch_steps)
    flags = tuple(int(f) for f in matrix[:, 3].tolist())
    samples = _early_cut(samples, matrix[:, 2].tolist(), flags)
    host = matrix[:, 5]
    host_steps = tuple(int(h) for h in torch.where(host.isfinite(), host, -1.0).tolist())
    evidence = _decode_evidence(matrix, batch_steps) if with_evidence else None
    return RoundResult(tuple(samples), flags, _request_of(head), host_steps, evidence)


def _is_cut_early(flags: Sequence[int]) -> bool:
    """Some rank sent `FLAG_EARLY` and none `FLAG_FINAL`: the round is cut early."""
    return any(f & FLAG_EARLY for f in flags) and not any(f & FLAG_FINAL for f in flags)


def _early_cut(
    samples: list[StepSample], counts: list[float], flags: tuple[int, ...]
) -> list[StepSample]:
    """A round some rank ended early (`FLAG_EARLY`) covers the fewest steps any rank
    sent; every rank sends the rest again in the next round. A final round is not cut:
    its rank sends no more."""
    if not _is_cut_early(flags):
        return samples
    fewest = min((int(c) if math.isfinite(c) else 0 for c in counts), default=0)
    return samples[: max(0, fewest)]


def decode_rows(rows: list[list[float]], batch_steps: int, *, with_evidence: bool) -> RoundResult:
    """`decode_round` of the matrix as lists (its `tolist()`), up to `SMALL_WORLD` ranks:
    the same result with no tensor at all (`AgentGroup.all_gather_rows`)."""
    if any(len(row) != row_length(batch_steps) for row in rows):
        raise ValueError("gathered round has rows of another length")
    return _decode_rows(rows, batch_steps, with_evidence)


def _decode_rows(rows: list[list[float]], batch_steps: int, with_evidence: bool) -> RoundResult:
    """`decode_round` for a small world, from the matrix as lists."""
    head = rows[0]
    for rank, row in enumerate(rows):
        if row[0] != MAGIC:
            raise ValueError(f"rank {rank} sent a malformed round")
        if row[1] != head[1]:  # rounds out of step: an error, never misread samples
            raise ValueError(f"rank {rank} sent round of step {row[1]:.0f}, rank 0 {head[1]:.0f}")
    start = HEADER + RANGE_SLOTS
    samples = _samples_of_rows(
        [row[start : start + 3 * batch_steps] for row in rows],
        [row[2] for row in rows],
        int(head[1]),
        batch_steps,
    )
    flags = tuple(int(row[3]) for row in rows)
    samples = _early_cut(samples, [row[2] for row in rows], flags)
    host_steps = tuple(int(row[5]) if math.isfinite(row[5]) else -1 for row in rows)
    evidence = _evidence_of_rows(rows, batch_steps) if with_evidence else None
    return RoundResult(tuple(samples), flags, _request_of(head), host_steps, evidence)


def _request_of(head: list[float]) -> CaptureRequest | None:
    """The on-demand request rank 0's row carries, if any."""
    if not head[4] > 0:
        return None
    n_ranges = int(head[7])
    ranges = tuple(
        (int(head[HEADER + 2 * i]), int(head[HEADER + 2 * i + 1])) for i in range(n_ranges)
    )
    return CaptureRequest(int(head[4]), int(head[6]), ranges)


def _samples_of_matrix(matrix: torch.Tensor, first_step: int, batch_steps: int) -> list[StepSample]:
    """The round's samples by column-wise tensor operations (O(steps) Python work)."""
    counts = matrix[:, 2].to(torch.int64)
    n_steps = int(counts.max())
    start = HEADER + RANGE_SLOTS
    samples: list[StepSample] = []
    if n_steps > 0:
        present = torch.arange(n_steps).unsqueeze(0) < counts.unsqueeze(1)  # (world, n)
        times = matrix[:, start : start + n_steps].masked_fill(~present, math.nan)
        bits = matrix[:, start + batch_steps : start + batch_steps + n_steps]
        bits = torch.nan_to_num(bits, nan=0.0).to(torch.int64)
        traced = ((bits & STEP_TRACED) != 0).logical_or(~present).all(dim=0).tolist()
        flushed = ((bits & STEP_AFTER_FLUSH) != 0).logical_and(present).any(dim=0).tolist()
        disturbed = ((bits & STEP_DISTURBED) != 0).logical_and(present).any(dim=0).tolist()
        own = matrix[:, start + 2 * batch_steps : start + 2 * batch_steps + n_steps]
        own = own.masked_fill(~(present & own.isfinite()), -math.inf).max(dim=0).values
        own_ms = [v if math.isfinite(v) else 0.0 for v in own.tolist()]
        columns = times.t().tolist()
        for offset in range(n_steps):
            samples.append(
                StepSample(
                    first_step + offset,
                    tuple(columns[offset]),
                    traced=bool(traced[offset]),
                    after_flush=bool(flushed[offset]),
                    disturbed=bool(disturbed[offset]),
                    self_ms=own_ms[offset],
                )
            )
    return samples


def _samples_of_rows(
    rows: list[list[float]], counts_f: list[float], first_step: int, batch_steps: int
) -> list[StepSample]:
    """The same samples from plain lists: for a few ranks, a handful of Python loops cost
    far less than the tensor operations' fixed overhead (this runs once per round on the
    control thread, holding the GIL the training thread needs). Worked out a column (a
    rank's durations, flags or own work) at a time, in comprehensions and C loops, not a
    Python loop body per step and rank; rows whose counts do not fit the round take the
    per-step path (`_samples_of_rows_per_step`)."""
    counts = [int(c) if math.isfinite(c) else 0 for c in counts_f]
    n_steps = max(counts)
    if n_steps <= 0 or n_steps > batch_steps or min(counts) < 0:
        return _samples_of_rows_per_step(rows, counts, first_step, batch_steps)
    isfinite, nan, minus_inf = math.isfinite, math.nan, -math.inf
    columns, all_bits, any_bits, own_columns = [], [], [], []
    for row, count in zip(rows, counts, strict=True):
        # every rank's flags are read for every step, present or not, as the per-step path
        bits = [0 if f != f else int(f) for f in row[batch_steps : batch_steps + n_steps]]
        spent = row[2 * batch_steps : 2 * batch_steps + count]
        own = [o if isfinite(o) else minus_inf for o in spent]
        if count < n_steps:  # absent steps: unknown, AND-ed as traced, OR-ed as nothing
            missing = n_steps - count
            columns.append(row[:count] + [nan] * missing)
            all_bits.append(bits[:count] + [STEP_TRACED] * missing)
            any_bits.append(bits[:count] + [0] * missing)
            own += [minus_inf] * missing
        else:
            columns.append(row[:n_steps])
            all_bits.append(bits)
            any_bits.append(bits)
        own_columns.append(own)
    if len(rows) == 1:
        every, some, most = all_bits[0], any_bits[0], own_columns[0]
    else:  # max keeps the first of equal values, as the per-step path's strict >
        every = [functools.reduce(operator.and_, b) for b in zip(*all_bits, strict=True)]
        some = [functools.reduce(operator.or_, b) for b in zip(*any_bits, strict=True)]
        most = list(map(max, *own_columns))
    new = StepSample.of_fields
    return [
        new(
            first_step + offset,
            times,
            (every[offset] & STEP_TRACED) != 0,
            (some[offset] & STEP_AFTER_FLUSH) != 0,
            (some[offset] & STEP_DISTURBED) != 0,
            most[offset] if most[offset] != minus_inf else 0.0,
        )
        for offset, times in enumerate(zip(*columns, strict=True))
    ]


def _samples_of_rows_per_step(
    rows: list[list[float]], counts: list[int], first_step: int, batch_steps: int
) -> list[StepSample]:
    """`_samples_of_rows` a step and rank at a time: for counts outside the round (only
    a malformed row has them), read exactly as before the column-wise path."""
    n_steps = max(counts)
    samples: list[StepSample] = []
    for offset in range(max(0, n_steps)):
        times, traced, flushed, disturbed, own = [], True, False, False, -math.inf
        for row, count in zip(rows, counts, strict=True):
            present = offset < count
            times.append(row[offset] if present else math.nan)
            flag = row[batch_steps + offset]
            bits = 0 if math.isnan(flag) else int(flag)
            if present:
                traced = traced and bool(bits & STEP_TRACED)
                flushed = flushed or bool(bits & STEP_AFTER_FLUSH)
                disturbed = disturbed or bool(bits & STEP_DISTURBED)
                spent = row[2 * batch_steps + offset]
                if math.isfinite(spent) and spent > own:
                    own = spent
        samples.append(
            StepSample(
                first_step + offset,
                tuple(times),
                traced=traced,
                after_flush=flushed,
                disturbed=disturbed,
                self_ms=own if math.isfinite(own) else 0.0,
            )
        )
    return samples


def lead_steps(median_ms: float | None) -> int:
    """Steps from the furthest rank's host step to the first step scheduled for every rank
    (requests, planned tracing): `REQUEST_LEAD_STEPS`, or `REQUEST_LEAD_MS` at the median
    step if that is more (the same on every rank: the median is gathered data's)."""
    if median_ms is None or not math.isfinite(median_ms) or median_ms <= 0:
        return REQUEST_LEAD_STEPS
    return min(100_000, max(REQUEST_LEAD_STEPS, math.ceil(REQUEST_LEAD_MS / median_ms)))


def decide(result: RoundResult, detector: Detector, world_size: int) -> list[CaptureDecision]:
    """Every capture decision of one round, in order: detector verdicts, then requests."""
    decisions = detector.observe_many(result.samples)
    request = result.request
    if request is not None and request.n_steps > 0:
        # after every rank's training loop, not just the gathered steps (they lag it)
        furthest = max((result.last_step, *result.host_steps))
        first = furthest + 1 + lead_steps(detector.median_ms)
        ranks = request.ranks(world_size)
        median = detector.median_ms
        for offset in range(request.n_steps):
            decisions.append(
                CaptureDecision(
                    step=first + offset,
                    kind="requested",
                    step_ms=math.nan,
                    median_ms=median,
                    threshold_ms=detector.threshold_ms,
                    slowest_rank=-1,
                    ranks=ranks,
                    request_id=str(request.number),
                )
            )
    return decisions
