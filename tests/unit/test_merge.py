"""Collectives matched across ranks, clock offsets, and the merged all-rank trace."""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest

from distanom.analysis.collectives import CollectiveCall, collective_calls, match_collectives
from distanom.analysis.merge import PID_STRIDE, MergeWriter, estimate_offsets
from distanom.analysis.tables import gpu_timeline
from distanom.analysis.trace_io import trace_from_document
from tests.unit.stepgen import HOST_PID, NCCL, cpu_job, gpu_job, kernel


def calls(docs: dict[int, dict[str, Any]]) -> dict[int, list[CollectiveCall]]:
    return {rank: collective_calls(doc["traceEvents"])[1] for rank, doc in docs.items()}


def test_gpu_collectives_are_nccl_kernels_grouped_by_process_group() -> None:
    kind, found = collective_calls(gpu_job()[0]["traceEvents"])
    assert kind == "gpu" and [c.name for c in found] == [NCCL]
    assert found[0].group == "pg:0"
    kind, found = collective_calls(gpu_job(process_group=None)[0]["traceEvents"])
    assert found[0].group == "stream:20"


def test_cpu_collectives_are_gloo_spans_else_c10d_calls() -> None:
    events = cpu_job()[0]["traceEvents"]
    kind, found = collective_calls(events)
    assert kind == "cpu" and [c.name for c in found] == ["gloo:all_reduce"]
    no_gloo = [e for e in events if not str(e.get("name")).startswith("gloo:")]
    assert [c.name for c in collective_calls(no_gloo)[1]] == ["c10d::allreduce_"]


def test_collectives_with_non_finite_times_are_skipped() -> None:
    events = cpu_job()[0]["traceEvents"]
    gloo = next(e for e in events if str(e.get("name")).startswith("gloo:"))
    for bad in (float("inf"), float("nan"), "12", True):
        broken = [dict(e, ts=bad) if e is gloo else e for e in events]
        assert [c.name for c in collective_calls(broken)[1]] == ["c10d::allreduce_"], bad


def test_matching_pairs_by_order_within_a_group() -> None:
    per_rank = {
        0: [CollectiveCall("pg:0", "ar", 10.0, 5.0), CollectiveCall("pg:0", "ar", 30.0, 5.0)],
        1: [CollectiveCall("pg:0", "ar", 12.0, 3.0), CollectiveCall("pg:0", "ar", 31.0, 4.0)],
        2: [CollectiveCall("pg:1", "bc", 0.0, 1.0)],  # a group only rank 2 is in: nothing to pair
    }
    result = match_collectives(per_rank)
    assert [(m.group, m.index) for m in result.matched] == [("pg:0", 0), ("pg:0", 1)]
    assert result.matched[1].start_us == {0: 30.0, 1: 31.0}
    assert result.matched[1].end_us == {0: 35.0, 1: 35.0}
    assert result.matched[0].label() == "ar #1"


def test_groups_with_different_counts_are_left_out_with_a_note() -> None:
    per_rank = {
        0: [CollectiveCall("pg:0", "ar", 10.0, 5.0)],
        1: [CollectiveCall("pg:0", "ar", 12.0, 3.0), CollectiveCall("pg:0", "ar", 31.0, 4.0)],
    }
    result = match_collectives(per_rank)
    assert result.matched == []
    assert result.unmatched == ["pg:0: different counts (rank 0: 1, rank 1: 2)"]


def test_different_nccl_stream_ids_are_matched_by_order_of_use() -> None:
    docs = gpu_job(process_group=None, nccl_stream={0: 20, 1: 24})
    result = match_collectives(calls({0: docs[0], 1: docs[1]}))
    assert len(result.matched) == 1 and result.matched[0].group == "stream#0"


def test_ranks_of_one_host_share_its_clock() -> None:
    docs = gpu_job(extra_compute_us={1: 3000.0})
    matched = match_collectives(calls(docs)).matched
    alignment = estimate_offsets(
        [0, 1, 2, 3], {r: "a" for r in range(4)}, {r: 10**18 for r in range(4)}, matched
    )
    assert alignment.method == "shared host clock"
    assert alignment.offsets_us == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}


