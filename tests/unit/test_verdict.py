"""The cross-rank verdict: synthetic evidence and synthetic traces with known answers."""

from __future__ import annotations

import pytest

from distanom.analysis.collectives import MatchedCollective
from distanom.analysis.crossrank import verdict_of_documents
from distanom.analysis.verdict import (
    CAUSES,
    Breakdown,
    RankEvidence,
    Verdict,
    arrival_order,
    decide,
    note_python_gc,
    rank_list,
)
from tests.unit.stepgen import MATMUL, cpu_job, gpu_job


def ev(
    rank: int,
    comp: float,
    comm: float,
    idle: float = 0.5,
    memcpy: float = 0.0,
    *,
    host: str | None = "h0",
    outside: float = 0.0,
) -> RankEvidence:
    total = comp + comm + idle + memcpy
    return RankEvidence(rank, host, Breakdown(comp, comm, memcpy, idle, total, outside))


def healthy(world: int, hosts: list[str] | None = None) -> list[RankEvidence]:
    return [ev(r, 5.2, 1.0, host=(hosts[r] if hosts else "h0")) for r in range(world)]


# --------------------------------------------------------------------------- evidence


def test_extra_compute_on_one_rank_names_it_with_numbers() -> None:
    ranks = [ev(r, 5.2, 16.9 + 0.02 * r) for r in range(8) if r != 3] + [ev(3, 22.1, 0.1)]
    verdict = decide(ranks, reference=healthy(8), reference_step=20, expected_ms=6.7, step_ms=22.7)
    assert (verdict.culprit_rank, verdict.cause, verdict.culprit_node) == (3, "compute", None)
    assert verdict.evidence.startswith(
        "rank 3: computation 22.1 ms vs 5.20 ms median of the others"
    )
    assert "5.20 ms in reference step 20" in verdict.evidence
    assert "ranks 0-2,4-7: exposed comm 16.9-17.0 ms" in verdict.evidence
    assert verdict.details["culprit_ranks"] == [3]
    assert verdict.as_json()["cause"] == "compute"
    assert verdict.sentence().startswith("rank 3 — compute: rank 3: computation")


def test_host_gap_on_one_rank_is_a_host_stall() -> None:
    ranks = [ev(0, 5.0, 20.0), ev(1, 5.1, 0.3, idle=20.4), ev(2, 5.0, 20.1), ev(3, 4.9, 19.8)]
    verdict = decide(ranks, expected_ms=7.0, step_ms=26.0)
    assert (verdict.culprit_rank, verdict.cause) == (1, "host_stall")
    assert "idle 20.4 ms" in verdict.evidence


def test_exposed_memcpy_on_one_rank_is_memcpy() -> None:
    ranks = [ev(0, 5.0, 12.0), ev(1, 5.0, 0.2, memcpy=12.0), ev(2, 5.0, 12.1)]
    verdict = decide(ranks, expected_ms=7.0, step_ms=18.0)
    assert (verdict.culprit_rank, verdict.cause) == (1, "memcpy")


def test_every_rank_slower_in_idle_is_global() -> None:
    now = [ev(r, 5.2, 1.0, idle=300.0 + r) for r in range(4)]
    verdict = decide(now, reference=healthy(4), reference_step=60)
    assert (verdict.culprit_rank, verdict.culprit_node, verdict.cause) == (None, None, "global")
    assert "idle grew over reference step 60" in verdict.evidence
    assert verdict.details["global_part"] == "host_stall"


def test_global_without_reference_uses_the_detectors_median() -> None:
    now = [ev(r, 5.2, 1.0, idle=300.0 + r) for r in range(4)]
    verdict = decide(now, step_ms=308.0, expected_ms=7.0)
    assert (verdict.culprit_rank, verdict.cause) == (None, "global")
    assert verdict.details["baseline"] == "the detector's rolling median at this step"


def test_every_rank_waiting_longer_in_the_collective_is_communication() -> None:
    now = [ev(r, 5.2, 40.0 + r) for r in range(4)]
    verdict = decide(now, reference=healthy(4), reference_step=60)
    assert (verdict.culprit_rank, verdict.cause) == (None, "communication")
    assert "exposed comm grew over reference step 60 by 39.0-42.0 ms" in verdict.evidence


