"""Decoded CUPTI records as chrome-trace events in Kineto's shape.

Owns the conversion of `GpuActivity` values (see `records`) into the 'X' span events
and the 'M' metadata events a CUDA-only torch.profiler trace holds, so a CUPTI trace
reads the same in Perfetto, HTA, TraceLens and distanom's analysis. The events go into
the `StepTrace` the resolver builds; `device_properties` gives the trace's
`deviceProperties` metadata. Pure: no CUPTI, and torch only as an argument.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from distanom.tracers.cupti.library import KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET
from distanom.tracers.cupti.records import GpuActivity

KINETO_CATEGORY = {
    KIND_CONCURRENT_KERNEL: "kernel",
    KIND_MEMCPY: "gpu_memcpy",
    KIND_MEMSET: "gpu_memset",
}


def _us(ns: int) -> float:
    # Kineto writes microseconds with nanosecond precision (3 decimals).
    return round(ns / 1000.0, 3)


def kineto_event(rec: GpuActivity, base_time_ns: int, num_sms: int | None = None) -> dict[str, Any]:
    """One record as a chrome-trace 'X' event the way Kineto writes it."""
    dur_ns = rec.end_ns - rec.start_ns
    args: dict[str, Any] = {
        "device": rec.device,
        "context": rec.context,
        "stream": rec.stream,
        "correlation": rec.correlation,
    }
    if rec.kind == KIND_CONCURRENT_KERNEL:
        args["registers per thread"] = rec.registers
        args["shared memory"] = rec.shared_memory
        if num_sms:
            blocks = rec.grid[0] * rec.grid[1] * rec.grid[2] / num_sms
            threads = rec.block[0] * rec.block[1] * rec.block[2]
            args["blocks per SM"] = round(blocks, 6)
            args["warps per SM"] = round(blocks * threads / 32.0, 6)
        args["grid"] = list(rec.grid)
        args["block"] = list(rec.block)
    else:
        args["bytes"] = rec.bytes
        args["memory bandwidth (GB/s)"] = rec.bytes / dur_ns if dur_ns > 0 else "N/A"
    return {
        "ph": "X",
        "cat": KINETO_CATEGORY[rec.kind],
        "name": rec.name,
        "pid": rec.device,
        "tid": rec.stream,
        "ts": _us(rec.start_ns - base_time_ns),
        "dur": _us(dur_ns),
        "args": args,
    }


def metadata_events(
    devices_streams: Iterable[tuple[int, int]], ts: float, process_name: str = "python3"
) -> list[dict[str, Any]]:
    """Kineto's 'M' events naming each GPU row (pid = device) and stream row (tid = stream)."""
    pairs = sorted(set(devices_streams))
    events: list[dict[str, Any]] = []
    for device in sorted({d for d, _ in pairs}):
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "ts": ts,
                "pid": device,
                "tid": 0,
                "args": {"name": process_name},
            }
        )
        events.append(
            {
                "name": "process_labels",
                "ph": "M",
                "ts": ts,
                "pid": device,
                "tid": 0,
                "args": {"labels": f"GPU {device}"},
            }
        )
        events.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "ts": ts,
                "pid": device,
                "tid": 0,
                "args": {"sort_index": 5000000 + device},
            }
        )
    for device, stream in pairs:
        # Kineto's stream label has a trailing space; kept so names match its traces.
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "ts": ts,
                "pid": device,
                "tid": stream,
                "args": {"name": f"stream {stream} "},
            }
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "ts": ts,
                "pid": device,
                "tid": stream,
                "args": {"sort_index": stream},
            }
        )
    return events


def kineto_events(
    records: Sequence[GpuActivity],
    base_time_ns: int,
    num_sms: int | None = None,
    process_name: str = "python3",
) -> list[dict[str, Any]]:
    """Metadata events, then one event per record in start order."""
    ordered = sorted(records, key=lambda r: (r.start_ns, r.correlation))
    spans = [kineto_event(r, base_time_ns, num_sms) for r in ordered]
    first_ts = spans[0]["ts"] if spans else 0.0
    meta = metadata_events(((r.device, r.stream) for r in ordered), first_ts, process_name)
    return meta + spans


def device_properties(torch: Any) -> list[dict[str, Any]]:
    """Kineto's `deviceProperties` trace entries, one per visible CUDA device (`torch` is
    the imported module, passed in so this module never imports it)."""
    out: list[dict[str, Any]] = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        entry = {
            "id": i,
            "name": p.name,
            "totalGlobalMem": int(p.total_memory),
            "computeMajor": int(p.major),
            "computeMinor": int(p.minor),
            "numSms": int(p.multi_processor_count),
        }
        for key, attr in (
            ("maxThreadsPerMultiprocessor", "max_threads_per_multi_processor"),
            ("warpSize", "warp_size"),
            ("regsPerMultiprocessor", "regs_per_multiprocessor"),
            ("sharedMemPerBlock", "shared_memory_per_block"),
            ("sharedMemPerBlockOptin", "shared_memory_per_block_optin"),
            ("sharedMemPerMultiprocessor", "shared_memory_per_multiprocessor"),
        ):
            value = getattr(p, attr, None)
            if value is not None:
                entry[key] = int(value)
        out.append(entry)
    return out
