"""The phase of a verdict and the cause it makes more specific (`analysis.phases`,
`analysis.anomalies.with_phase`): each case is one a user met, where the evidence alone
named the right rank but no phase, or the wrong cause."""

from __future__ import annotations

import math

from distanom.analysis.anomalies import TraceVerdict, anomalies_of
from distanom.analysis.phases import PhaseTable, straggler_phase
from distanom.records.anomalies import AnomalyRecord, StepEvidence

NAN = math.nan
STEP = 100
# a healthy step: data 2, forward 3, backward 4 (+ tail 1), optimizer 1 ms; fetch 1.5
HOST = (2.0, 3.0, 4.0, 1.0, 1.0)
FETCH = 1.5


def table(
    slow_host: tuple[float, ...] | None = None,
    fetch: float = FETCH,
    gpu: tuple[float, ...] | None = None,
    slow_gpu: tuple[float, ...] | None = None,
    own_ms: float = 0.0,
) -> PhaseTable:
    """80 healthy steps before STEP, then STEP with the parts given."""
    healthy_gpu = gpu if gpu is not None else (NAN,) * 3
    rows = {s: (*HOST, FETCH, *healthy_gpu, 0.0) for s in range(20, STEP)}
    rows[STEP] = (*(slow_host or HOST), fetch, *(slow_gpu or healthy_gpu), own_ms)
    made = PhaseTable.of_rows(rows)
    assert made is not None
    return made


def record(cpu_ms: float, gc_ms: float = 0.0, step_ms: float = 111.0) -> AnomalyRecord:
    """Rank 1 reached the step's last collective 100 ms late; rank 0 on time."""
    evidence = (
        StepEvidence(5.0, 2, 8.0, 0.0, 11.0),
        StepEvidence(105.0, 2, cpu_ms, gc_ms, 111.0),
    )
    return AnomalyRecord(
        STEP, step_ms, 11.0, 16.5, False, "condition", 1, (step_ms, step_ms), evidence,
        (5.0, 5.0), (8.0, 8.0),
    )  # fmt: skip


def verdict_of(
    rec: AnomalyRecord, phases: dict[int, PhaseTable], trace: TraceVerdict | None = None
):  # type: ignore[no-untyped-def]
    traced = {STEP: trace} if trace is not None else None
    [anomaly] = anomalies_of([rec], traced, phases=phases)
    return anomaly.verdict


def test_a_stalled_batch_fetch_is_data_loading_in_the_data_phase() -> None:
    # off the CPU while waiting on a DataLoader worker: the evidence said host_stall
    phases = {1: table(slow_host=(102.0, 3.0, 4.0, 1.0, 1.0), fetch=101.5)}
    verdict = verdict_of(record(cpu_ms=8.0), phases)
    assert (verdict.culprit_rank, verdict.cause, verdict.phase) == (1, "data_loading", "data")
    assert "waited 101.5 ms for its next batch (usually 1.5 ms)" in verdict.evidence
    assert verdict.details["host_signals_cause"] == "host_stall"
    assert verdict.as_json()["phases_ms"]["data"] == 102.0
    assert verdict.as_json()["median_phases_ms"]["backward"] == 5.0  # tail folded in


def test_gpu_work_the_host_spin_waited_for_is_not_host_busy() -> None:
    # a GradScaler's inf check synchronizes after backward: the host spins (its CPU time
    # grows by the wait) while the GPU's backward took 100 ms more than usual
    gpu = (5.0, 4.0, 1.5)  # to the forward's end, backward, after the backward
    phases = {1: table(slow_host=(2.0, 3.0, 4.0, 101.0, 1.0), gpu=gpu, slow_gpu=(5.0, 104.0, 1.5))}
    verdict = verdict_of(record(cpu_ms=105.0), phases)
    assert (verdict.cause, verdict.phase) == ("gpu_work", "backward")
    assert "its GPU took 104.0 ms in its backward pass (usually 4.0)" in verdict.evidence
    assert verdict.details["host_signals_cause"] == "host_busy"


def test_a_busy_host_stays_host_busy_in_its_phase_when_the_gpu_only_waited() -> None:
    # Python busy in forward: the GPU's forward grows as much as the host's (it idles)
    gpu = (5.0, 4.0, 1.5)
    phases = {1: table(slow_host=(2.0, 103.0, 4.0, 1.0, 1.0), gpu=gpu, slow_gpu=(105.0, 4.0, 1.5))}
    verdict = verdict_of(record(cpu_ms=108.0), phases)
    assert (verdict.cause, verdict.phase) == ("host_busy", "forward")
    assert "its forward phase took 103.0 ms" in verdict.evidence


def test_a_stall_before_the_optimizer_step_is_a_host_stall_in_backward() -> None:
    phases = {1: table(slow_host=(2.0, 3.0, 4.0, 101.0, 1.0))}
    verdict = verdict_of(record(cpu_ms=8.0), phases)
    assert (verdict.cause, verdict.phase) == ("host_stall", "backward")
    assert "time between backward and the optimizer step" in verdict.evidence