def test_growth_that_spans_negative_values_is_a_signed_change() -> None:
    before = [ev(r, 5.0, 2.0, idle=2.0) for r in range(4)]
    # own time shrank on some ranks and grew on others; nobody stands out
    now = [ev(0, 3.5, 8.5, idle=2.0), ev(1, 5.0, 6.0, idle=2.9), ev(2, 4.0, 8.0, idle=2.0)]
    now.append(ev(3, 5.0, 2.0, idle=2.0))
    verdict = decide(now, reference=before, reference_step=20)
    assert (verdict.culprit_rank, verdict.cause) == (None, "unknown")
    assert "own time changed over reference step 20 by -1.50 to +0.90 ms" in verdict.evidence
    # none shrank: exposed comm still "grew", unsigned
    assert "exposed comm grew over reference step 20 by 0.00-6.50 ms" in verdict.evidence


def test_rounding_noise_below_zero_still_reads_as_growth() -> None:
    from distanom.analysis.text import change as _change

    # a sum that did not change can come out a hair below zero
    assert _change([-1e-9, 3.0], "reference step 20") == (
        "grew over reference step 20 by 0.00-3.00 ms"
    )
    assert _change([-0.004, -0.003], "reference step 20").startswith("grew")
    assert _change([-0.01, 3.0], "reference step 20").startswith("changed")


def test_idle_outside_the_ops_is_named_in_the_verdict() -> None:
    """The timeline's idle row excludes the stall before the first op (CPU traces); the
    verdict's idle includes it, so it says how much, to match the report's table."""
    ranks = [ev(r, 5.0, 20.0, idle=0.3, outside=0.1) for r in (0, 2, 3)]
    ranks.append(ev(1, 5.1, 0.3, idle=0.5, outside=19.9))
    verdict = decide(ranks, expected_ms=7.0, step_ms=26.0)
    assert (verdict.culprit_rank, verdict.cause) == (1, "host_stall")
    assert verdict.evidence.startswith(
        "rank 1: idle 20.4 ms (incl. 19.9 ms outside its ops) vs 0.40 ms median of the others"
    )
    inside = decide([ev(r, 5.0, 20.0) for r in (0, 2, 3)] + [ev(1, 5.1, 0.3, idle=20.4)])
    assert "outside" not in inside.evidence


def test_two_slow_ranks_making_up_one_node_name_the_node() -> None:
    hosts = ["a", "a", "b", "b"]
    now = [ev(0, 5.0, 20.0, host="a"), ev(1, 5.0, 20.2, host="a")]
    now += [ev(2, 24.0, 1.0, host="b"), ev(3, 25.0, 0.1, host="b")]
    verdict = decide(now, reference=healthy(4, hosts), step_ms=26.0, expected_ms=7.0)
    assert verdict.culprit_node == "b" and verdict.culprit_rank == 3
    assert verdict.cause == "compute"
    assert verdict.evidence.startswith("ranks 2-3 (all of node b): computation 24.0-25.0 ms")
    assert verdict.sentence().startswith("node b (ranks 2-3) — compute: ranks 2-3")


def test_one_slow_rank_of_a_two_rank_node_is_not_the_node() -> None:
    now = [ev(0, 5.0, 20.0, host="a"), ev(1, 5.0, 20.2, host="a")]
    now += [ev(2, 5.0, 20.1, host="b"), ev(3, 25.0, 0.1, host="b")]
    verdict = decide(now, step_ms=26.0, expected_ms=7.0)
    assert (verdict.culprit_rank, verdict.culprit_node) == (3, None)
    assert verdict.details["culprit_host"] == "b"


def test_a_step_that_is_not_slow_gets_no_culprit() -> None:
    now = [ev(0, 5.0, 1.0), ev(1, 9.0, 0.1)]
    verdict = decide(now, step_ms=10.0, expected_ms=9.5)
    assert (verdict.culprit_rank, verdict.cause) == (None, "unknown")
    assert verdict.evidence.startswith("not a slow step")


def test_more_than_half_of_the_ranks_slow_is_no_single_culprit() -> None:
    now = [ev(0, 5.0, 20.0)] + [ev(r, 25.0, 0.2) for r in (1, 2, 3)]
    verdict = decide(now, reference=healthy(4), reference_step=9)
    assert verdict.culprit_rank is None
    assert "more than half" in verdict.details["standout"]


