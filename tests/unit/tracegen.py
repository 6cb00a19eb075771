"""Builders of small synthetic Kineto traces for the analysis tests (not a test module)."""

from __future__ import annotations

from typing import Any

from distanom.analysis.trace_io import Trace, trace_from_document

GPU_PID = 0
HOST_PID = 100
HOST_TID = 100


def gpu(
    name: str,
    ts: float,
    dur: float,
    *,
    cat: str = "kernel",
    stream: int | None = 7,
    device: int = GPU_PID,
    corr: int | None = None,
) -> dict[str, Any]:
    """A GPU event (kernel by default) on `stream` of `device`."""
    args: dict[str, Any] = {"device": device}
    if stream is not None:
        args["stream"] = stream
    if corr is not None:
        args["correlation"] = corr
    tid = stream if stream is not None else 0
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": device,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def launch(
    name: str,
    ts: float,
    dur: float,
    corr: int,
    *,
    launcher: str = "cudaLaunchKernel",
    stream: int = 7,
    device: int = GPU_PID,
    flows: bool = True,
    cat: str = "kernel",
) -> list[dict[str, Any]]:
    """A runtime launch call, its ac2g flow pair (optional) and the GPU event it launches."""
    events: list[dict[str, Any]] = [
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": launcher,
            "pid": HOST_PID,
            "tid": HOST_TID,
            "ts": ts - 5.0,
            "dur": 3.0,
            "args": {"correlation": corr},
        },
        gpu(name, ts, dur, cat=cat, stream=stream, device=device, corr=corr),
    ]
    if flows:
        events.append(
            {
                "ph": "s",
                "id": corr,
                "pid": HOST_PID,
                "tid": HOST_TID,
                "ts": ts - 5.0,
                "cat": "ac2g",
                "name": "ac2g",
            }
        )
        events.append(
            {
                "ph": "f",
                "id": corr,
                "pid": device,
                "tid": stream,
                "ts": ts,
                "cat": "ac2g",
                "name": "ac2g",
                "bp": "e",
            }
        )
    return events


def host(
    name: str, ts: float, dur: float, *, cat: str = "cpu_op", tid: int = HOST_TID
) -> dict[str, Any]:
    """A host span (cpu_op by default)."""
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": HOST_PID,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": {},
    }


def make_trace(events: list[dict[str, Any]], **top: Any) -> Trace:
    """A `Trace` from a list of events (plus optional top-level keys)."""
    return trace_from_document({"traceEvents": events, **top}, "synthetic.json")
