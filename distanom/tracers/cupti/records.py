"""CUPTI activity record layouts: walking a buffer, indexing it, decoding its records.

Owns the record layouts distanom relies on (the prefix fields of CUPTI 13.0's
CUpti_ActivityKernel10, CUpti_ActivityMemcpy6 and CUpti_ActivityMemset4, which have kept
their offsets across record versions), the walk by record size (`iterate_by_size`), the
per-buffer index (`index_buffer`: where each record is, its kind and correlation id, and
the step-marker kernels), and the full decoding of selected records (`decode_records`)
with validation (records with a zero timestamp or an end before their start are dropped
and counted). Decoded `GpuActivity` values go to `events`, which shapes them for Kineto.

Pure: it reads memory it is given and never calls CUPTI. How records are found in a
buffer is injected (`RecordIterator`): the tracer walks by the record sizes (checked
against cuptiActivityGetNextRecord when it starts), so that reading needs no CUPTI call
while CUPTI is detached; tests use it over synthetic buffers. Kernel names are read
through a `NameTable` (see `names`) from the char* in each kernel record.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from distanom.tracers.cupti.library import KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET
from distanom.tracers.cupti.names import NameTable

# Full record sizes on CUPTI 13.0: `iterate_by_size` walks buffers by them, which the
# tracer does only once calibration found them equal to cuptiActivityGetNextRecord's walk.
RECORD_SIZES: dict[int, int] = {KIND_CONCURRENT_KERNEL: 216, KIND_MEMCPY: 96, KIND_MEMSET: 88}

# Bytes of each record distanom reads (through the name pointer, the correlation id,
# the memory kind): a record is only used when that much of it lies in the buffer.
_MIN_READ = {KIND_CONCURRENT_KERNEL: 112, KIND_MEMCPY: 48, KIND_MEMSET: 52}

# Kernel10: registers_per_thread u16 @6; start,end u64 @16; device,context,stream u32 @40;
# grid xyz, block xyz, static smem, dynamic smem i32 @52..80; correlation u32 @92; name @104.
_K_REGS = struct.Struct("<H")
_K_TIMES = struct.Struct("<QQ")
_K_IDS_SHAPE = struct.Struct("<IIIiiiiiiii")
_K_CORR = struct.Struct("<I")
_K_NAME = struct.Struct("<Q")
# Memcpy6: copy/src/dst kind u8 @4; bytes,start,end u64 @8; device,context,stream,corr u32 @32.
_MC_KINDS = struct.Struct("<BBB")
_X_BYTES_TIMES = struct.Struct("<QQQ")  # shared by Memcpy6 and Memset4 @8
_X_IDS = struct.Struct("<IIII")  # shared by Memcpy6 and Memset4 @32
# Memset4: value u32 @4; memory_kind u16 @50.
_MS_VALUE = struct.Struct("<I")
_MS_MEMKIND = struct.Struct("<H")

MEMCPY_KIND_NAMES = {
    0: "Unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA",
    6: "AtoD", 7: "DtoA", 8: "DtoD", 9: "HtoH", 10: "PtoP",
}  # fmt: skip
MEMORY_KIND_NAMES = {
    0: "Unknown", 1: "Pageable", 2: "Pinned", 3: "Device", 4: "Array",
    5: "Managed", 6: "Device Static", 7: "Managed Static",
}  # fmt: skip

RecordIterator = Callable[[int, int], Sequence[int]]
"""(buffer address, valid size) → offsets of the records in the buffer, in order."""

U8Array = npt.NDArray[np.uint8]
I64Array = npt.NDArray[np.int64]


def buffer_view(address: int, valid_size: int) -> U8Array:
    """A zero-copy uint8 view of `valid_size` bytes at `address` (caller keeps it alive)."""
    if valid_size <= 0:
        return np.zeros(0, dtype=np.uint8)
    raw = (ctypes.c_uint8 * valid_size).from_address(address)
    return np.ctypeslib.as_array(raw)


def iterate_by_size(view: U8Array) -> list[int]:
    """Walk a buffer by the known record sizes. Raises ValueError on a kind it does not
    know (it could not find the next record) and when the records do not end exactly at
    the buffer's valid size (a wrong size would misalign every later record)."""
    offsets: list[int] = []
    append = offsets.append
    data = view.tobytes()
    end = len(data)
    # Records start 8-byte aligned, so each kind is one int32 of this view: indexing it
    # is ~3x faster than struct.unpack_from, and this loop holds the GIL (the training
    # thread waits) for every record of every buffer a capture has to walk.
    kinds = memoryview(data)[: end - end % 4].cast("i")
    sizes = RECORD_SIZES
    pos = 0
    while pos + 4 <= end:
        size = sizes.get(kinds[pos >> 2])
        if size is None:
            raise ValueError(f"unknown record kind {kinds[pos >> 2]} at offset {pos}")
        append(pos)
        pos += size
    if pos != end:
        raise ValueError(f"records end at {pos}, the buffer's valid size is {end}")
    return offsets


