"""Synthetic multi-rank step traces with known answers (not a test module).

`gpu_job` builds one step of a data-parallel job as every rank's Kineto document:
forward and backward kernels, then one NCCL all-reduce that no rank can leave before
the last one joined (all end together), then an optimizer kernel. Knobs inject the
anomalies the verdict must explain: extra compute on some ranks (an extra big matmul,
as in the seed's workload), an idle gap (host stall), every rank slower, a slow
collective, and per-host clock shifts. `cpu_job` does the same for CPU-only gloo
traces (host spans, a gloo:all_reduce on a worker thread, the step annotation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

T0 = 5_000_000_000.0  # µs: where the first rank's step starts on its clock
FWD_US, BWD_US, OPT_US, COMM_US = 300.0, 500.0, 100.0, 200.0
MATMUL = "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT"
MATMUL_GRID, MATMUL_BLOCK = [128, 64, 1], [384, 1, 1]
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
HOST_PID = 4242


def kernel(
    name: str,
    ts: float,
    dur: float,
    *,
    stream: int = 7,
    grid: list[int] | None = None,
    block: list[int] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    args: dict[str, Any] = {"device": 0, "stream": stream, "correlation": int(ts) % 1_000_000}
    args["grid"] = grid or [64, 1, 1]
    args["block"] = block or [256, 1, 1]
    args.update(extra or {})
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": 0,
        "tid": stream,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def _meta(pid: int, label: str) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python3"}},
        {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "args": {"labels": label}},
    ]


def gpu_job(
    world: int = 4,
    *,
    extra_compute_us: Mapping[int, float] | None = None,
    gap_us: Mapping[int, float] | None = None,
    all_gap_us: float = 0.0,
    comm_us: float = COMM_US,
    clock_shift_us: Mapping[int, float] | None = None,
    process_group: str | None = "0",
    nccl_stream: Mapping[int, int] | None = None,
    memcpy_us: Mapping[int, float] | None = None,
) -> dict[int, dict[str, Any]]:
    """Every rank's document of one synchronous step (see the module docstring)."""
    extra_compute_us = extra_compute_us or {}
    gap_us = gap_us or {}
    clock_shift_us = clock_shift_us or {}
    memcpy_us = memcpy_us or {}
    arrivals = {}
    for rank in range(world):
        arrivals[rank] = (
            T0
            + FWD_US
            + gap_us.get(rank, 0.0)
            + all_gap_us
            + BWD_US
            + extra_compute_us.get(rank, 0.0)
            + memcpy_us.get(rank, 0.0)
        )
    leave = max(arrivals.values()) + comm_us  # nobody leaves before the last one joined
    documents = {}
    for rank in range(world):
        shift = clock_shift_us.get(rank, 0.0)
        t = T0 + shift
        events = [*_meta(0, "GPU 0"), *_meta(HOST_PID + rank, "CPU")]
        events.append(kernel("gemm_fwd", t, FWD_US))
        t += FWD_US + gap_us.get(rank, 0.0) + all_gap_us
        events.append(kernel("gemm_bwd", t, BWD_US, grid=[32, 2, 1]))
        t += BWD_US
        if extra_compute_us.get(rank):
            events.append(
                kernel(
                    MATMUL,
                    t,
                    extra_compute_us[rank],
                    grid=MATMUL_GRID,
                    block=MATMUL_BLOCK,
                )
            )
            t += extra_compute_us[rank]
        if memcpy_us.get(rank):
            copy = kernel("Memcpy DtoH (Device -> Pinned)", t, memcpy_us[rank])
            copy["cat"] = "gpu_memcpy"
            events.append(copy)
            t += memcpy_us[rank]
        extra = {"Process Group Name": process_group} if process_group is not None else {}
        stream = (nccl_stream or {}).get(rank, 20)
        events.append(kernel(NCCL, t, leave + shift - t, stream=stream, extra=extra))
        t = leave + shift
        events.append(kernel("sgd_update", t, OPT_US))
        documents[rank] = {
            "traceEvents": events,
            "baseTimeNanoseconds": 1_790_000_000_000_000_000,
            "distributedInfo": {"rank": rank, "world_size": world, "backend": "nccl"},
        }
    return documents


CPU_FWD_US, CPU_BWD_US, CPU_COMM_US = 400.0, 600.0, 300.0


def host_span(
    name: str, ts: float, dur: float, tid: int, *, cat: str = "cpu_op", pid: int = HOST_PID
) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def cpu_job(
    world: int = 4,
    *,
    stall_us: Mapping[int, float] | None = None,
    all_stall_us: float = 0.0,
    stall_before_first_op: bool = False,
    step: int = 40,
) -> dict[int, dict[str, Any]]:
    """CPU-only gloo documents of one step: zero_grad, (stall), forward, backward, a
    gloo:all_reduce on the worker thread that ends when the last rank joined, step."""
    stall_us = stall_us or {}
    arrivals = {
        r: T0 + 50.0 + stall_us.get(r, 0.0) + all_stall_us + CPU_FWD_US + CPU_BWD_US
        for r in range(world)
    }
    leave = max(arrivals.values()) + CPU_COMM_US
    documents = {}
    for rank in range(world):
        pid = HOST_PID + rank
        main, worker = 100 + rank, 200 + rank
        t = T0
        events = _meta(pid, "CPU")
        if not stall_before_first_op:
            events.append(host_span("Optimizer.zero_grad#SGD.zero_grad", t, 40.0, main, pid=pid))
        t += 50.0 + stall_us.get(rank, 0.0) + all_stall_us
        events.append(host_span("aten::linear", t, CPU_FWD_US, main, pid=pid))
        t += CPU_FWD_US
        events.append(
            host_span(
                "autograd::engine::evaluate_function: AddmmBackward0", t, 500.0, main, pid=pid
            )
        )
        events.append(host_span("c10d::allreduce_", t + 500.0, 30.0, main, pid=pid))
        t += CPU_BWD_US
        events.append(
            host_span("gloo:all_reduce", t, leave - t, worker, cat="user_annotation", pid=pid)
        )
        events.append(
            host_span(
                "Optimizer.step#SGD.step", leave + 10.0, 80.0, main, cat="user_annotation", pid=pid
            )
        )
        end = leave + 100.0
        events.append(
            host_span(f"distanom step {step}", T0, end - T0, 0, cat="user_annotation", pid=pid)
        )
        documents[rank] = {
            "traceEvents": events,
            "baseTimeNanoseconds": 1_790_000_000_000_000_000,
            "distributedInfo": {"rank": rank, "world_size": world, "backend": "gloo"},
        }
    return documents