def test_a_gc_pause_stays_python_gc_and_is_placed_in_its_phase() -> None:
    phases = {1: table(slow_host=(2.0, 3.0, 4.0, 1.0, 101.0), fetch=FETCH)}
    verdict = verdict_of(record(cpu_ms=108.0, gc_ms=95.0), phases)
    assert (verdict.cause, verdict.phase) == ("python_gc", "optimizer")


def test_evidence_that_names_the_cause_more_closely_wins_over_the_trace() -> None:
    # traced: the op inside the optimizer step grew ("compute"), but the thread was off
    # the CPU: a sleep, not more computation
    phases = {1: table(slow_host=(2.0, 3.0, 4.0, 1.0, 101.0))}
    trace = TraceVerdict(1, "compute", "rank 1: computation 101 ms vs 1 ms")
    verdict = verdict_of(record(cpu_ms=8.0), phases, trace)
    assert (verdict.cause, verdict.phase, verdict.source) == ("host_stall", "optimizer", "arrival")
    assert verdict.details["trace_verdict"]["cause"] == "compute"
    # a GC pause the trace read as a host stall
    trace = TraceVerdict(1, "host_stall", "rank 1: idle 100 ms")
    verdict = verdict_of(record(cpu_ms=108.0, gc_ms=95.0), phases, trace)
    assert verdict.cause == "python_gc"


def test_a_trace_verdict_that_agrees_keeps_its_words_and_gains_the_phase() -> None:
    phases = {1: table(slow_host=(2.0, 103.0, 4.0, 1.0, 1.0))}
    trace = TraceVerdict(1, "host_busy", "rank 1: the trace's words")
    verdict = verdict_of(record(cpu_ms=108.0), phases, trace)
    assert (verdict.source, verdict.evidence, verdict.phase) == (
        "trace",
        "rank 1: the trace's words",
        "forward",
    )


def test_a_straggler_slow_in_its_data_phase() -> None:
    slow = {s: (9.0, 3.0, 4.0, 1.0, 1.0, 8.5, *(NAN,) * 3, 0.0) for s in range(50, 90)}
    fast = {s: (*HOST, FETCH, *(NAN,) * 3, 0.0) for s in range(50, 90)}
    tables = {r: PhaseTable.of_rows(fast) for r in (0, 2)}
    tables[1] = PhaseTable.of_rows(slow)
    assert straggler_phase({r: t for r, t in tables.items() if t}, 1, 50, 89) == "data"
    assert straggler_phase({r: t for r, t in tables.items() if t}, 0, 50, 89) is None


def test_a_trace_blaming_another_rank_for_a_small_part_gives_way_to_the_evidence() -> None:
    # rank 1 slept 100 ms; the trace blamed rank 0 for arriving 10 ms last at a collective
    phases = {1: table(slow_host=(2.0, 3.0, 4.0, 101.0, 1.0))}
    small = TraceVerdict(0, "host_stall", "rank 0 arrived last, 10 ms after the first", 10.0)
    verdict = verdict_of(record(cpu_ms=8.0), phases, small)
    assert (verdict.culprit_rank, verdict.source) == (1, "arrival")
    assert verdict.details["trace_verdict"]["culprit_rank"] == 0
    # a trace that finds most of the slowdown on its culprit stands
    large = TraceVerdict(0, "host_stall", "rank 0: idle 95 ms", 95.0)
    assert verdict_of(record(cpu_ms=8.0), phases, large).culprit_rank == 0


def test_a_trace_calling_a_small_common_growth_global_gives_way_to_the_evidence() -> None:
    # CI, loaded 2-core host: rank 1 slept after its last collective; every traced
    # rank's idle grew a few ms, and a trace verdict read that as "every rank slowed"
    phases = {1: table(slow_host=(2.0, 3.0, 4.0, 101.0, 1.0))}
    small = TraceVerdict(None, "global", "all ranks: idle grew by 3-100 ms", 5.0)
    verdict = verdict_of(record(cpu_ms=8.0), phases, small)
    assert (verdict.culprit_rank, verdict.cause, verdict.phase) == (1, "host_stall", "backward")
    assert verdict.details["trace_verdict"]["cause"] == "global"
    # a global slowdown the traces find on every rank stands
    large = TraceVerdict(None, "global", "all ranks: idle grew by 95-100 ms", 97.0)
    assert verdict_of(record(cpu_ms=8.0), phases, large).cause == "global"


