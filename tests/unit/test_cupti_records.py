"""Decoding synthetic CUPTI buffers (CUPTI 13.0 layouts) and the Kineto shape of the events."""

from __future__ import annotations

import ctypes
import ctypes.util
import gzip
import json
import mmap
from pathlib import Path
from typing import Any

import pytest

from distanom.tracers.cupti.events import kineto_events
from distanom.tracers.cupti.library import KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET
from distanom.tracers.cupti.names import NameTable, SafeMemoryReader
from distanom.tracers.cupti.records import (
    DecodeStats,
    buffer_view,
    decode_records,
    index_buffer,
    iterate_by_size,
    memcpy_name,
    memset_name,
)
from tests.unit.cupti_synth import NameBank, SynthBuffer

DATA = Path(__file__).resolve().parent.parent / "data"
T0 = 1_795_945_436_000_000_000
MANGLED = (
    "_ZN2at6native29vectorized_elementwise_kernel"
    "ILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_"
)


def _decode(buf: SynthBuffer, names: NameTable) -> tuple[list[Any], DecodeStats]:
    view = buffer_view(buf.address, buf.used)
    stats = DecodeStats()
    return decode_records(view, iterate_by_size(view), names, stats), stats


def test_kernel_memcpy_memset_fields_decode() -> None:
    bank, names, buf = NameBank(), NameTable(), SynthBuffer()
    buf.kernel(
        start=T0 + 1000, end=T0 + 3500, correlation=1819, name_ptr=bank.pointer("gemm_kernel"),
        device=0, context=1, stream=7, grid=(2, 3, 4), block=(128, 2, 1), registers=18,
        static_shared=1024, dynamic_shared=512,
    )  # fmt: skip
    buf.memcpy(start=T0 + 4000, end=T0 + 4800, correlation=1820, nbytes=1024, stream=13)
    buf.memset(start=T0 + 5000, end=T0 + 5832, correlation=1821, nbytes=8, memory_kind=3)
    recs, stats = _decode(buf, names)
    assert [r.kind for r in recs] == [KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET]
    k, c, s = recs
    assert (k.start_ns, k.end_ns, k.correlation, k.stream, k.context) == (
        T0 + 1000,
        T0 + 3500,
        1819,
        7,
        1,
    )
    assert (k.grid, k.block, k.registers, k.shared_memory) == ((2, 3, 4), (128, 2, 1), 18, 1536)
    assert k.name == "gemm_kernel"
    assert (c.bytes, c.stream, c.correlation, c.name) == (
        1024,
        13,
        1820,
        "Memcpy HtoD (Pageable -> Device)",
    )
    assert (s.bytes, s.name, s.correlation) == (8, "Memset (Device)", 1821)
    assert stats.counts == {KIND_CONCURRENT_KERNEL: 1, KIND_MEMCPY: 1, KIND_MEMSET: 1}
    assert stats.zero_timestamp == stats.end_before_start == 0


def test_invalid_timestamps_are_dropped_and_counted() -> None:
    bank, names, buf = NameBank(), NameTable(), SynthBuffer()
    p = bank.pointer("k")
    buf.kernel(start=0, end=T0, correlation=1, name_ptr=p)
    buf.kernel(start=T0, end=0, correlation=2, name_ptr=p)
    buf.memcpy(start=0, end=0, correlation=3, nbytes=4)
    buf.kernel(start=T0 + 10, end=T0 + 5, correlation=4, name_ptr=p)
    buf.kernel(start=T0, end=T0 + 5, correlation=5, name_ptr=p)
    recs, stats = _decode(buf, names)
    assert [r.correlation for r in recs] == [5]
    assert stats.zero_timestamp == 3
    assert stats.end_before_start == 1


def test_kernel_names_are_demangled_like_kineto() -> None:
    if ctypes.util.find_library("stdc++") is None:
        pytest.skip("no libstdc++ here")
    names = NameTable()
    bank = NameBank()
    shown = names.display(bank.pointer(MANGLED))
    assert shown.startswith(
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>"
    )
    assert names.display(bank.pointer("distanom_step_marker_vectorized8_kernel")) == (
        "distanom_step_marker_vectorized8_kernel"
    )
    assert names.raw(bank.pointer(MANGLED)) == MANGLED


