"""A verdict for every anomalous step, from arrival and host evidence or from a trace."""

from __future__ import annotations

import math
from pathlib import Path

from distanom.analysis.anomalies import CapturedAnomaly, TraceVerdict, anomalies_of, judge
from distanom.live import render_status
from distanom.records.anomalies import AnomalyRecord, AnomalyWriter, StepEvidence, read_anomalies
from distanom.rundir import RunDir

NAN = math.nan


def record(
    evidence: list[StepEvidence], durations: tuple[float, ...] = (), **kw: object
) -> AnomalyRecord:
    n = len(evidence)
    base = dict(
        step=40, step_ms=315.0, median_ms=15.0, threshold_ms=22.5, traced=False,
        judged_by="condition", slowest_rank=0, durations_ms=durations or (315.0,) * n,
        evidence=tuple(evidence), arrive_median_ms=(10.0,) * n, cpu_median_ms=(1.0,) * n,
    )  # fmt: skip
    base.update(kw)
    return AnomalyRecord(**base)  # type: ignore[arg-type]


def test_the_late_rank_is_the_culprit_and_sleeping_is_a_host_stall() -> None:
    ev = [
        StepEvidence(10.5, 1, 1.0, 0.0),
        StepEvidence(10.7, 1, 1.1, 0.0),
        StepEvidence(310.0, 1, 1.2, 0.0),
    ]
    verdict = judge(record(ev))
    assert (verdict.culprit_rank, verdict.cause, verdict.source) == (2, "host_stall", "arrival")
    assert "rank 2 reached the step's last collective" in verdict.evidence


def test_ranks_late_together_have_no_culprit_and_share_a_cause() -> None:
    # every rank slept ~300 ms before the collective (a stall in the data loader, a
    # checkpoint on every rank): blaming the one that happened to arrive last is wrong
    ev = [StepEvidence(310.0, 1, 1.0, 0.0), StepEvidence(310.2, 1, 1.1, 0.0)]
    verdict = judge(record(ev))
    assert (verdict.culprit_rank, verdict.cause, verdict.source) == (None, "host_stall", "arrival")
    assert verdict.evidence.startswith("every rank reached the step's last collective")
    assert verdict.details["late_ranks"] == [0, 1]
    # two of four late together, the others on time: those two, no single culprit
    ev4 = [
        StepEvidence(10.2, 1, 1.0, 0.0),
        StepEvidence(305.0, 1, 280.0, 0.0),
        StepEvidence(10.1, 1, 1.0, 0.0),
        StepEvidence(309.0, 1, 290.0, 0.0),
    ]
    verdict = judge(record(ev4))
    assert (verdict.culprit_rank, verdict.cause) == (None, "host_busy")
    assert verdict.evidence.startswith("ranks 1, 3 reached")
    # one rank clearly later than another late one: that one is still the culprit
    ev = [StepEvidence(120.0, 1, 1.0, 0.0), StepEvidence(310.0, 1, 1.0, 0.0)]
    assert judge(record(ev)).culprit_rank == 1
    # a straggler that set the step's time, another rank with a smaller hiccup: the
    # straggler (half the slowdown is not "as late")
    ev = [StepEvidence(170.0, 1, 1.0, 0.0), StepEvidence(310.0, 1, 1.0, 0.0)]
    assert judge(record(ev)).culprit_rank == 1
    # all late because they waited on one rank's GC pause earlier in the step: the GC
    # pause names the cause, not the plain lateness of the others
    ev8 = [StepEvidence(310.0, 1, 1.0, 0.0) for _ in range(8)]
    ev8[5] = StepEvidence(309.0, 1, 1.0, 290.0)
    verdict = judge(record(ev8))
    assert (verdict.culprit_rank, verdict.cause) == (None, "python_gc")
    assert "on rank 5, a Python GC pause of 290.0 ms" in verdict.evidence
    # ranks that sent no arrival are not claimed as late
    ev = [StepEvidence(310.0, 1, 1.0, 0.0), StepEvidence(310.2, 1, 1.0, 0.0)]
    ev += [StepEvidence(NAN, 0, 1.0, 0.0), StepEvidence(NAN, 0, 1.0, 0.0)]
    verdict = judge(record(ev))
    assert verdict.culprit_rank is None and verdict.evidence.startswith("ranks 0, 1 reached")