def test_extra_work_that_nobody_waited_for_is_not_the_culprit() -> None:
    # rank 1 did more, but the others did not wait for it (no synchronisation between them)
    now = [ev(0, 5.0, 1.0), ev(1, 24.0, 1.0), ev(2, 5.0, 1.2)]
    verdict = decide(now, step_ms=26.0, expected_ms=7.0)
    assert verdict.culprit_rank is None
    assert "waited only" in verdict.details["standout"]


def test_one_ranks_unwaited_stall_over_a_small_common_growth_is_not_global() -> None:
    # rank 3 slept 400 ms after its last collective (nobody waited in this step); on a
    # loaded host every rank's idle also grew 3-10 ms. Before: "global", which overrode
    # the arrival evidence naming rank 3 (CI, every step traced)
    now = [ev(r, 5.2, 1.0, idle=5.5 + 1.0 * r) for r in range(3)] + [ev(3, 5.2, 1.0, idle=412.0)]
    verdict = decide(now, reference=healthy(4), reference_step=45, step_ms=434.9, expected_ms=39.0)
    assert (verdict.culprit_rank, verdict.cause) == (None, "unknown")
    assert "a small part of the step's slowdown of 395.9 ms" in verdict.evidence
    assert "rank 3 had 405.5 ms extra own time but the others waited only" in verdict.evidence
    # steps that sped up since an old reference: a real slowdown on every rank, small
    # over the reference but not over the detector's median, is still global
    before = [ev(r, 8.0, 1.0) for r in range(4)]
    now = [ev(r, 5.2, 1.0, idle=4.7) for r in range(4)]
    verdict = decide(now, reference=before, reference_step=45, step_ms=10.9, expected_ms=6.7)
    assert (verdict.culprit_rank, verdict.cause) == (None, "global")
    # the same growth on every rank, as large as the slowdown, is still global
    now = [ev(r, 5.2, 1.0, idle=400.0 + r) for r in range(4)]
    verdict = decide(now, reference=healthy(4), reference_step=45, step_ms=408.0, expected_ms=7.0)
    assert (verdict.culprit_rank, verdict.cause) == (None, "global")


def test_extra_time_spread_over_parts_names_the_rank_but_not_a_cause() -> None:
    now = [ev(r, 5.0, 15.0) for r in (0, 1, 3)] + [ev(2, 10.0, 0.2, idle=5.5, memcpy=5.0)]
    verdict = decide(now, step_ms=21.0, expected_ms=7.0)
    assert (verdict.culprit_rank, verdict.cause) == (2, "unknown")
    assert "spread over several parts" in verdict.evidence


def test_the_reference_keeps_a_rank_that_always_computes_more_from_a_compute_verdict() -> None:
    reference = [ev(r, 5.0, 15.5) for r in range(3)] + [ev(3, 20.0, 0.5)]
    now = [ev(r, 5.0, 30.0) for r in range(3)] + [ev(3, 20.0, 0.5, idle=15.0)]
    verdict = decide(now, reference=reference, reference_step=5, step_ms=36.0, expected_ms=21.0)
    assert (verdict.culprit_rank, verdict.cause) == (3, "host_stall")
    assert verdict.details["growth_ms"]["compute"] == pytest.approx(0.0)


def test_late_arrival_without_extra_work_is_a_host_stall() -> None:
    # a host stall before the step's first kernel: no idle inside the GPU span
    now = [ev(0, 5.0, 6.0), ev(1, 5.0, 0.3), ev(2, 5.0, 6.1), ev(3, 5.0, 5.9)]
    late = MatchedCollective(
        "pg:0",
        0,
        "ncclDevKernel_AllReduce",
        {0: 1000.0, 1: 6800.0, 2: 1010.0, 3: 990.0},
        {0: 7000.0, 1: 7000.0, 2: 7000.0, 3: 7000.0},
    )
    verdict = decide(now, collectives=[late], step_ms=12.0, expected_ms=6.0)
    assert (verdict.culprit_rank, verdict.cause) == (1, "host_stall")
    assert "rank 1 arrived last at ncclDevKernel_AllReduce #1, 5.81 ms after" in verdict.evidence