def test_unreadable_name_pointer_does_not_crash() -> None:
    names = NameTable()
    assert names.raw(8) == NameTable.UNREADABLE  # the first page is never mapped
    assert names.raw(0) == NameTable.UNREADABLE
    assert names.unreadable == 2


def test_safe_reader_reads_across_a_page_boundary() -> None:
    with mmap.mmap(-1, 2 * mmap.PAGESIZE) as mm:
        text = b"kernel_name_crossing_the_page"
        at = mmap.PAGESIZE - 10
        mm[at : at + len(text) + 1] = text + b"\0"
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        reader = SafeMemoryReader()
        try:
            assert reader.read_cstring(base + at) == text
            assert reader.read_cstring(base + at, limit=6) == text[:6]
        finally:
            reader.close()
        del base


def test_index_finds_markers_kinds_and_skips_other_records() -> None:
    bank, names, buf = NameBank(), NameTable(), SynthBuffer()
    marker = bank.pointer("distanom_step_marker_vectorized8_kernel")
    buf.kernel(start=T0, end=T0 + 10, correlation=10, name_ptr=bank.pointer("a"))
    buf.kernel(
        start=T0 + 20, end=T0 + 25, correlation=11, name_ptr=marker, grid=(9, 1, 1), stream=7
    )
    buf.raw_record(36, 56)  # CUDA_EVENT: not enabled by distanom, skipped
    buf.memcpy(start=T0 + 30, end=T0 + 40, correlation=12, nbytes=4)
    view = buffer_view(buf.address, buf.used)

    def iterate(v: Any) -> list[int]:
        return [0, 216, 432, 488]

    idx = index_buffer(
        view, iterate(view), 3, names, lambda n: n.startswith("distanom_step_marker")
    )
    assert idx.kinds.tolist() == [KIND_CONCURRENT_KERNEL, KIND_CONCURRENT_KERNEL, KIND_MEMCPY]
    assert idx.correlation.tolist() == [10, 11, 12]
    assert idx.other_kinds == 1
    assert len(idx.markers) == 1
    m = idx.markers[0]
    assert (m.correlation, m.grid_x, m.start_ns, m.end_ns, m.stream, m.buffer_seq) == (
        11, 9, T0 + 20, T0 + 25, 7, 3,
    )  # fmt: skip
    assert (idx.min_correlation, idx.max_correlation) == (10, 12)


def test_truncated_record_is_skipped() -> None:
    bank, names, buf = NameBank(), NameTable(), SynthBuffer()
    buf.kernel(start=T0, end=T0 + 10, correlation=10, name_ptr=bank.pointer("a"))
    buf.kernel(start=T0, end=T0 + 10, correlation=11, name_ptr=bank.pointer("b"))
    view = buffer_view(buf.address, 216 + 100)  # the second record is cut off
    idx = index_buffer(view, [0, 216], 0, names, lambda n: False)
    assert idx.correlation.tolist() == [10]
    assert idx.other_kinds == 1


def test_memcpy_and_memset_names_match_kineto() -> None:
    assert memcpy_name(1, 1, 3) == "Memcpy HtoD (Pageable -> Device)"
    assert memcpy_name(2, 3, 2) == "Memcpy DtoH (Device -> Pinned)"
    assert memcpy_name(8, 3, 3) == "Memcpy DtoD (Device -> Device)"
    assert memcpy_name(99, 42, 3) == "Memcpy Unknown (Unknown -> Device)"
    assert memset_name(3) == "Memset (Device)"


def _our_events() -> list[dict[str, Any]]:
    bank, names, buf = NameBank(), NameTable(), SynthBuffer()
    buf.kernel(
        start=T0 + 1_000, end=T0 + 2_024, correlation=1819, name_ptr=bank.pointer("k"),
        grid=(2, 1, 1), block=(128, 1, 1), registers=18,
    )  # fmt: skip
    buf.memcpy(start=T0 + 3_000, end=T0 + 3_800, correlation=1820, nbytes=1024)
    buf.memset(start=T0 + 5_000, end=T0 + 5_832, correlation=1821, nbytes=8)
    recs, _ = _decode(buf, names)
    return kineto_events(recs, T0, num_sms=132)


