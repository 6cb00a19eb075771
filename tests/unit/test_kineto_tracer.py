"""The kineto backend: cutting one step out of a window, on a real H200 trace and live on CPU."""

from __future__ import annotations

import gzip
import json
import math
import time
from pathlib import Path

import torch

from distanom.config import TracerConfig
from distanom.tracers.base import Availability, Tracer
from distanom.tracers.kineto import KinetoTracer, cut_step

DEVICE_TRACE = Path(__file__).parent.parent / "data" / "device" / "h200_kineto_cuda_3steps.json.gz"
# time.time_ns() taken on the device right after each step's last launch (bench/probes)
MARKS = [1795945441236977465, 1795945441238879221, 1795945441240453879]
MARKER = "distanom_step_marker_vectorized8_kernel"


def device_document() -> dict:
    return json.loads(gzip.decompress(DEVICE_TRACE.read_bytes()))


def kernels(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("cat") == "kernel"]


def test_gpu_events_belong_to_the_step_that_launched_them() -> None:
    document = device_document()
    step1 = cut_step([document], 1, MARKS[0], MARKS[1])
    step2 = cut_step([document], 2, MARKS[1], MARKS[2])
    for trace in (step1, step2):
        names = [e["name"] for e in kernels(trace.events)]
        assert names.count(MARKER) == 1  # each step ends with exactly its own marker
        assert trace.stats["gpu_by_launch"] == trace.stats["gpu_events"] > 10
    ids1 = {e["args"]["correlation"] for e in kernels(step1.events)}
    ids2 = {e["args"]["correlation"] for e in kernels(step2.events)}
    assert ids1.isdisjoint(ids2) and max(ids1) < min(ids2)
    launched_after = {
        e["args"]["correlation"]
        for e in document["traceEvents"]
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and (document["baseTimeNanoseconds"] + e["ts"] * 1000) >= MARKS[0]
    }
    all_kernel_ids = {e["args"]["correlation"] for e in kernels(document["traceEvents"])}
    assert ids1 | ids2 == launched_after & all_kernel_ids
    flows = [e for e in step1.events if e.get("cat") == "ac2g"]
    assert (
        flows
        and {e["id"] for e in flows}
        <= {e["args"]["correlation"] for e in step1.events if e.get("cat") == "cuda_runtime"} | ids1
    )
    assert any(e.get("name") == "distanom step 1" for e in step1.events)


def test_late_kernels_come_from_the_next_window() -> None:
    document = device_document()
    events = document["traceEvents"]
    last_kernel = max(kernels(events), key=lambda e: e["args"]["correlation"])
    first = {**document, "traceEvents": [e for e in events if e is not last_kernel]}
    second = {**document, "traceEvents": [last_kernel]}
    alone = cut_step([first], 2, MARKS[1], MARKS[2])
    joined = cut_step([first, second], 2, MARKS[1], MARKS[2])
    assert joined.stats["gpu_events"] == alone.stats["gpu_events"] + 1


def protocol_members() -> set[str]:
    """Every attribute, property and method the Tracer protocol declares."""
    declared = set(Tracer.__annotations__)
    declared |= {n for n in vars(Tracer) if not n.startswith("_")}
    return declared


def test_implements_the_tracer_protocol() -> None:
    tracer = KinetoTracer(TracerConfig(), use_cuda=False)
    try:
        assert isinstance(tracer, Tracer)
        assert {"tracing", "stats", "boundary_flushes"} <= protocol_members()
        assert all(hasattr(tracer, name) for name in protocol_members())
    finally:
        tracer.close()


def test_live_cpu_windows_and_history(tmp_path: Path) -> None:
    config = TracerConfig(kineto_window_steps=3, history_steps=6)
    tracer = KinetoTracer(config, use_cuda=False)
    x = torch.randn(64, 64)
    tracer.mark_step(0, time.time_ns())
    tracer.start()
    for step in range(1, 14):
        for _ in range(step % 3 + 1):
            x = torch.tanh(x @ x)
        if step == 8:
            time.sleep(0.02)
        tracer.mark_step(step, time.time_ns())
    assert tracer.availability(8) is Availability.READY
    assert tracer.availability(13) is Availability.PENDING  # its window is still open
    assert tracer.availability(2) is Availability.GONE  # older than the history
    trace = tracer.step_trace(8)
    spans = [e for e in trace.events if e.get("ph") == "X"]
    annotation = next(e for e in spans if e["name"] == "distanom step 8")
    assert annotation["dur"] >= 20_000  # the sleep is inside the step
    ops = [e for e in spans if e.get("cat") == "cpu_op"]
    assert ops and all(
        annotation["ts"] <= e["ts"] < annotation["ts"] + annotation["dur"] for e in ops
    )
    assert not any(str(e.get("name", "")).startswith("ProfilerStep#") for e in trace.events)
    tracer.set_tracing(False)  # hands over the partial window
    assert tracer.availability(13) is Availability.READY
    tracer.close()
    assert tracer.availability(8) is Availability.GONE


def test_untraced_boundaries_keep_only_the_history(tmp_path: Path) -> None:
    # off, a mark only notes the boundary (quiet) and forgets the one that left the history
    config = TracerConfig(kineto_window_steps=3, history_steps=6)
    tracer = KinetoTracer(config, use_cuda=False)
    try:
        assert tracer.quiet and not tracer.tracing
        for step in range(0, 50):
            tracer.mark_step(step, time.time_ns())
            kept = sorted(tracer._boundaries)
            assert kept == list(range(max(0, step - 7), step + 1))  # history + 2
        for step in range(60, 200, 5):  # gaps: what they leave behind is swept
            tracer.mark_step(step, time.time_ns())
        assert sorted(tracer._boundaries) == [190, 195]
        assert tracer.boundary_flushes == 0 and tracer.quiet
    finally:
        tracer.close()


def test_a_wall_clock_step_is_flagged_not_fatal(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    config = TracerConfig(kineto_window_steps=2, history_steps=8)
    tracer = KinetoTracer(config, use_cuda=False)
    tracer.mark_step(0, time.time_ns())
    tracer.start()
    for step in range(1, 6):
        torch.randn(32, 32).sum()
        jump = -3600 * 10**9 if step >= 3 else 0  # NTP steps the clock back an hour
        tracer.mark_step(step, time.time_ns() + jump)
    tracer.set_tracing(False)
    trace = tracer.step_trace(3)
    assert trace.stats.get("clock_jump") == 1
    assert "clock_jump" not in tracer.step_trace(2).stats
    tracer.close()


def test_a_window_export_is_parsed_by_orjson_and_json_reads_what_it_refuses(
    tmp_path: Path,
) -> None:
    from distanom.tracers.kineto import _load, _Window

    plain = tmp_path / "plain.json"
    plain.write_text('{"traceEvents": [{"name": "k", "ts": 1.5, "dur": 2}]}')
    window = _Window(0, 0, None, saved=str(plain))
    assert _load(window, str(tmp_path)) == {"traceEvents": [{"name": "k", "ts": 1.5, "dur": 2}]}
    odd = tmp_path / "odd.json"
    odd.write_text('{"traceEvents": [{"name": "k", "ts": NaN}]}')  # orjson refuses NaN
    loaded = _load(_Window(0, 0, None, saved=str(odd)), str(tmp_path))
    assert loaded["traceEvents"][0]["name"] == "k"
    assert math.isnan(loaded["traceEvents"][0]["ts"])