def test_cpu_time_and_gc_name_the_cause() -> None:
    busy = [StepEvidence(10.0, 1, 1.0, 0.0), StepEvidence(300.0, 1, 280.0, 0.0)]
    assert judge(record(busy)).cause == "host_busy"
    gc = [StepEvidence(10.0, 1, 1.0, 0.0), StepEvidence(300.0, 1, 200.0, 250.0)]
    assert judge(record(gc)).cause == "python_gc"


def test_all_on_time_means_the_collective_or_device() -> None:
    ev = [StepEvidence(10.0, 1, 1.0, 0.0), StepEvidence(10.4, 1, 1.0, 0.0)]
    verdict = judge(record(ev))
    assert verdict.culprit_rank is None and verdict.cause == "slow_collective"


def test_without_arrival_the_longest_duration_leads() -> None:
    ev = [StepEvidence(NAN, 0, 1.0, 0.0), StepEvidence(NAN, 0, 1.0, 0.0)]
    verdict = judge(record(ev, durations=(15.0, 315.0)))
    assert (verdict.culprit_rank, verdict.source) == (1, "durations")
    assert judge(record(ev)).cause == "unknown"


def test_a_lone_ranks_lead_is_over_the_median_not_over_a_next_rank() -> None:
    alone = judge(record([StepEvidence(NAN, 0, 1.0, 0.0, 312.0)], durations=(315.0,)))
    assert alone.evidence.startswith("rank 0's step took 300.0 ms longer than the median; ")
    # two ranks, only one timed: said so
    ev = [StepEvidence(NAN, 0, 1.0, 0.0), StepEvidence(NAN, 0, 1.0, 0.0)]
    one_timed = judge(record(ev, durations=(NAN, 315.0)))
    assert one_timed.evidence.startswith(
        "rank 1's step took 300.0 ms longer than the median (no other rank's time recorded); "
    )
    two_timed = judge(record(ev, durations=(15.0, 315.0)))
    assert two_timed.evidence.startswith("rank 1's step took 300.0 ms longer than the next rank's")


def test_a_step_longer_on_the_gpu_than_on_the_host_is_gpu_work() -> None:
    # one GPU rank, no collectives: 315 ms by its CUDA events, its host through the step
    # in 16 ms (the launches went on; the device ran long): the device's work grew
    device = [StepEvidence(NAN, 0, 1.0, 0.0, 16.0)]
    verdict = judge(record(device, durations=(315.0,)))
    assert (verdict.culprit_rank, verdict.cause, verdict.source) == (0, "gpu_work", "durations")
    assert "315.0 ms" in verdict.evidence and "16.0 ms" in verdict.evidence
    # the host as late as the GPU (a sleep, or a wait on the device): a host cause
    assert judge(record([StepEvidence(NAN, 0, 1.0, 0.0, 312.0)])).cause == "host_stall"
    # the host clock measures the host itself: never gpu_work
    assert judge(record([StepEvidence(NAN, 0, 290.0, 0.0, 315.0)])).cause == "host_busy"
    # the host's time unknown (a record from before host_ms): as before
    assert judge(record([StepEvidence(NAN, 0, 1.0, 0.0)])).cause == "host_stall"
    # host clock: a GC pause between the boundary's two clock reads is in the step's
    # duration, not in host_ms; the GC explains it, not the device
    gc_between = [StepEvidence(NAN, 0, 1.0, 250.0, 60.0)]
    assert judge(record(gc_between, durations=(315.0,))).cause == "python_gc"
    # a wall clock stepped back (host_ms <= 0) says nothing about the device
    assert judge(record([StepEvidence(NAN, 0, 1.0, 0.0, -5.0)])).cause == "host_stall"


def test_no_evidence_is_no_cause_and_does_not_override_a_trace() -> None:
    nothing = record([StepEvidence()], durations=(315.0,), step=205, traced=True)
    assert judge(nothing).cause == "unknown"
    unknown = {205: TraceVerdict(None, "unknown", "no part of rank 0's time grew")}
    (anomaly,) = anomalies_of([nothing], unknown)
    assert (anomaly.verdict.cause, anomaly.verdict.source) == ("unknown", "trace")
    # late at a collective with its CPU time unknown: still the host
    late = [StepEvidence(10.0, 1, 1.0, 0.0), StepEvidence(300.0, 1, NAN, NAN)]
    assert judge(record(late)).cause == "host_stall"