def test_arrival_compares_start_times_on_one_host_and_durations_across_hosts() -> None:
    coll = MatchedCollective(
        "pg:0", 0, "nccl", {0: 100.0, 1: 5_000_300.0}, {0: 900.0, 1: 5_000_900.0}
    )
    shared = arrival_order([coll], {0: "a", 1: "a"})
    assert shared is not None and shared.clock == "shared host clock"
    assert shared.latest_rank == 1  # 5 s later on the shared clock
    aligned = arrival_order([coll], {0: "a", 1: "b"})
    assert aligned is not None and aligned.clock == "end-aligned"
    assert aligned.latest_rank == 1 and aligned.wait_ms == pytest.approx(0.2)
    assert arrival_order([], {}) is None


def test_one_rank_job_names_the_part_that_grew() -> None:
    verdict = decide([ev(0, 25.0, 0.0)], reference=[ev(0, 5.0, 0.0)], reference_step=3)
    assert (verdict.culprit_rank, verdict.cause) == (0, "compute")


def test_no_evidence_is_unknown() -> None:
    verdict = decide([])
    assert verdict.cause == "unknown" and verdict.culprit_rank is None
    assert set(CAUSES) >= {verdict.cause}


def test_rank_list() -> None:
    assert rank_list([0, 1, 2, 4, 5, 6, 7]) == "0-2,4-7"
    assert rank_list([3]) == "3"
    assert rank_list([5, 1, 3, 2]) == "1-3,5"
    assert rank_list([]) == ""


# --------------------------------------------------------------------------- traces


HOSTS_ONE = {r: "node0" for r in range(4)}


def test_trace_nccl_kernels_one_rank_extra_matmul_is_compute() -> None:
    verdict = verdict_of_documents(
        gpu_job(extra_compute_us={3: 3000.0}),
        HOSTS_ONE,
        reference=gpu_job(),
        reference_step=20,
    )
    assert (verdict.culprit_rank, verdict.cause) == (3, "compute")
    arrival = verdict.details["arrival"]
    assert arrival["latest_rank"] == 3 and arrival["clock"] == "shared host clock"
    assert arrival["wait_ms"] == pytest.approx(3.0)
    assert verdict.details["arrival_agrees"] is True


def test_trace_host_gap_is_host_stall() -> None:
    verdict = verdict_of_documents(gpu_job(gap_us={1: 3000.0}), HOSTS_ONE, reference=gpu_job())
    assert (verdict.culprit_rank, verdict.cause) == (1, "host_stall")


def test_trace_all_ranks_slow_together_is_global() -> None:
    verdict = verdict_of_documents(
        gpu_job(all_gap_us=3000.0), HOSTS_ONE, reference=gpu_job(), reference_step=20
    )
    assert (verdict.culprit_rank, verdict.culprit_node, verdict.cause) == (None, None, "global")


def test_trace_slow_collective_is_communication() -> None:
    verdict = verdict_of_documents(
        gpu_job(comm_us=4000.0), HOSTS_ONE, reference=gpu_job(), reference_step=20
    )
    assert (verdict.culprit_rank, verdict.cause) == (None, "communication")


def test_trace_node_of_two_slow_ranks_out_of_four() -> None:
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    verdict = verdict_of_documents(
        gpu_job(extra_compute_us={2: 3000.0, 3: 3100.0}), hosts, reference=gpu_job()
    )
    assert verdict.culprit_node == "b" and verdict.culprit_rank == 3
    assert verdict.cause == "compute"


def test_trace_hosts_with_different_clocks_use_end_aligned_arrival() -> None:
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    shifted = gpu_job(extra_compute_us={1: 3000.0}, clock_shift_us={2: 7e6, 3: 7e6})
    verdict = verdict_of_documents(shifted, hosts, reference=gpu_job())
    assert (verdict.culprit_rank, verdict.cause) == (1, "compute")
    arrival = verdict.details["arrival"]
    assert arrival["clock"] == "end-aligned" and arrival["latest_rank"] == 1


