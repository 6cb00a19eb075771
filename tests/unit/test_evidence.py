"""Per-step evidence: marks and Flight Recorder entries become one StepEvidence per step;
rank 0's journal writes each anomaly once every rank's evidence is in."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from pathlib import Path

import pytest

from distanom import evidence as evidence_module
from distanom.anomaly_journal import AnomalyJournal
from distanom.consensus import EvidenceBlock
from distanom.detect import AnomalyJudgment
from distanom.evidence import EvidenceCollector, EvidenceMarks
from distanom.flight_recorder import FrEntry
from distanom.records.anomalies import AnomalyWriter, StepEvidence, read_anomalies
from distanom.rundir import RunDir

MS = 1_000_000


def entry(record: int, at_ms: float, thread: str = "1") -> FrEntry:
    return FrEntry(
        record, "0", record + 1, "gloo:all_reduce", "scheduled", int(at_ms * MS), 0, 0, thread
    )


class FakeFr:
    def __init__(self) -> None:
        self.entries: list[FrEntry] = []

    def __call__(self, limit: int = 0, after: dict[str, int] | None = None) -> tuple[FrEntry, ...]:
        seen = after or {}  # as the real read: only entries newer than those seen
        return tuple(e for e in self.entries if e.record_id > seen.get(e.source, -1))


@pytest.fixture
def fr(monkeypatch: pytest.MonkeyPatch) -> FakeFr:
    fake = FakeFr()
    monkeypatch.setattr(evidence_module, "read_entries", fake)
    return fake


def marks_at(*ends_ms: float) -> EvidenceMarks:
    marks = EvidenceMarks()
    for step, end in enumerate(ends_ms):
        marks.marks.append((step, int(end * MS), int(step * 2 * MS)))
    return marks


def test_arrival_is_the_last_collective_after_the_step_began(fr: FakeFr) -> None:
    marks = marks_at(1000.0, 1100.0, 1200.0)  # steps 1 and 2 have a start and an end
    fr.entries = [entry(0, 1010.0), entry(1, 1060.0), entry(2, 1150.0)]
    collector = EvidenceCollector(marks, read_fr=True)
    collector.add_gc(2, 1.5)
    got = dict(collector.poll(force=True))
    assert got[1].collectives == 2 and got[1].arrive_ms == pytest.approx(60.0)
    assert got[2].arrive_ms == pytest.approx(50.0) and got[2].gc_ms == 1.5
    assert got[1].cpu_ms == pytest.approx(2.0)


def test_own_group_entries_are_left_out_and_open_steps_wait(fr: FakeFr) -> None:
    marks = marks_at(1000.0, 1100.0)
    collector = EvidenceCollector(marks, read_fr=True)
    own = str(threading.get_ident())
    fr.entries = [entry(0, 1050.0), entry(1, 1090.0, thread=own), entry(2, 1120.0)]
    got = dict(collector.poll(force=True))
    assert got[1].arrive_ms == pytest.approx(50.0) and got[1].collectives == 1
    # the entry of step 2 (still running at the read) counts once step 2 has ended
    marks.marks.append((2, 1200 * MS, 4 * MS))
    got = dict(collector.poll(force=True))
    assert got[2].arrive_ms == pytest.approx(20.0) and got[2].collectives == 1


def test_without_flight_recorder_cpu_and_gc_still_come(fr: FakeFr) -> None:
    collector = EvidenceCollector(marks_at(0.0, 10.0), read_fr=False)
    ((step, ev),) = collector.poll()
    assert step == 1 and math.isnan(ev.arrive_ms) and ev.collectives == -1 and ev.cpu_ms == 2.0


def test_overwritten_entries_leave_arrival_unknown(fr: FakeFr) -> None:
    marks = marks_at(1000.0, 1100.0)
    collector = EvidenceCollector(marks, read_fr=True)
    fr.entries = [entry(0, 1050.0)]
    collector.poll(force=True)
    marks.marks.extend([(2, 1200 * MS, 0), (3, 1300 * MS, 0)])
    fr.entries = [entry(5, 1250.0)]  # records 1-4 were overwritten before this read
    got = dict(collector.poll(force=True))
    assert got[2].collectives == -1 and math.isnan(got[2].arrive_ms)
    assert got[3].arrive_ms == pytest.approx(50.0)


def test_each_recorder_is_numbered_on_its_own(fr: FakeFr) -> None:
    """NCCL groups have their own recorder, numbered from 0 like the generic one: the
    entries of both count, and neither's numbers hide the other's."""
    marks = marks_at(1000.0, 1100.0, 1200.0)
    collector = EvidenceCollector(marks, read_fr=True)
    nccl = [
        dataclasses.replace(entry(r, at), source="nccl") for r, at in ((0, 1020.0), (1, 1040.0))
    ]
    fr.entries = [entry(0, 1010.0), *nccl, dataclasses.replace(entry(2, 1150.0), source="nccl")]
    got = dict(collector.poll(force=True))
    assert got[1].collectives == 3 and got[1].arrive_ms == pytest.approx(40.0)
    assert got[2].collectives == 1
    marks.marks.append((3, 1300 * MS, 6 * MS))
    fr.entries.append(entry(1, 1250.0))  # the generic recorder's next record
    got = dict(collector.poll(force=True))
    assert got[3].collectives == 1 and got[3].arrive_ms == pytest.approx(50.0)


def nccl_entry(record: int, at_ms: float) -> FrEntry:
    return dataclasses.replace(entry(record, at_ms), source="nccl")


def test_an_overwrite_in_one_recorder_is_not_hidden_by_the_other(fr: FakeFr) -> None:
    marks = marks_at(1000.0, 1100.0)
    collector = EvidenceCollector(marks, read_fr=True)
    fr.entries = [nccl_entry(0, 1050.0), entry(0, 1060.0)]
    collector.poll(force=True)
    marks.marks.extend([(2, 1200 * MS, 0), (3, 1300 * MS, 0), (4, 1400 * MS, 0)])
    # NCCL records 1-4 (steps 2 and 3) were overwritten; a gloo entry of step 2 is left
    fr.entries = [entry(1, 1150.0), nccl_entry(5, 1350.0)]
    got = dict(collector.poll(force=True))
    assert got[2].collectives == -1 and got[3].collectives == -1
    assert math.isnan(got[3].arrive_ms)
    # step 4 may have lost entries too, but its last collective came after the loss
    assert got[4].arrive_ms == pytest.approx(50.0) and got[4].collectives == -1


def test_an_overwrite_after_a_carried_entry_leaves_that_step_unknown(fr: FakeFr) -> None:
    marks = marks_at(1000.0, 1100.0)
    collector = EvidenceCollector(marks, read_fr=True)
    fr.entries = [nccl_entry(0, 1050.0), nccl_entry(1, 1120.0)]  # 1120: step 2 still runs
    collector.poll(force=True)
    marks.marks.extend([(2, 1200 * MS, 0), (3, 1300 * MS, 0), (4, 1400 * MS, 0)])
    fr.entries = [nccl_entry(9, 1350.0)]  # records 2-8 (steps 2 and 3) were overwritten
    got = dict(collector.poll(force=True))
    assert got[2].collectives == -1 and math.isnan(got[2].arrive_ms)  # not the early 20 ms
    assert got[3].collectives == -1
    assert got[4].arrive_ms == pytest.approx(50.0)


def judgment(step: int) -> AnomalyJudgment:
    return AnomalyJudgment(step, 300.0, 15.0, 22.5, False, "condition", 0)


def test_journal_writes_an_anomaly_once_every_rank_sent_its_evidence(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    journal = AnomalyJournal(2, AnomalyWriter(run))
    for step in range(1, 12):
        journal.add_times(step, (15.0, 15.0))
        journal.add_evidence(
            EvidenceBlock.from_items(
                2, [(r, step, StepEvidence(10.0, 1, 1.0, 0.0)) for r in (0, 1)]
            )
        )
    journal.add_judgments([judgment(12)])
    journal.add_times(12, (300.0, 299.0))
    journal.add_evidence(EvidenceBlock.from_items(2, [(0, 12, StepEvidence(10.0, 1, 1.0, 0.0))]))
    assert read_anomalies(run) == []  # rank 1's evidence is not in yet
    journal.add_evidence(EvidenceBlock.from_items(2, [(1, 12, StepEvidence(290.0, 1, 1.1, 0.0))]))
    (record,) = read_anomalies(run)
    assert record.step == 12 and record.evidence[1].arrive_ms == 290.0
    assert record.arrive_median_ms == (10.0, 10.0) and record.durations_ms == (300.0, 299.0)


def test_journal_flush_writes_what_it_has(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    journal = AnomalyJournal(2, AnomalyWriter(run))
    journal.add_judgments([judgment(5)])
    journal.add_times(5, (300.0, 300.0))
    journal.flush()
    (record,) = read_anomalies(run)
    assert record.step == 5 and all(math.isnan(e.arrive_ms) for e in record.evidence)


def test_journal_scores_ranks_sending_different_steps_in_one_round() -> None:
    journal = AnomalyJournal(3, None)
    for step in range(1, 40):
        journal.add_times(step, (40.0, 40.0, 40.0))
    items = []
    for rank in range(3):  # rank 2 lags: its evidence comes a round later
        for step in range(1, 40 if rank < 2 else 30):
            items.append((rank, step, StepEvidence(10.0 + (25.0 if rank == 1 else 0.0), 1, 1.0, 0)))
    journal.add_evidence(EvidenceBlock.from_items(3, items))
    assert journal.scorer.steps == 29
    journal.add_evidence(
        EvidenceBlock.from_items(
            3, [(2, s, StepEvidence(10.0, 1, 1.0, 0.0)) for s in range(30, 40)]
        )
    )
    assert journal.scorer.steps == 39
    assert [s.rank for s in journal.scorer.stragglers()] == [1]


@pytest.mark.parametrize("lists", [False, True])
def test_journal_list_and_array_storage_write_the_same_records(tmp_path: Path, lists: bool) -> None:
    """Small worlds keep evidence in lists, large ones in arrays: same lines, same scores."""
    written = {}
    for form in ("lists", "arrays"):
        run = RunDir(tmp_path / form)
        run.path.mkdir()
        journal = AnomalyJournal(4, AnomalyWriter(run))
        journal.small = form == "lists"
        for step in range(1, 30):
            late = 30.0 if step % 3 == 0 else 0.0  # rank 2 late on every third step
            if step in (14, 27):
                journal.add_judgments([judgment(step)])
            journal.add_times(step, (50.0 + step, 50.0, 52.0, math.nan))
            items = [
                (r, step, StepEvidence(10.0 + r + (late if r == 2 else 0.0), 2, 3.0 + r, 0.5))
                for r in range(4)
                if not (r == 3 and step == 14)  # rank 3 never sends step 14
            ]
            journal.add_evidence(EvidenceBlock.from_items(4, items, lists=lists))
        journal.flush()
        written[form] = (
            [record.to_json() for record in read_anomalies(run)],
            journal.scorer.to_json(),
        )
    assert written["lists"] == written["arrays"]
    records, _ = written["lists"]
    assert [r["step"] for r in records] == [14, 27]  # 14 incomplete: written at the flush
    assert records[0]["evidence"][3]["arrive_ms"] is None


def test_a_read_is_due_for_steps_not_yet_taken_in(fr: FakeFr) -> None:
    marks = marks_at(1000.0, 1100.0)
    collector = EvidenceCollector(marks, read_fr=True)
    collector.poll(force=True)  # reads, and closes every step that ended before it
    assert collector.next_read_at() == math.inf  # nothing ended since
    marks.marks.append((2, int(1200.0 * MS), int(4 * MS)))  # a step the thread ended
    assert collector.next_read_at() < math.inf  # due: the round loop must wake for it
    assert not EvidenceCollector(marks, read_fr=False).next_read_at() < math.inf


class CostlyReads(FakeFr):
    """Reads that wait (sleep: wall time, no CPU) or work (spin: the thread's CPU)."""

    def __init__(self, costs: list[str]) -> None:
        super().__init__()
        self.costs = costs

    def __call__(self, limit: int = 0, after: dict[str, int] | None = None) -> tuple[FrEntry, ...]:
        cost = self.costs.pop(0) if self.costs else "fast"
        if cost == "wait":  # preempted, or waiting for the GIL: costs training nothing
            time.sleep(0.03)
        elif cost == "work":
            until = time.thread_time() + 0.025
            while time.thread_time() < until:
                pass
        return tuple(self.entries)


def reads_after(monkeypatch: pytest.MonkeyPatch, costs: list[str]) -> EvidenceCollector:
    monkeypatch.setattr(evidence_module, "read_entries", CostlyReads(costs))
    marks = EvidenceMarks()
    collector = EvidenceCollector(marks, read_fr=True)
    for step in range(len(costs) + 1):  # step 0 has no start: nothing to read for
        marks.marks.append((step, int((1000.0 + step) * MS), int(step * MS)))
        collector.poll(force=True)
    return collector


def test_reads_slow_by_the_wall_clock_alone_keep_arrival_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    collector = reads_after(monkeypatch, ["wait"] * 5)
    assert collector.reads == 5 and collector.read_ms >= 5 * 25
    assert collector.reading_flight_recorder


def test_only_reads_costly_in_cpu_several_times_in_a_row_switch_arrival_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spread = reads_after(monkeypatch, ["work", "work", "fast", "work", "work", "fast"])
    assert spread.reading_flight_recorder  # four costly reads, never three in a row
    in_a_row = ["fast", *["work"] * evidence_module.SLOW_READS_IN_A_ROW, "fast", "fast"]
    collector = reads_after(monkeypatch, in_a_row)
    assert not collector.reading_flight_recorder
    assert collector.reads == 1 + evidence_module.SLOW_READS_IN_A_ROW  # none after


def test_add_gc_many_is_add_gc_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same GC times kept, oldest dropped first, repeats and all."""
    monkeypatch.setattr(evidence_module, "MAX_PENDING_STEPS", 5)
    one = EvidenceCollector(EvidenceMarks(), read_fr=False)
    many = EvidenceCollector(EvidenceMarks(), read_fr=False)
    steps = [(1, 0.5), (2, 0.0), (3, 1.5), (2, 2.0), (4, 0.1), (5, 0.2), (6, 0.3), (1, 9.0)]
    for step, gc_ms in steps:
        one.add_gc(step, gc_ms)
    many.add_gc_many(steps)
    assert list(many._gc.items()) == list(one._gc.items())


def test_journal_takes_a_rounds_times_in_one_call_as_step_by_step(tmp_path: Path) -> None:
    """`add_times_many` (a round's steps at once) leaves the journal as `add_times` per
    step does: same records written, same straggler scores, same steps still waiting."""
    outcomes = []
    for batched in (False, True):
        run = RunDir(tmp_path / str(batched))
        run.path.mkdir()
        journal = AnomalyJournal(3, AnomalyWriter(run))
        for first in range(1, 60, 10):  # rounds of 10 steps; evidence lags one round
            steps = [(s, (40.0 + (200.0 if s % 17 == 0 else 0.0), 40.0, 41.0))
                     for s in range(first, first + 10)]  # fmt: skip
            journal.add_judgments([judgment(s) for s, _ in steps if s % 17 == 0])
            if batched:
                journal.add_times_many(steps)
            else:
                for step, times in steps:
                    journal.add_times(step, times)
            lagging = range(max(1, first - 10), first)
            journal.add_evidence(
                EvidenceBlock.from_items(
                    3,
                    [
                        (r, s, StepEvidence(10.0 + (30.0 if r == 2 else 0.0), 1, 1.0, 0.0))
                        for r in range(3)
                        for s in lagging
                    ],
                )
            )
        outcomes.append(
            (
                [(r.step, r.durations_ms) for r in read_anomalies(run)],
                journal.scorer.steps,
                [s.rank for s in journal.scorer.stragglers()],
                sorted(journal._times),
            )
        )
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] and outcomes[0][1] > 0  # records were written, steps scored


def _journal_outcome(tmp_path: Path, world: int, seed: int, lockstep: bool) -> tuple[object, ...]:
    """A random run of rounds through one journal: evidence early, late, in lockstep or
    not, repeated steps, unknown times and arrivals, judged steps."""
    import random

    rng = random.Random(seed)
    run = RunDir(tmp_path / f"{world}-{seed}-{lockstep}")
    run.path.mkdir()
    journal = AnomalyJournal(world, AnomalyWriter(run))
    if not lockstep:
        journal._add_lockstep = lambda block: False  # type: ignore[method-assign]
    sent = [1] * world  # per rank, the next step whose evidence it sends
    timed = 1
    for _ in range(40):
        n = rng.randint(1, 12)
        steps = []
        for step in range(timed, timed + n):
            times = tuple(
                math.nan if rng.random() < 0.05 else 40.0 + rng.random() * 5 for _ in range(world)
            )
            steps.append((step, times))
        journal.add_judgments([judgment(s) for s, _ in steps if rng.random() < 0.15])
        journal.add_times_many(steps)
        timed += n
        items = []
        together = rng.random() < 0.7  # every rank sends the same steps
        count = rng.randint(0, 14)
        if together:  # lagging ranks skip steps (a gap), or all repeat steps sent before
            back = 2 if rng.random() < 0.1 else 0
            sent = [max(1, max(sent) - back)] * world
        for rank in range(world):
            k = count if together else rng.randint(0, 14)
            if not together and rng.random() < 0.05:
                sent[rank] = max(1, sent[rank] - 2)  # a repeat of steps sent before
            for step in range(sent[rank], sent[rank] + k):
                arrive = math.nan if rng.random() < 0.1 else 10.0 + rng.random() * 20
                items.append((rank, step, StepEvidence(arrive, 1, 1.0 + rank, 0.1, 40.0)))
            sent[rank] += k
        journal.add_evidence(EvidenceBlock.from_items(world, items, lists=True))
    medians = journal._medians()
    pending = sorted(journal._pending)
    journal.flush()
    return (
        [record.to_json() for record in read_anomalies(run)],
        journal.scorer.to_json(),
        repr(vars(journal.scorer)),
        list(journal.scorer._first_ms),
        list(journal.scorer._last_ms),
        repr(medians),
        sorted(journal._rows),
        {s: (r.filled, repr(r.values)) for s, r in journal._rows.items()},
        sorted(journal._times),
        pending,
    )


def journal_steps(outcome: tuple[object, ...]) -> int:
    scores = outcome[1]
    assert isinstance(scores, dict)
    return int(scores["scored_steps"])


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_journal_lockstep_path_is_the_step_by_step_one(
    tmp_path: Path, world: int, seed: int
) -> None:
    """Blocks where every rank sent the same steps complete without a row per step kept:
    the same records, scores, medians and steps still waiting as the general path."""
    fast = _journal_outcome(tmp_path, world, seed, lockstep=True)
    general = _journal_outcome(tmp_path, world, seed, lockstep=False)
    assert fast == general
    assert fast[0] and journal_steps(fast) > 0  # records written, steps scored


@pytest.mark.parametrize("seed", range(8))
def test_unread_marks_make_the_evidence_the_open_steps_did(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Without Flight Recorder reads, consecutive marks become evidence without an open
    step each: the same evidence, GC times left and last mark as the general path, for
    consecutive marks, gaps, repeats and restarts."""
    import random

    monkeypatch.setattr(evidence_module, "MAX_PENDING_STEPS", 40)
    rng = random.Random(seed)
    polls: list[list[tuple[int, int, int]]] = []
    step, ns = rng.randint(0, 3), 0
    for _ in range(30):
        batch = []
        for _ in range(rng.choice([0, 1, 5, 12, 45])):
            roll = rng.random()
            step = 0 if roll < 0.02 else step - 1 if roll < 0.05 else step + 1 + (roll < 0.1)
            ns += rng.randint(1, 10**7)
            batch.append((step, ns, ns // 3 + rng.randint(0, 10**5)))
        polls.append(batch)
    outcomes = []
    for general in (False, True):
        marks = EvidenceMarks()
        collector = EvidenceCollector(marks, read_fr=False)
        if general:
            monkeypatch.setattr(collector, "_unread_evidence", lambda taken: None)
        got = []
        for batch in polls:
            marks.marks.extend(batch)
            collector.add_gc_many((s, 0.25 * s) for s, _, _ in batch if s % 3)
            got.append(collector.poll())
        outcomes.append((got, dict(collector._gc), collector._last_mark, dict(collector._open)))
    assert outcomes[0] == outcomes[1]
    assert sum(len(g) for g in outcomes[0][0]) > 50


def test_step_evidence_of_values_is_the_constructed_evidence() -> None:
    made = StepEvidence.of_values(math.nan, -1, 1.5, 0.25, 3.0)
    built = StepEvidence(cpu_ms=1.5, gc_ms=0.25, host_ms=3.0)
    assert made == built and hash(made) == hash(built) and repr(made) == repr(built)
    assert vars(made) == vars(built) and made.as_fields()[1:] == built.as_fields()[1:]
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.cpu_ms = 2.0  # type: ignore[misc]


def test_stragglers_json_is_rewritten_when_the_scores_change_not_per_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round that only scores more steps (no straggler, no drift) writes nothing; the
    end writes the final body."""
    from distanom.anomaly_journal import AnomalyJournal
    from distanom.evidence import EvidenceMarks, EvidenceTier
    from distanom.health import Health

    written: list[dict[str, object]] = []
    monkeypatch.setattr(
        evidence_module, "write_stragglers", lambda run, body, final: written.append(body)
    )
    tier = EvidenceTier(EvidenceMarks(), 2, Health())
    tier.journal = AnomalyJournal(2, None)
    run = object()
    for step in range(1, 40):
        tier.journal.scorer.add_late(step, (), 10.0)
        tier.write_stragglers(run)  # type: ignore[arg-type]
    assert len(written) == 1
    tier.write_stragglers(run, final=True)  # type: ignore[arg-type]
    assert len(written) == 2 and written[-1]["scored_steps"] == 39


def test_one_rank_never_reads_flight_recorder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrival is only compared between ranks: with one rank the tier never dumps Flight
    Recorder (a read holds the GIL for milliseconds), while two ranks do."""
    from distanom.evidence import EvidenceMarks, EvidenceTier
    from distanom.health import Health

    monkeypatch.setattr(evidence_module, "buffer_size", lambda: 256)
    reads: list[int] = []
    monkeypatch.setattr(evidence_module, "read_entries", lambda *a, **k: reads.append(1) or ())
    for world_size, expected in ((1, False), (2, True)):
        marks = EvidenceMarks()
        tier = EvidenceTier(marks, world_size, Health())
        assert tier.collector.reading_flight_recorder is expected
        for step in range(4):
            marks.mark(step, 1_000_000 * (step + 1))
        done = tier.poll(final=True)
        assert [step for step, _ in done] == [1, 2, 3]
    assert len(reads) == 1  # the two-rank tier's forced read only