def test_host_time_travels_through_the_round_and_the_record() -> None:
    from distanom.consensus import EvidenceBlock

    ev = StepEvidence(3.0, 2, 1.5, 0.25, 17.5)
    assert StepEvidence.from_fields(ev.as_fields()) == ev
    assert StepEvidence.from_json(ev.to_json()) == ev
    for lists in (True, False):
        block = EvidenceBlock.from_items(2, [(1, 7, ev), (1, 8, StepEvidence())], lists=lists)
        items = block.items()
        assert items[0] == (1, 7, ev)
        assert items[1][:2] == (1, 8) and math.isnan(items[1][2].host_ms)


def test_a_trace_that_explains_nothing_yields_to_evidence_that_does() -> None:
    stalled = record([StepEvidence(NAN, 0, 1.0, 0.0, 312.0)], step=205, traced=True)
    unknown = {205: TraceVerdict(None, "unknown", "no part of rank 0's time grew")}
    (anomaly,) = anomalies_of([stalled], unknown)
    verdict = anomaly.verdict
    assert (verdict.cause, verdict.source, verdict.culprit_rank) == ("host_stall", "durations", 0)
    assert verdict.details["trace_verdict"]["cause"] == "unknown" and anomaly.traced
    # neither explains it: the trace's verdict stands
    blind = record([StepEvidence(NAN, 0, 1.0, 0.0, 312.0)] * 2, step=205, traced=True)
    (anomaly,) = anomalies_of([blind], unknown)
    assert (anomaly.verdict.cause, anomaly.verdict.source) == ("unknown", "trace")