def test_trace_without_process_group_names_matches_by_nccl_stream_order() -> None:
    docs = gpu_job(
        extra_compute_us={0: 3000.0}, process_group=None, nccl_stream={0: 20, 1: 24, 2: 20, 3: 28}
    )
    verdict = verdict_of_documents(docs, HOSTS_ONE, reference=gpu_job())
    assert (verdict.culprit_rank, verdict.cause) == (0, "compute")
    assert verdict.details["arrival"]["latest_rank"] == 0


def test_trace_cpu_gloo_stalled_rank_is_host_stall() -> None:
    verdict = verdict_of_documents(
        cpu_job(stall_us={2: 600_000.0}), HOSTS_ONE, reference=cpu_job(), reference_step=83
    )
    assert (verdict.culprit_rank, verdict.cause) == (2, "host_stall")
    assert verdict.details["arrival"]["collective"] == "gloo:all_reduce #1"


def test_trace_cpu_stall_before_the_first_op_counts_through_the_step_window() -> None:
    docs = cpu_job(stall_us={1: 50_000.0}, stall_before_first_op=True)
    verdict = verdict_of_documents(docs, HOSTS_ONE, step_ms=52.0, expected_ms=1.5)
    assert (verdict.culprit_rank, verdict.cause) == (1, "host_stall")


def test_trace_cpu_everyone_slow_is_global() -> None:
    verdict = verdict_of_documents(
        cpu_job(all_stall_us=300_000.0), HOSTS_ONE, step_ms=301.5, expected_ms=1.5
    )
    assert (verdict.culprit_rank, verdict.cause) == (None, "global")


def test_trace_matmul_name_is_what_the_kernel_generator_uses() -> None:
    names = {e["name"] for e in gpu_job(extra_compute_us={1: 10.0})[1]["traceEvents"]}
    assert MATMUL in names


# Two DDP ranks on H200s, launch-bound (bench/results/multigpu_h200x2.json): rank 1's host
# launches later every step, so it idles ~10.5 ms while rank 0 waits as much in NCCL.
IMBALANCED_REFERENCE = [ev(0, 2.0, 10.0, idle=1.0), ev(1, 1.9, 0.1, idle=10.5)]


def test_a_rank_that_is_always_behind_is_not_the_culprit_of_a_slowdown_everyone_had() -> None:
    # both ranks ran a 10 ms kernel more: rank 1 still idles as it always does
    now = [ev(0, 12.1, 12.9, idle=1.1), ev(1, 12.0, 0.1, idle=11.9)]
    verdict = decide(
        now, reference=IMBALANCED_REFERENCE, reference_step=254, step_ms=26.2, expected_ms=15.5
    )
    assert (verdict.culprit_rank, verdict.cause) == (None, "global")
    assert verdict.details["global_part"] == "compute"


def test_the_rank_that_is_usually_ahead_is_named_when_it_stalls() -> None:
    # rank 0 stalled 20 ms on its host: now rank 1 waits for it in NCCL
    now = [ev(0, 2.0, 0.1, idle=21.0), ev(1, 1.9, 10.6, idle=10.5)]
    verdict = decide(
        now, reference=IMBALANCED_REFERENCE, reference_step=254, step_ms=23.3, expected_ms=13.5
    )
    assert (verdict.culprit_rank, verdict.cause) == (0, "host_stall")


def test_the_rank_that_is_always_behind_is_named_when_it_computes_more() -> None:
    now = [ev(0, 2.0, 20.0, idle=1.0), ev(1, 11.9, 0.1, idle=10.5)]
    verdict = decide(
        now, reference=IMBALANCED_REFERENCE, reference_step=254, step_ms=23.3, expected_ms=13.5
    )
    assert (verdict.culprit_rank, verdict.cause) == (1, "compute")


def test_a_second_part_that_grew_almost_as_much_is_named_too() -> None:
    # one H200 rank, bench/results/device_e2e_h200.json step 100: the injected 10 ms
    # kernel (compute) and a first-use stall of the host (idle) in the same step
    verdict = decide(
        [ev(0, 12.1, 0.0, idle=19.9)], reference=[ev(0, 2.0, 0.0, idle=8.55)],
        reference_step=291, step_ms=32.6, expected_ms=11.2,
    )  # fmt: skip
    assert (verdict.culprit_rank, verdict.cause) == (0, "host_stall")
    assert verdict.details["also"] == ["compute"]
    assert (
        "idle grew over reference step 291 by 11.3 ms, "
        "computation grew over reference step 291 by 10.1 ms" in verdict.evidence
    )