@dataclass(frozen=True)
class MarkerRecord:
    """A step-marker kernel as CUPTI recorded it."""

    correlation: int
    grid_x: int
    start_ns: int
    end_ns: int
    device: int
    stream: int
    buffer_seq: int


@dataclass(frozen=True)
class BufferIndex:
    """Where the records of one completed buffer are, and which are step markers.

    Small (12 bytes a record) and cached per buffer, so a buffer is walked once.
    """

    seq: int
    offsets: I64Array
    kinds: npt.NDArray[np.int32]
    correlation: I64Array
    markers: tuple[MarkerRecord, ...]
    other_kinds: int  # records of kinds distanom did not enable (skipped)

    @property
    def min_correlation(self) -> int:
        """The smallest correlation id in the buffer (0 if it has no records)."""
        return int(self.correlation.min()) if len(self.correlation) else 0

    @property
    def max_correlation(self) -> int:
        """The largest correlation id in the buffer (0 if it has no records)."""
        return int(self.correlation.max()) if len(self.correlation) else 0


def _gather(view: U8Array, positions: I64Array, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """Little-endian values of `dtype` at each byte position (vectorised)."""
    dt = np.dtype(dtype).newbyteorder("<")
    if len(positions) == 0:
        return np.zeros(0, dtype=dt)
    idx = positions[:, None] + np.arange(dt.itemsize, dtype=np.int64)
    out: npt.NDArray[Any] = np.ascontiguousarray(view[idx]).view(dt).reshape(-1)
    return out


# CUPTI's correlation ids are 32-bit and only known to increase within one attachment of
# CUPTI: indexes order records by epoch * EPOCH_CORRELATION_STRIDE + correlation.
EPOCH_CORRELATION_STRIDE = 1 << 32


def index_buffer(
    view: U8Array,
    offsets: Sequence[int],
    seq: int,
    names: NameTable,
    is_marker: Callable[[str], bool],
    epoch: int = 0,
) -> BufferIndex:
    """Index a buffer: kind and correlation id of every record, and its marker kernels.

    Records of other kinds are counted and skipped; so is a record that would run past
    the valid end of the buffer (it cannot be read whole). Correlation ids are offset by
    the buffer's attachment `epoch` (see EPOCH_CORRELATION_STRIDE)."""
    offs = np.asarray(offsets, dtype=np.int64)
    if len(offs) and (int(offs.min()) < 0 or int(offs.max()) + 4 > len(view)):
        raise ValueError("record offset outside the buffer")
    kinds = _gather(view, offs, np.int32).astype(np.int32)
    need = np.zeros(len(kinds), dtype=np.int64)
    for kind, size in _MIN_READ.items():
        need[kinds == kind] = size
    usable = (need > 0) & (offs + need <= len(view))
    other = int((~usable).sum())
    offs, kinds = offs[usable], kinds[usable]
    corr_off = np.where(kinds == KIND_CONCURRENT_KERNEL, 92, 44).astype(np.int64)
    corr = _gather(view, offs + corr_off, np.uint32).astype(np.int64)
    corr += int(epoch) * EPOCH_CORRELATION_STRIDE

    markers: list[MarkerRecord] = []
    kern = np.nonzero(kinds == KIND_CONCURRENT_KERNEL)[0]
    if len(kern):
        name_ptrs = _gather(view, offs[kern] + 104, np.uint64)
        marker_ptrs = {int(p) for p in np.unique(name_ptrs) if is_marker(names.raw(int(p), epoch))}
        if marker_ptrs:
            data = view.data
            wanted = np.array(sorted(marker_ptrs), dtype=np.uint64)
            for i in kern[np.isin(name_ptrs, wanted)]:
                base = int(offs[i])
                start, end = _K_TIMES.unpack_from(data, base + 16)
                dev, _ctx, stream, grid_x = struct.unpack_from("<IIIi", data, base + 40)
                markers.append(MarkerRecord(int(corr[i]), grid_x, start, end, dev, stream, seq))
    return BufferIndex(seq, offs, kinds, corr, tuple(markers), other)


# ---------------------------------------------------------------------------------------
# Full decoding


@dataclass(frozen=True)
class GpuActivity:
    """One kernel, memcpy or memset, decoded."""

    kind: int
    start_ns: int
    end_ns: int
    device: int
    context: int
    stream: int
    correlation: int
    name: str
    grid: tuple[int, int, int] = (0, 0, 0)
    block: tuple[int, int, int] = (0, 0, 0)
    registers: int = 0
    shared_memory: int = 0
    bytes: int = 0
    copy_kind: int = 0
    src_kind: int = 0
    dst_kind: int = 0
    memory_kind: int = 0
    value: int = 0


@dataclass
class DecodeStats:
    """What decoding dropped, by reason."""

    zero_timestamp: int = 0
    end_before_start: int = 0
    unknown_kind: int = 0
    counts: dict[int, int] = field(default_factory=dict)  # kept records per kind


def memcpy_name(copy_kind: int, src: int, dst: int) -> str:
    """Kineto's memcpy event name, e.g. 'Memcpy HtoD (Pageable -> Device)'."""
    return (
        f"Memcpy {MEMCPY_KIND_NAMES.get(copy_kind, 'Unknown')} "
        f"({MEMORY_KIND_NAMES.get(src, 'Unknown')} -> {MEMORY_KIND_NAMES.get(dst, 'Unknown')})"
    )


def memset_name(memory_kind: int) -> str:
    """Kineto's memset event name, e.g. 'Memset (Device)'."""
    return f"Memset ({MEMORY_KIND_NAMES.get(memory_kind, 'Unknown')})"


def decode_record(
    view: memoryview, offset: int, names: NameTable, epoch: int = 0
) -> GpuActivity | None:
    """Decode one record (None for a kind distanom does not trace). `view` is the
    buffer's bytes (e.g. `buffer_view(...).data`)."""
    (kind,) = struct.unpack_from("<i", view, offset)
    if kind == KIND_CONCURRENT_KERNEL:
        (regs,) = _K_REGS.unpack_from(view, offset + 6)
        start, end = _K_TIMES.unpack_from(view, offset + 16)
        dev, ctx, stream, gx, gy, gz, bx, by, bz, smem_s, smem_d = _K_IDS_SHAPE.unpack_from(
            view, offset + 40
        )
        (corr,) = _K_CORR.unpack_from(view, offset + 92)
        (name_ptr,) = _K_NAME.unpack_from(view, offset + 104)
        return GpuActivity(
            kind, start, end, dev, ctx, stream, corr, names.display(name_ptr, epoch),
            grid=(gx, gy, gz), block=(bx, by, bz), registers=regs, shared_memory=smem_s + smem_d,
        )  # fmt: skip
    if kind == KIND_MEMCPY:
        copy_kind, src, dst = _MC_KINDS.unpack_from(view, offset + 4)
        nbytes, start, end = _X_BYTES_TIMES.unpack_from(view, offset + 8)
        dev, ctx, stream, corr = _X_IDS.unpack_from(view, offset + 32)
        return GpuActivity(
            kind, start, end, dev, ctx, stream, corr, memcpy_name(copy_kind, src, dst),
            bytes=nbytes, copy_kind=copy_kind, src_kind=src, dst_kind=dst,
        )  # fmt: skip
    if kind == KIND_MEMSET:
        (value,) = _MS_VALUE.unpack_from(view, offset + 4)
        nbytes, start, end = _X_BYTES_TIMES.unpack_from(view, offset + 8)
        dev, ctx, stream, corr = _X_IDS.unpack_from(view, offset + 32)
        (memory_kind,) = _MS_MEMKIND.unpack_from(view, offset + 50)
        return GpuActivity(
            kind, start, end, dev, ctx, stream, corr, memset_name(memory_kind),
            bytes=nbytes, memory_kind=memory_kind, value=value,
        )  # fmt: skip
    return None


def decode_records(
    view: U8Array,
    offsets: Iterable[int],
    names: NameTable,
    stats: DecodeStats,
    epoch: int = 0,
) -> list[GpuActivity]:
    """Decode and validate records; invalid ones are counted in `stats`, not returned."""
    out: list[GpuActivity] = []
    data = view.data
    for offset in offsets:
        rec = decode_record(data, int(offset), names, epoch)
        if rec is None:
            stats.unknown_kind += 1
            continue
        if rec.start_ns == 0 or rec.end_ns == 0:
            # CUPTI leaves timestamps at 0 when it could not time a record (e.g. a forced
            # flush of an unfinished kernel): there is nothing to place on a timeline.
            stats.zero_timestamp += 1
            continue
        if rec.end_ns < rec.start_ns:
            stats.end_before_start += 1
            continue
        stats.counts[rec.kind] = stats.counts.get(rec.kind, 0) + 1
        out.append(rec)
    return out