def test_a_trace_verdict_wins_and_old_runs_list_captured_anomalies(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    writer = AnomalyWriter(run)
    ev = [StepEvidence(10.0, 1, 1.0, 0.0), StepEvidence(300.0, 1, 1.0, 0.0)]
    writer.write(record(ev))
    writer.write(record(ev, step=50, traced=True))
    writer.close()
    (run.path / "anomalies.jsonl").open("a").write('{"torn": ')
    records = read_anomalies(run)
    assert [r.step for r in records] == [40, 50]
    traced = {
        50: TraceVerdict(0, "compute", "rank 0 computed longer"),
        70: TraceVerdict(1, "idle", "x"),
    }
    out = anomalies_of(records, traced, [CapturedAnomaly(70, 30.0, 15.0)])
    assert [(a.step, a.verdict.source, a.verdict.culprit_rank) for a in out] == [
        (40, "arrival", 1), (50, "trace", 0), (70, "trace", 1)
    ]  # fmt: skip
    assert out[1].verdict.details["evidence_verdict"]["culprit_rank"] == 1
    assert out[2].judged_by == "unrecorded" and out[2].as_json()["ratio"] == 2.0


def test_status_shows_stragglers_and_drift(tmp_path: Path) -> None:
    status = {
        "state": "finished",
        "stragglers": {
            "stragglers": [{"rank": 3, "score": 0.4, "since_step": 40,
                            "evidence": {"late_steps": 60, "window_steps": 64}}],
            "drift": {"first_ms": 10.0, "last_ms": 20.0, "ratio": 2.0},
        },
    }  # fmt: skip
    text = render_status(RunDir(tmp_path), status)
    assert "straggler: rank 3 since step 40" in text and "40%" in text
    assert "drift: median step 10.0 ms -> 20.0 ms" in text


def test_status_counts_the_trace_files_kept(tmp_path: Path) -> None:
    status = {"state": "running", "captures": {"written": 5, "replaced": 2, "bytes": 21_000}}
    text = render_status(RunDir(tmp_path), status)
    assert "trace files kept: 5 on rank 0 (0.0 MB, 2 replaced)" in text
    status["captures"] = {"written": 3, "bytes": 2_500_000}  # a status from before `replaced`
    assert "trace files kept: 3 on rank 0 (2.5 MB)" in render_status(RunDir(tmp_path), status)


def test_a_rank_slow_after_the_last_collective_is_the_culprit() -> None:
    # DDP: the gradients' all-reduce ends in backward; rank 1 then sleeps 300 ms before
    # optimizer.step(). Both reached the collective on time (arrivals are from each
    # rank's own step start), but only rank 1's step was slow: rank 1, a host stall
    ev = [StepEvidence(0.47, 1, 1.0, 0.0), StepEvidence(0.46, 1, 1.0, 0.0)]
    verdict = judge(record(ev, durations=(17.0, 315.0), arrive_median_ms=(0.5, 0.5)))
    assert (verdict.culprit_rank, verdict.cause, verdict.source) == (1, "host_stall", "arrival")
    assert "then rank 1's step took 298.0 ms longer than the others'" in verdict.evidence
    assert verdict.details["durations_ms"] == {"0": 17.0, "1": 315.0}
    # busy on the CPU after the collective (e.g. a checkpoint's serialization)
    busy = [StepEvidence(0.47, 1, 1.0, 0.0), StepEvidence(0.46, 1, 290.0, 0.0)]
    verdict = judge(record(busy, durations=(17.0, 315.0), arrive_median_ms=(0.5, 0.5)))
    assert (verdict.culprit_rank, verdict.cause) == (1, "host_busy")


def test_waiting_for_a_rank_that_began_the_step_late_names_that_rank() -> None:
    # the step after: rank 1 began it 300 ms late, rank 0 waited in its collective; rank
    # 0's step is the slow one, the culprit is rank 1 (its step before ended late)
    ev = [StepEvidence(0.48, 1, 1.0, 0.0), StepEvidence(1.1, 1, 1.0, 0.0)]
    before = record(ev, durations=(17.0, 315.0), arrive_median_ms=(0.5, 0.5))
    after = record(ev, step=41, durations=(315.0, 17.0), arrive_median_ms=(0.5, 0.5))
    verdict = judge(after, before)
    assert (verdict.culprit_rank, verdict.cause) == (1, "host_stall")
    assert "it waited there for rank 1, whose step 40 ended 300.0 ms late" in verdict.evidence
    assert verdict.details["waited_for_step"] == 40
    # without the step before, rank 0 itself is named: the rule needs that record
    assert judge(after).culprit_rank == 0
    # through anomalies_of, which hands each record the one before it
    verdicts = {a.step: a.verdict for a in anomalies_of([before, after])}
    assert (verdicts[40].culprit_rank, verdicts[41].culprit_rank) == (1, 1)
    # a step before where the slow rank was slow too is no excuse: rank 0 again
    both = record(ev, durations=(315.0, 315.0), arrive_median_ms=(0.5, 0.5))
    assert judge(after, both).culprit_rank == 0


def test_a_step_before_that_blamed_another_rank_is_not_cited_for_the_late_one() -> None:
    # step 40: rank 0 reached the collective 60 ms late (its verdict), and rank 1 then
    # ended the step 25 ms after rank 0; step 41: rank 0 waited for rank 1. The text
    # must not pin step 40's verdict ("host stall", of rank 0) on rank 1
    before = record(
        [StepEvidence(60.5, 1, 1.0, 0.0), StepEvidence(0.5, 1, 1.0, 0.0)],
        step_ms=100.0, durations=(75.0, 100.0), arrive_median_ms=(0.5, 0.5),
    )  # fmt: skip
    after = record(
        [StepEvidence(0.48, 1, 1.0, 0.0), StepEvidence(1.1, 1, 1.0, 0.0)],
        step=41, step_ms=40.0, durations=(40.0, 17.0), arrive_median_ms=(0.5, 0.5),
    )  # fmt: skip
    assert judge(before).culprit_rank == 0
    verdict = judge(after, before)
    assert verdict.culprit_rank == 1
    assert verdict.evidence.endswith(
        "whose step 40 ended 85.0 ms late (after that step's collective; step 40: rank 0 "
        "— host stall)"
    )


def test_equally_slow_after_the_collective_is_still_the_collective() -> None:
    # every rank's step as slow and every arrival on time: no rank stands out
    ev = [StepEvidence(0.47, 1, 1.0, 0.0), StepEvidence(0.46, 1, 1.0, 0.0)]
    verdict = judge(record(ev, durations=(300.0, 315.0), arrive_median_ms=(0.5, 0.5)))
    assert (verdict.culprit_rank, verdict.cause) == (None, "slow_collective")