def test_a_small_second_part_is_not_named() -> None:
    verdict = decide(
        [ev(0, 3.0, 0.0, idle=19.9)], reference=[ev(0, 2.0, 0.0, idle=8.55)],
        reference_step=291, step_ms=23.5, expected_ms=11.2,
    )  # fmt: skip
    assert verdict.cause == "host_stall"
    assert "also" not in verdict.details
    assert "computation" not in verdict.evidence


def test_a_culprits_second_part_is_named_too() -> None:
    now = [ev(0, 5.2, 13.0), ev(1, 5.2, 13.1), ev(2, 11.7, 0.5, idle=7.5), ev(3, 5.2, 12.9)]
    verdict = decide(now, reference=healthy(4), reference_step=9, step_ms=19.0, expected_ms=7.0)
    assert (verdict.culprit_rank, verdict.cause) == (2, "host_stall")
    assert verdict.details["also"] == ["compute"]
    assert "computation also +6.50 ms" in verdict.evidence


def test_extra_work_on_every_rank_is_global_even_when_the_waiting_changed_hands() -> None:
    # bench/results/multigpu_h200x2.json step 160: a 10 ms kernel on both ranks; rank 1
    # usually idles while rank 0 waits, this time rank 0 came last to the all-reduce
    reference = [ev(0, 2.04, 13.9, idle=0.43, memcpy=0.11), ev(1, 1.91, 0.13, idle=12.74)]
    now = [ev(0, 12.01, 0.13, idle=13.81, memcpy=0.12), ev(1, 12.12, 14.77, idle=0.38)]
    verdict = decide(now, reference=reference, reference_step=253, step_ms=27.5, expected_ms=17.0)
    assert (verdict.culprit_rank, verdict.cause) == (None, "global")
    assert verdict.details["global_part"] == "compute"
    assert "all 2 ranks: computation grew over reference step 253 by 9.97-10.2 ms" in (
        verdict.evidence
    )


def test_extra_work_on_one_rank_only_is_not_global() -> None:
    reference = [ev(0, 2.04, 13.9, idle=0.43), ev(1, 1.91, 0.13, idle=12.74)]
    now = [ev(0, 2.03, 15.15, idle=0.43), ev(1, 12.01, 0.13, idle=13.64)]
    verdict = decide(now, reference=reference, reference_step=253, step_ms=27.3, expected_ms=17.0)
    assert (verdict.culprit_rank, verdict.cause) == (1, "compute")


# bench/results/multigpu_h200x2.json, third run: a 10 ms kernel on rank 1 only, reference
# step 254 (rank 0 waits for rank 1 in NCCL every step, rank 1 idles on its host)
H200_REFERENCE = [
    ev(0, 2.04, 12.24, idle=0.39, memcpy=0.11),
    ev(1, 1.92, 0.13, idle=11.16, memcpy=0.13),
]


@pytest.mark.parametrize(
    ("now", "step_ms", "expected_ms"),
    [
        # step 190: rank 0 came last to the all-reduce and idled; rank 1 waited
        ([ev(0, 1.92, 0.13, idle=10.2, memcpy=0.13), ev(1, 12.13, 11.75, idle=0.38)], 24.36, 14.0),
        # step 100: the kernel filled idle time rank 1 had anyway
        ([ev(0, 1.97, 4.52, idle=6.55, memcpy=0.11), ev(1, 12.02, 0.13, idle=10.34)], 23.61, 13.5),
    ],
)
def test_extra_kernel_time_on_one_rank_names_it_however_the_waiting_moved(
    now: list[RankEvidence], step_ms: float, expected_ms: float
) -> None:
    verdict = decide(
        now, reference=H200_REFERENCE, reference_step=254, step_ms=step_ms, expected_ms=expected_ms
    )
    assert (verdict.culprit_rank, verdict.cause) == (1, "compute")
    assert verdict.evidence.startswith("rank 1: computation grew over reference step 254 by 10.")
    assert verdict.details["culprit_ranks"] == [1]


# Extra kernel time on a rank other than the one own time names overrides it only when
# the waiting moved: the kernel rank's step window grew and the named rank's did not.
REF4 = [ev(r, 5.0, 1.0, idle=1.0) for r in range(4)]