def test_events_have_kinetos_shape() -> None:
    events = _our_events()
    spans = [e for e in events if e["ph"] == "X"]
    k = next(e for e in spans if e["cat"] == "kernel")
    assert k["ts"] == 1.0 and k["dur"] == 1.024
    assert (k["pid"], k["tid"]) == (0, 7)
    assert k["args"]["correlation"] == 1819
    assert k["args"]["grid"] == [2, 1, 1] and k["args"]["block"] == [128, 1, 1]
    assert k["args"]["blocks per SM"] == 0.015152  # Kineto's value for grid 2 on 132 SMs
    assert k["args"]["warps per SM"] == 0.060606
    ms = next(e for e in spans if e["cat"] == "gpu_memset")
    assert ms["name"] == "Memset (Device)"
    assert ms["args"]["memory bandwidth (GB/s)"] == pytest.approx(0.009615384615384616)
    mc = next(e for e in spans if e["cat"] == "gpu_memcpy")
    assert mc["args"]["bytes"] == 1024
    meta = {(e["name"], e["pid"], e["tid"]): e["args"] for e in events if e["ph"] == "M"}
    assert meta[("thread_name", 0, 7)] == {"name": "stream 7 "}
    assert meta[("process_labels", 0, 0)] == {"labels": "GPU 0"}
    assert meta[("process_sort_index", 0, 0)] == {"sort_index": 5000000}
    assert json.loads(json.dumps(events)) == events  # plain JSON


def test_event_keys_match_a_real_h200_kineto_trace() -> None:
    with gzip.open(DATA / "device" / "h200_kineto_cuda_3steps.json.gz", "rt") as fh:
        kineto = json.load(fh)["traceEvents"]
    ours = _our_events()
    # Kineto extras we do not produce: 'queued' (needs CUPTI's queued timestamps) and the
    # occupancy estimate (needs cudaOccupancy*); everything else must be present.
    optional = {"queued", "est. achieved occupancy %"}
    for cat in ("kernel", "gpu_memset"):
        theirs = next(e for e in kineto if e.get("cat") == cat and e.get("ph") == "X")
        mine = next(e for e in ours if e.get("cat") == cat)
        assert set(mine) == set(theirs), cat
        assert set(theirs["args"]) - optional == set(mine["args"]), cat
        for key in ("pid", "tid", "ts", "dur"):
            assert type(mine[key]) is type(theirs[key]), (cat, key)
    for name in ("thread_name", "process_labels", "process_sort_index", "thread_sort_index"):
        theirs = next(e for e in kineto if e.get("ph") == "M" and e.get("name") == name)
        mine = next(e for e in ours if e.get("ph") == "M" and e.get("name") == name)
        assert set(mine) == set(theirs), name
        assert set(mine["args"]) == set(theirs["args"]), name


def test_walking_by_size_refuses_a_buffer_it_would_misalign() -> None:
    import numpy as np

    view = np.zeros(216 + 96 + 2, dtype=np.uint8)
    view[0:4] = np.frombuffer(np.int32(10).tobytes(), dtype=np.uint8)  # kernel, 216 bytes
    view[216:220] = np.frombuffer(np.int32(1).tobytes(), dtype=np.uint8)  # memcpy, 96 bytes
    with pytest.raises(ValueError, match="valid size is 314"):
        iterate_by_size(view)  # 2 stray bytes at the end: the sizes do not fit the buffer
    assert iterate_by_size(view[:312]) == [0, 216]


def test_names_are_cached_per_cupti_attachment() -> None:
    # After a detach CUPTI may put another kernel's name at an address it used before.
    memory = {0x1000: b"gemm_kernel"}
    table = NameTable(read_cstring=lambda p: memory.get(p), demangle=lambda s: s)
    assert table.raw(0x1000, 0) == "gemm_kernel"
    memory[0x1000] = b"distanom_step_marker"
    assert table.raw(0x1000, 0) == "gemm_kernel"  # same attachment: cached
    assert table.display(0x1000, 1) == "distanom_step_marker"  # next one: read again
