"""Kernel diff against the healthy reference step, on synthetic traces with known answers."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from distanom.analysis.kernel_diff import (
    OpKey,
    OpStats,
    diff_ops,
    kernel_diff_lines,
    op_table,
    pick_reference,
    top_changes,
)
from tests.unit.stepgen import MATMUL, MATMUL_BLOCK, MATMUL_GRID, cpu_job, gpu_job, kernel

DATA = Path(__file__).resolve().parents[1] / "data"


def test_kernels_are_grouped_by_name_and_launch_shape() -> None:
    events = [
        kernel("gemm", 0.0, 10.0, grid=[8, 1, 1]),
        kernel("gemm", 20.0, 12.0, grid=[8, 1, 1]),
        kernel("gemm", 40.0, 30.0, grid=[16, 1, 1]),
        {"ph": "X", "cat": "kernel", "name": "bare", "ts": 80.0, "dur": 5.0, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0},
    ]
    kind, table = op_table(events)
    assert kind == "gpu"
    small = table[OpKey("gemm", (8, 1, 1), (256, 1, 1))]
    assert (small.count, small.total_us) == (2, 22.0)
    assert table[OpKey("gemm", (16, 1, 1), (256, 1, 1))].count == 1
    assert table[OpKey("bare")].total_us == 5.0
    assert OpKey("aten::mm") not in table  # CPU ops only count in CPU-only traces


def test_the_extra_matmul_tops_the_diff_of_the_slow_rank() -> None:
    _, now = op_table(gpu_job(extra_compute_us={2: 3000.0})[2]["traceEvents"])
    _, before = op_table(gpu_job()[2]["traceEvents"])
    diff = diff_ops(2, "gpu", now, before, idle_change_ms=0.0)
    top = diff.changes[0]
    assert top.key == OpKey(MATMUL, tuple(MATMUL_GRID), tuple(MATMUL_BLOCK))
    assert (top.status, top.count, top.ref_count, top.added_us) == ("appeared", 1, 0, 3000.0)
    body = diff.as_json()
    assert body["changes"][0]["name"] == MATMUL and body["changes"][0]["grid"] == MATMUL_GRID
    assert body["kind"] == "gpu" and body["idle_change_ms"] == 0.0


def test_the_extra_matmul_tops_the_diff_on_the_real_h200_trace() -> None:
    # The seed's anomalous step (an extra 8192x8192 matmul pair) against itself minus
    # that matmul: the matmul must come first, as "grew" with its whole time added.
    doc = json.loads(
        gzip.decompress((DATA / "h200_resnet18_b5_anomalous_step.json.gz").read_bytes())
    )
    _, now = op_table(doc["traceEvents"])
    healthy = [e for e in doc["traceEvents"] if not str(e.get("name")).startswith("nvjet")]
    _, before = op_table(healthy)
    diff = diff_ops(0, "gpu", now, before)
    assert diff.changes[0].key.name.startswith("nvjet_sm90")
    assert diff.changes[0].status == "appeared" and diff.changes[0].count == 2
    assert diff.changes[0].added_us > 2000


def test_vanished_and_shrunk_kernels_are_reported_apart() -> None:
    before = {OpKey("a"): _stats(2, 100.0), OpKey("b"): _stats(1, 50.0)}
    now = {OpKey("a"): _stats(2, 60.0), OpKey("c"): _stats(1, 10.0)}
    diff = diff_ops(0, "gpu", now, before)
    assert [c.key.name for c in diff.changes] == ["c", "a", "b"]
    assert [c.status for c in diff.changes] == ["appeared", "shrank", "vanished"]
    body = diff.as_json()
    assert [c["name"] for c in body["changes"]] == ["c"]
    assert [c["name"] for c in body["vanished"]] == ["b"]
    assert body["added_us"] == -80.0


def test_top_changes_are_capped_and_the_rest_summed() -> None:
    now = {OpKey(f"k{i}"): _stats(1, float(i + 1)) for i in range(15)}
    body = diff_ops(0, "gpu", now, {}).as_json(top=10)
    assert len(body["changes"]) == 10 and body["changes"][0]["name"] == "k14"
    assert body["other_added_us"] == 1 + 2 + 3 + 4 + 5


def test_cpu_only_traces_diff_cpu_ops_by_name() -> None:
    kind, now = op_table(cpu_job(stall_us={1: 1000.0})[1]["traceEvents"])
    assert kind == "cpu"
    assert OpKey("gloo:all_reduce") in now and OpKey("aten::linear") in now
    assert not any(key.name.startswith("distanom") for key in now)  # the step span is no op


def test_reference_is_the_latest_at_or_before_else_the_nearest() -> None:
    assert pick_reference(50, [20, 40, 60]) == 40
    assert pick_reference(40, [20, 40, 60]) == 20  # never the step itself
    assert pick_reference(10, [20, 60]) == 20
    assert pick_reference(10, []) is None
    assert pick_reference(20, [20]) is None


def test_text_shows_the_culprits_top_changes() -> None:
    _, now = op_table(gpu_job(extra_compute_us={3: 3000.0})[3]["traceEvents"])
    _, before = op_table(gpu_job()[3]["traceEvents"])
    body = {
        "reference_step": 20,
        "ranks": {
            "0": diff_ops(0, "gpu", before, before).as_json(),
            "3": diff_ops(3, "gpu", now, before, 0.25).as_json(),
        },
    }
    assert top_changes(body, None)[0] == "3"  # the rank that added most
    assert top_changes(body, 0)[0] == "0"
    lines = kernel_diff_lines(body, 3, top=5)
    assert lines[0] == "  kernels vs reference step 20, rank 3 (idle +0.2 ms):"
    assert "+3000.0 µs" in lines[1] and "appeared" in lines[1] and MATMUL in lines[1]
    assert "(128,64,1)x(384,1,1)" in lines[1]
    assert kernel_diff_lines({"reference_step": None, "note": "no reference"}, None) == [
        "  kernel diff: no reference"
    ]


def _stats(count: int, total: float) -> OpStats:
    return OpStats(count, total)