def test_extra_kernel_time_hidden_in_a_wait_does_not_override_a_host_stall() -> None:
    now = [ev(0, 5.0, 1.0, idle=31.0), ev(1, 5.0, 31.0, idle=1.0), ev(2, 5.0, 31.0, idle=1.0)]
    now.append(ev(3, 21.0, 15.0, idle=1.0))  # +16 ms of kernels, inside its 30 ms wait
    verdict = decide(now, reference=REF4, reference_step=9, step_ms=37.0, expected_ms=7.0)
    assert (verdict.culprit_rank, verdict.cause) == (0, "host_stall")


def test_extra_kernel_time_filling_idle_does_not_override_a_global_stall() -> None:
    now = [ev(0, 5, 1, idle=41), ev(1, 25, 1, idle=21), ev(2, 5, 1, idle=41), ev(3, 5, 1, idle=41)]
    verdict = decide(now, reference=REF4, reference_step=9, step_ms=47.0, expected_ms=7.0)
    assert (verdict.culprit_rank, verdict.cause) == (None, "global")


def test_a_rank_with_a_stall_and_extra_kernels_keeps_the_larger_as_cause() -> None:
    now = [ev(0, 5, 31.5, idle=1), ev(1, 5, 31.5, idle=1), ev(2, 15.5, 1, idle=21)]
    now.append(ev(3, 5, 31.5, idle=1))
    verdict = decide(now, reference=REF4, reference_step=9, step_ms=37.5, expected_ms=7.0)
    assert (verdict.culprit_rank, verdict.cause) == (2, "host_stall")
    assert verdict.details["also"] == ["compute"]


def test_without_a_reference_absolute_parts_are_not_named_as_also() -> None:
    # a rank that always computes 20 ms and now idles 30 ms more: no reference to tell
    verdict = decide([ev(0, 20.0, 0.0, idle=30.5)], step_ms=51.0, expected_ms=20.5)
    assert verdict.cause == "host_stall"
    assert "also" not in verdict.details
    assert "computation" not in verdict.evidence


def test_a_stall_before_the_first_op_keeps_its_window_in_the_comparison() -> None:
    # CPU-only traces: rank 0 stalled 30 ms before its first op (outside the ops' span);
    # rank 3's ops ran 16 ms longer inside its wait (cores shared with the stall)
    now = [ev(0, 5.0, 1.0, idle=1.0, outside=30.0), ev(1, 5.0, 31.0), ev(2, 5.0, 31.0)]
    now.append(ev(3, 21.0, 15.0))
    ref = [ev(r, 5.0, 1.0) for r in range(4)]
    verdict = decide(now, reference=ref, reference_step=9, step_ms=37.0, expected_ms=7.0)
    assert (verdict.culprit_rank, verdict.cause) == (0, "host_stall")


# -- a host stall's Python garbage collection ----------------------------------------------


def stall(slowdown_ms: float | None = 40.0) -> Verdict:
    details = {} if slowdown_ms is None else {"slowdown_ms": slowdown_ms}
    return Verdict(2, None, "host_stall", "rank 2: idle grew by 39.0 ms", details)


@pytest.mark.parametrize(
    ("verdict", "pauses", "named"),
    [
        (stall(), {"2": {"ms": 31.2, "generation": 2}}, "31.2 ms on rank 2 during the step "
         "(generation 2)"),
        (stall(None), {"2": {"ms": 1.5, "generation": 1}}, "1.50 ms on rank 2 during the "
         "step (generation 1)"),  # no slowdown known
        (stall(), {"0": {"ms": 31.2, "generation": 2}}, None),  # another rank's
        (stall(), {"2": {"ms": 9.0, "generation": 2}}, None),  # under a quarter of 40 ms
        (stall(None), {"2": {"ms": 0.8, "generation": 0}}, None),  # under 1 ms
        (
            Verdict(2, None, "compute", "rank 2: computation grew", {"slowdown_ms": 40.0}),
            {"2": {"ms": 31.2, "generation": 2}},
            None,
        ),
    ],
)  # fmt: skip
def test_a_host_stalls_garbage_collection_joins_its_evidence(
    verdict: Verdict, pauses: dict[str, dict[str, float]], named: str | None
) -> None:
    noted = note_python_gc(verdict, pauses)
    if named is None:
        assert noted == verdict
        return
    assert noted.evidence == f"{verdict.evidence}; Python garbage collection ran {named}"
    assert noted.details["python_gc_ms"] == pauses["2"]["ms"]
    assert (noted.cause, noted.culprit_rank) == (verdict.cause, verdict.culprit_rank)