def test_host_offsets_come_from_collective_ends() -> None:
    docs = gpu_job(extra_compute_us={1: 3000.0}, clock_shift_us={2: 7e6 + 123.0, 3: 7e6 + 123.0})
    matched = match_collectives(calls(docs)).matched
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    alignment = estimate_offsets([0, 1, 2, 3], hosts, {r: 10**18 for r in range(4)}, matched)
    assert alignment.method == "collective ends"
    assert alignment.offsets_us[2] == pytest.approx(-(7e6 + 123.0))
    assert alignment.offsets_us[3] == alignment.offsets_us[2]
    assert alignment.per_rank[2]["aligned_by"] == "collective ends (1 matched)"


def test_base_time_is_applied_before_the_residual() -> None:
    base = {0: 10**18, 1: 10**18 + 2_000_000_000}  # rank 1's base is 2 s later
    docs = gpu_job(world=2, clock_shift_us={1: -2e6 + 40.0})  # its ts 2 s lower, 40 µs off
    matched = match_collectives(calls(docs)).matched
    alignment = estimate_offsets([0, 1], {0: "a", 1: "b"}, base, matched)
    assert alignment.per_rank[1]["base_shift_us"] == 2e6
    assert alignment.offsets_us[1] == pytest.approx(2e6 - 40.0)


def test_nothing_matched_falls_back_to_zero_offsets_and_says_so() -> None:
    alignment = estimate_offsets([0, 1], {0: "a", 1: "b"}, {0: None, 1: None}, [])
    assert alignment.method == "none"
    assert alignment.offsets_us == {0: 0.0, 1: 0.0}
    assert any("no collective matched" in note for note in alignment.notes)
    assert any("baseTimeNanoseconds missing" in note for note in alignment.notes)
    assert alignment.as_json()["ranks"]["1"]["aligned_by"] == "none: offset 0"


def test_merged_document_keeps_every_rank_apart_and_aligned() -> None:
    docs = gpu_job(clock_shift_us={1: 5000.0})

    def flow(rank: int) -> list[dict[str, Any]]:
        host = {"pid": HOST_PID + rank, "tid": 1}
        return [
            {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 7, "ts": 1.0, **host},
            {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 7, "pid": 0, "tid": 7, "ts": 2.0},
        ]

    writer = MergeWriter()
    writer.add_rank(0, "a", [*docs[0]["traceEvents"], *flow(0)], 0.0)
    writer.add_rank(1, "b", [*docs[1]["traceEvents"], *flow(1), "junk"], -5000.0)
    merged = json.loads(gzip.decompress(writer.finish({"distanom": {"step": 3}})))
    assert merged["distanom"] == {"step": 3}
    events = merged["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names[PID_STRIDE] == "rank 0 (a) GPU 0"
    assert names[2 * PID_STRIDE] == "rank 1 (b) GPU 0"
    assert sorted(names.values()) == [
        "rank 0 (a) CPU",
        "rank 0 (a) GPU 0",
        "rank 1 (b) CPU",
        "rank 1 (b) GPU 0",
    ]
    nccl = {e["pid"]: e for e in events if e.get("name") == NCCL}
    assert nccl[PID_STRIDE]["ts"] + nccl[PID_STRIDE]["dur"] == pytest.approx(
        nccl[2 * PID_STRIDE]["ts"] + nccl[2 * PID_STRIDE]["dur"]
    )
    flow_ids = {(e["pid"] // PID_STRIDE, e["id"]) for e in events if e.get("cat") == "ac2g"}
    assert len({i for _, i in flow_ids}) == 2  # one id per rank's flow, no collision
    # still a valid Kineto document: the GPU timeline reads every rank's kernels
    trace = trace_from_document(merged, "merged")
    assert len(trace.gpu_events) == 2 * 4
    assert gpu_timeline(trace).total_time_us > 0


def test_merged_output_handles_an_empty_rank_and_kernel_helper_defaults() -> None:
    writer = MergeWriter()
    writer.add_rank(0, None, [kernel("k", 1.0, 2.0)], 0.0)
    writer.add_rank(1, None, [], 0.0)
    merged = json.loads(gzip.decompress(writer.finish({})))
    assert [e["name"] for e in merged["traceEvents"] if e.get("ph") == "X"] == ["k"]
    assert writer.ranks[1]["events"] == 0