def test_a_knock_on_step_names_the_rank_whose_step_before_ran_long_on_four_ranks() -> None:
    """Rank 3 slept after step 110's collective; in step 111 ranks 0-2 waited in the
    collective for it (their steps long, its own not). Before, on more than two ranks,
    step 111 read `slow_collective` with no culprit."""

    def rec(step: int, durations: tuple[float, ...]) -> AnomalyRecord:
        evidence = tuple(StepEvidence(5.0, 2, 8.0, 0.0, d) for d in durations)
        return AnomalyRecord(
            step, max(durations), 11.0, 16.5, False, "condition", 0, durations, evidence,
            (5.0,) * 4, (8.0,) * 4,
        )  # fmt: skip

    late = rec(110, (12.0, 11.0, 12.0, 411.0))
    waited = rec(111, (409.0, 410.0, 408.0, 12.0))
    rows = {s: (*HOST, FETCH, *(NAN,) * 3, 0.0) for s in range(20, 110)}
    rows[110] = (2.0, 3.0, 4.0, 401.0, 1.0, FETCH, NAN, NAN, NAN, 0.0)
    phases = {3: PhaseTable.of_rows(rows)}  # type: ignore[dict-item]
    found = {a.step: a.verdict for a in anomalies_of([late, waited], phases=phases)}
    assert (found[110].culprit_rank, found[110].cause) == (3, "host_stall")
    knock = found[111]
    assert (knock.culprit_rank, knock.cause, knock.phase) == (3, "host_stall", "backward")
    assert knock.details["knock_on_of"] == 110
    assert "waited in it at least 397.0 ms for rank 3"  # 408 - the median in knock.evidence


def test_the_time_lost_is_grouped_by_culprit_cause_and_phase_largest_first() -> None:
    from distanom.analysis.anomalies import Anomaly, AnomalyVerdict
    from distanom.analysis.lost_time import lost_time

    def anomaly(step: int, ms: float, rank: int, cause: str, phase: str, **details: int):  # type: ignore[no-untyped-def]
        verdict = AnomalyVerdict(rank, cause, "", "arrival", dict(details), phase)
        return Anomaly(step, ms, 10.0, ms / 10, False, "condition", verdict)

    found = lost_time(
        [
            anomaly(60, 510.0, 1, "data_loading", "data"),
            anomaly(110, 310.0, 3, "host_stall", "backward"),
            anomaly(111, 300.0, 3, "host_stall", "backward", knock_on_of=110),
            anomaly(200, 9.0, 0, "host_busy", "forward"),  # under the median: nothing lost
        ],
        run_ms=10_000.0,
    )
    assert [(s.culprit_rank, s.cause, s.episodes) for s in found.shares] == [
        (3, "host_stall", 1),
        (1, "data_loading", 1),
    ]
    assert found.lost_ms == 590.0 + 500.0 and found.pct == 10.9
    assert found.line().startswith(
        "lost 1.1 s (10.9% of the run's step time) to slow steps: 590 ms rank 3 — host stall "
        "(backward) in 2 steps, 1 episode; 500 ms rank 1 — data loading (data) in 1 step"
    )


def test_a_gc_pause_during_distanoms_own_capture_work_is_named_distanom() -> None:
    # the step's GC ran while distanom decoded and wrote a trace (self_ms 56.9 ms)
    phases = {1: table(slow_host=(2.0, 3.0, 4.0, 1.0, 101.0), own_ms=56.9)}
    verdict = verdict_of(record(cpu_ms=108.0, gc_ms=95.0), phases)
    assert (verdict.culprit_rank, verdict.cause) == (1, "distanom")
    assert "distanom's own work (capture, consensus rounds) took 56.9 ms" in verdict.evidence
    assert verdict.as_json()["distanom_ms"] == 56.9
    # the script's own long collection beside a few ms of distanom's work (a status write
    # charged to the step): the script's (the e2e gc fault read distanom this way)
    phases = {1: table(slow_host=(2.0, 3.0, 4.0, 1.0, 101.0), own_ms=7.3)}
    verdict = verdict_of(record(cpu_ms=108.0, gc_ms=95.0), phases)
    assert (verdict.culprit_rank, verdict.cause) == (1, "python_gc"), verdict.evidence


def test_a_stall_while_distanoms_round_work_held_the_step_is_named_distanom() -> None:
    # no GC: the training thread was off the CPU for 100 ms while a heavy consensus
    # round (charged to the step in `self_ms`, as capture work is) ran for 70 ms
    phases = {1: table(slow_host=(2.0, 3.0, 4.0, 1.0, 101.0), own_ms=70.0)}
    verdict = verdict_of(record(cpu_ms=8.0), phases)
    assert (verdict.culprit_rank, verdict.cause) == (1, "distanom"), verdict.evidence
    assert "distanom's own work (capture, consensus rounds) took 70.0 ms" in verdict.evidence
    assert verdict.as_json()["distanom_ms"] == 70.0
    # a little of its own work in a step the script stalled: the script's stall
    phases = {1: table(slow_host=(2.0, 3.0, 4.0, 1.0, 101.0), own_ms=20.0)}
    verdict = verdict_of(record(cpu_ms=8.0), phases)
    assert (verdict.culprit_rank, verdict.cause) == (1, "host_stall")


def test_a_culprit_less_trace_verdict_explains_its_ranks_median_growth() -> None:
    from distanom.analysis.build import _explained_ms

    arrival = {"latest_rank": 2, "wait_ms": 40.0}
    # global / communication: the ranks' median growth (`slowdown_ms`) is what it explains
    assert _explained_ms({"slowdown_ms": 6.5, "arrival": arrival}, None) == 6.5
    # a culprit: its own extra time, or the wait it caused arriving last
    assert _explained_ms({"extra_own_ms": 3.0, "arrival": arrival}, 2) == 40.0
    assert math.isnan(_explained_ms({"slowdown_ms": 6.5}, 1))  # not said