# --------------------------------------------------------------------------- wording


def test_a_culprit_of_a_jitter_sized_step_says_its_evidence_is_weak() -> None:
    ranks = [ev(0, 5.0, 3.0), ev(1, 5.1, 0.3, idle=3.4), ev(2, 5.0, 3.1), ev(3, 4.9, 2.8)]
    weak = decide(ranks, expected_ms=6.0, step_ms=9.0)
    assert weak.culprit_rank == 1 and weak.details["weak_evidence"] is True
    assert weak.evidence.endswith(
        "weak evidence: the step was only 1.50x the median, within the jitter of a busy machine"
    )
    strong = decide(ranks, expected_ms=4.0, step_ms=9.0)
    assert "weak evidence" not in strong.evidence and "weak_evidence" not in strong.details


def test_no_slowdown_in_the_traces_is_said_without_contradiction() -> None:
    now = healthy(4)  # the traces hold what the reference held, the step took twice as long
    verdict = decide(now, reference=healthy(4), reference_step=9, step_ms=13.0, expected_ms=6.7)
    assert verdict.culprit_rank is None
    assert "no slowdown" not in verdict.evidence
    assert verdict.evidence.startswith(
        "no rank stands out, and the traced ranks took no longer than in reference step 9"
    )


def test_a_culprit_without_a_grown_part_is_named_by_its_own_time_not_a_zero_part() -> None:
    now = [ev(r, 5.0, 15.0) for r in (0, 1, 3)] + [ev(2, 10.0, 0.2, idle=5.5, memcpy=5.0)]
    verdict = decide(now, step_ms=21.0, expected_ms=7.0)
    assert verdict.cause == "unknown"
    assert verdict.evidence.startswith("rank 2: own time")
    cpu = [ev(r, 1.0, 9.0) for r in (0, 1, 3)] + [ev(2, 1.2, 0.2, idle=0.9)]
    assert (
        "exposed memcpy 0.00 ms vs 0.00 ms"
        not in decide(cpu, step_ms=11.0, expected_ms=5.0).evidence
    )


def test_a_late_rank_whose_stall_explains_it_is_named_when_the_wait_was_nested() -> None:
    # rank 0 waited inside an enclosing op (computation), rank 1 stalled (idle)
    now = [ev(0, 603.7, 0.07, idle=0.9), ev(1, 3.2, 1.4, idle=600.9)]
    before = [ev(0, 3.0, 0.5), ev(1, 3.0, 0.5)]
    coll = MatchedCollective(
        "gloo", 1, "gloo:all_reduce", {0: 1000.0, 1: 601_000.0}, {0: 602_000.0, 1: 602_100.0}
    )
    verdict = decide(
        now, reference=before, reference_step=25, collectives=[coll], step_ms=605.0, expected_ms=5.0
    )
    assert (verdict.culprit_rank, verdict.cause) == (1, "host_stall"), verdict.evidence
    assert "its idle 600.9 ms explains it" in verdict.evidence


def test_a_change_against_the_reference_is_not_weak_evidence_whatever_the_ratio() -> None:
    # 1.8x the median, but rank 3's computation grew 5 ms over the reference step
    ranks = [ev(r, 5.2, 6.0 + 0.02 * r) for r in range(4) if r != 3] + [ev(3, 10.2, 1.0)]
    with_reference = decide(
        ranks, reference=healthy(4), reference_step=20, expected_ms=6.5, step_ms=11.7
    )
    assert (with_reference.culprit_rank, with_reference.cause) == (3, "compute")
    assert with_reference.details["growth_ms"]["compute"] >= 0.5 * 5.2
    assert "weak evidence" not in with_reference.evidence
    without = decide(ranks, expected_ms=6.5, step_ms=11.7)
    assert without.culprit_rank == 3 and without.details["weak_evidence"] is True
