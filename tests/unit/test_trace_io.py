"""Trace loading: formats, strictness, bounded decompression, compact contents, links."""

from __future__ import annotations

import gc
import gzip
import json
import time
from pathlib import Path
from typing import Any

import pytest

from distanom.analysis.trace_io import (
    DEFAULT_MAX_BYTES,
    GpuEvent,
    HostEvent,
    load_trace,
    read_trace_document,
    trace_from_document,
)
from distanom.errors import TraceFormatError
from tests.unit.tracegen import gpu, host, launch, make_trace

DATA = Path(__file__).resolve().parents[1] / "data"
H200 = DATA / "h200_resnet18_b5_anomalous_step.json.gz"
MI300X = DATA / "mi300x_resnet_act_checkpoint.json.gz"
GPU_FIXTURES = sorted(p for p in DATA.glob("*.json.gz") if not p.name.startswith("cpu_"))


def _raw_events(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        events: list[dict[str, Any]] = json.load(handle)["traceEvents"]
    return events


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _error(path: Path, **kwargs: Any) -> str:
    with pytest.raises(TraceFormatError) as info:
        load_trace(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    return message


# ------------------------------------------------------------------ real traces


@pytest.mark.parametrize("path", GPU_FIXTURES, ids=lambda p: p.name)
def test_fixture_keeps_exactly_the_gpu_events(path: Path) -> None:
    raw = _raw_events(path)
    expected = [e for e in raw if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    trace = load_trace(path)
    assert len(trace.gpu_events) == len(expected)
    assert all(isinstance(e, GpuEvent) for e in trace.gpu_events)
    first, got = expected[0], trace.gpu_events[0]
    assert (got.cat, got.name, got.ts, got.dur) == (
        first["cat"],
        first["name"],
        first["ts"],
        first["dur"],
    )
    assert got.stream == first["args"]["stream"]
    assert got.correlation == first["args"]["correlation"]
    assert trace.source == str(path)


def test_fixture_metadata_and_host_spans() -> None:
    trace = load_trace(MI300X)
    assert trace.distributed_info is not None
    assert trace.distributed_info["rank"] == 0
    assert trace.distributed_info["world_size"] == 8
    assert trace.base_time_ns == 1767189312000000000
    assert trace.device_properties[0]["name"] == "AMD Instinct MI300X"
    raw = _raw_events(MI300X)
    spans = [e for e in raw if e.get("cat") in ("cpu_op", "user_annotation") and e["ph"] == "X"]
    assert len(trace.host_events) == len(spans)
    assert all(isinstance(e, HostEvent) for e in trace.host_events)
    assert {e.cat for e in trace.host_events} == {"cpu_op", "user_annotation"}

    h200 = load_trace(H200)
    assert h200.distributed_info is None
    assert h200.host_events == ()
    assert h200.device_properties[0]["name"] == "NVIDIA H200"


def test_fixture_links_unlinked_nccl_kernels() -> None:
    # Reference §4: the first five NCCL kernels of the MI300X trace have no launch event.
    trace = load_trace(MI300X)
    nccl = [e for e in trace.gpu_events if e.cat == "kernel" and "nccl" in e.name]
    assert [e.link for e in nccl[:5]] == [None] * 5
    assert all(e.link == "runtime" for e in nccl[5:])
    h200 = load_trace(H200)
    kernels = [e for e in h200.gpu_events if e.cat == "kernel"]
    assert {e.link for e in kernels} == {"runtime"}


def test_read_trace_document_returns_every_event() -> None:
    doc = read_trace_document(MI300X)
    assert len(doc["traceEvents"]) == len(_raw_events(MI300X))
    assert doc["distributedInfo"]["backend"] == "nccl"


# ------------------------------------------------------------------ formats


def test_gzip_detected_by_magic_not_suffix(tmp_path: Path) -> None:
    body = json.dumps({"traceEvents": [gpu("k", 0.0, 5.0)]}).encode()
    gz_named_json = _write(tmp_path / "a.json", gzip.compress(body))
    plain_named_gz = _write(tmp_path / "b.json.gz", body)
    no_suffix = _write(tmp_path / "c.trace", gzip.compress(body))
    for path in (gz_named_json, plain_named_gz, no_suffix):
        trace = load_trace(path)
        assert [e.name for e in trace.gpu_events] == ["k"]


def test_trace_from_document_matches_load(tmp_path: Path) -> None:
    doc = {"traceEvents": launch("k", 10.0, 5.0, 1), "baseTimeNanoseconds": 7}
    path = _write(tmp_path / "t.json", json.dumps(doc).encode())
    assert load_trace(path).gpu_events == trace_from_document(doc, "x").gpu_events
    assert trace_from_document(doc, "x").base_time_ns == 7


# ------------------------------------------------------------------ bad input


def test_missing_file(tmp_path: Path) -> None:
    assert "no such file" in _error(tmp_path / "nope.json.gz")


def test_directory(tmp_path: Path) -> None:
    assert "directory" in _error(tmp_path)


def test_truncated_gzip(tmp_path: Path) -> None:
    data = H200.read_bytes()
    path = _write(tmp_path / "cut.json.gz", data[: len(data) // 2])
    assert "truncated gzip" in _error(path)


def test_damaged_gzip(tmp_path: Path) -> None:
    data = bytearray(gzip.compress(b'{"traceEvents": []}' * 100))
    data[3] = 0xFF  # reserved flag bits set: not a valid gzip header
    path = _write(tmp_path / "bad.json.gz", bytes(data))
    assert "gzip" in _error(path)


def test_not_json(tmp_path: Path) -> None:
    assert "not valid JSON" in _error(_write(tmp_path / "t.json", b"hello, world"))


def test_gzip_of_not_json(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json.gz", gzip.compress(b"\x00\x01 not json"))
    assert "gzip content is not valid JSON" in _error(path)


def test_empty_file(tmp_path: Path) -> None:
    assert "not valid JSON (no content)" in _error(_write(tmp_path / "t.json", b""))


def test_gc_is_restored_after_loads() -> None:
    assert gc.isenabled()
    load_trace(H200)
    assert gc.isenabled()
    gc.disable()
    try:
        load_trace(H200)
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()


def test_nan_constant_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", b'{"traceEvents": [], "x": NaN}')
    assert "NaN" in _error(path)


def test_json_list(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", b'[{"traceEvents": []}]')
    assert "top level is a JSON array, not an object" in _error(path)


def test_no_trace_events(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", b'{"schemaVersion": 1}')
    assert "no 'traceEvents' list" in _error(path)
    path = _write(tmp_path / "u.json", b'{"traceEvents": {"a": 1}}')
    assert "no 'traceEvents' list" in _error(path)


def test_event_not_an_object(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", b'{"traceEvents": [{"cat": "x"}, 3]}')
    assert "traceEvents[1] is not an object" in _error(path)


def test_gpu_event_without_duration(tmp_path: Path) -> None:
    event = gpu("k", 1.0, 2.0)
    del event["dur"]
    path = _write(tmp_path / "t.json", json.dumps({"traceEvents": [event]}).encode())
    assert "no valid ts/dur" in _error(path)
    event["dur"] = -1.0
    path = _write(tmp_path / "u.json", json.dumps({"traceEvents": [event]}).encode())
    assert "no valid ts/dur" in _error(path)


def test_empty_trace_events_loads_with_no_events(tmp_path: Path) -> None:
    # The "no GPU events" error comes at table time (test_tables / test_engine).
    trace = load_trace(_write(tmp_path / "t.json", b'{"traceEvents": []}'))
    assert trace.gpu_events == ()
    assert trace.host_events == ()


def test_gzip_bomb_stops_at_the_cap(tmp_path: Path) -> None:
    bomb = gzip.compress(b"0" * (50 * 1024 * 1024), compresslevel=9)
    path = _write(tmp_path / "bomb.json.gz", bomb)
    assert len(bomb) < 1024 * 1024
    start = time.perf_counter()
    message = _error(path, max_bytes=1024 * 1024)
    assert "more than the limit of 1048576 bytes" in message
    assert time.perf_counter() - start < 5.0


def test_plain_file_over_the_cap(tmp_path: Path) -> None:
    path = _write(tmp_path / "big.json", b'{"traceEvents": []}' + b" " * 100)
    assert "larger than the limit of 50 bytes" in _error(path, max_bytes=50)
    assert load_trace(path, max_bytes=200).gpu_events == ()


def test_cap_is_exact(tmp_path: Path) -> None:
    body = b'{"traceEvents": []}'
    path = _write(tmp_path / "t.json.gz", gzip.compress(body))
    assert load_trace(path, max_bytes=len(body)).gpu_events == ()
    _error(path, max_bytes=len(body) - 1)
    assert DEFAULT_MAX_BYTES == 2 * 1024**3


# ------------------------------------------------------------------ links


def test_launch_with_flows_is_runtime() -> None:
    trace = make_trace(launch("k", 10.0, 5.0, 1))
    assert trace.gpu_events[0].link == "runtime"


def test_launch_without_flows_is_unlinked() -> None:
    trace = make_trace(launch("k", 10.0, 5.0, 1, flows=False))
    assert trace.gpu_events[0].link is None


def test_flow_end_elsewhere_is_unlinked() -> None:
    events = launch("k", 10.0, 5.0, 1)
    events[-1]["tid"] = 99  # flow end not at the kernel's pid/tid
    assert make_trace(events).gpu_events[0].link is None


def test_kernel_without_launch_event_is_unlinked() -> None:
    trace = make_trace([gpu("k", 0.0, 1.0, corr=5), *launch("j", 10.0, 5.0, 1)])
    assert [e.link for e in trace.gpu_events] == [None, "runtime"]


def test_graph_launch_links_without_flows() -> None:
    events = [
        *launch("g1", 10.0, 5.0, 3, launcher="cudaGraphLaunch", flows=False),
        gpu("g2", 20.0, 5.0, corr=3),
    ]
    trace = make_trace(events)
    assert [e.link for e in trace.gpu_events] == ["graph", "graph"]


def test_graph_named_launcher_with_flows_is_graph() -> None:
    trace = make_trace(launch("k", 10.0, 5.0, 1, launcher="cudaGraphLaunch_v10000"))
    assert trace.gpu_events[0].link == "graph"


def test_external_id_key_when_first_launch_lacks_correlation() -> None:
    events: list[dict[str, Any]] = [
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "hipLaunchKernel",
            "pid": 1,
            "tid": 1,
            "ts": 0.0,
            "dur": 1.0,
            "args": {"External id": 9},
        },
        {"ph": "s", "id": 9, "pid": 1, "tid": 1, "ts": 0.0, "cat": "ac2g"},
        {"ph": "f", "id": 9, "pid": 0, "tid": 7, "ts": 5.0, "cat": "ac2g"},
        {
            "ph": "X",
            "cat": "kernel",
            "name": "k",
            "pid": 0,
            "tid": 7,
            "ts": 5.0,
            "dur": 1.0,
            "args": {"stream": 7, "External id": 9, "correlation": 1},
        },
    ]
    trace = make_trace(events)
    assert trace.gpu_events[0].link == "runtime"
    assert trace.gpu_events[0].external_id == 9


def test_missing_stream_and_host_spans() -> None:
    trace = make_trace(
        [
            gpu("k", 0.0, 1.0, stream=None),
            host("aten::mm", 0.0, 2.0),
            host("ann", 0.0, 2.0, cat="user_annotation"),
            host("py", 0.0, 2.0, cat="python_function"),
            {"ph": "i", "cat": "cpu_op", "name": "instant", "ts": 0.0},
        ]
    )
    assert trace.gpu_events[0].stream is None
    assert [e.name for e in trace.host_events] == ["aten::mm", "ann"]


def test_analyze_refuses_the_reports_merged_trace_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # every rank in one document: one table of it would add the ranks' times together
    from distanom.cli import main as cli_main

    doc: dict[str, Any] = {"traceEvents": [gpu("k", 0.0, 5.0)]}
    doc["distanom"] = {"merged": True, "step": 3, "ranks": {"0": "a", "1": "a"}}
    merged = tmp_path / "merged.trace.json.gz"
    merged.write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(TraceFormatError, match="a merged trace of 2 ranks"):
        load_trace(merged)
    capsys.readouterr()
    assert cli_main(["analyze", str(merged)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "merged trace of 2 ranks" in line and "rank<R>.trace.json.gz" in line
    # the same document without the mark is one rank's trace, analyzed as before
    del doc["distanom"]
    single = tmp_path / "rank0.trace.json.gz"
    single.write_bytes(gzip.compress(json.dumps(doc).encode()))
    assert load_trace(single).gpu_events
