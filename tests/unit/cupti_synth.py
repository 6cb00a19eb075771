"""Synthetic CUPTI activity records: the writing side of the layouts `cupti.records` reads.

Owns nothing at run time: it is the test double of CUPTI's buffers. It writes kernel
(CUpti_ActivityKernel10, 216 bytes), memcpy (Memcpy6, 96 bytes) and memset (Memset4, 88
bytes) records at the documented offsets into memory at a given address (a ctypes
buffer, or a `BufferPool` buffer), and keeps kernel-name strings alive so records can
point at them, as CUPTI's do. Tests on machines without a GPU use it to exercise
decoding, step selection and the ring; nothing in the tracer imports it.
"""

from __future__ import annotations

import ctypes
import struct

from distanom.tracers.cupti.library import KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET
from distanom.tracers.cupti.records import RECORD_SIZES


class NameBank:
    """NUL-terminated names at stable addresses, like CUPTI's shared kernel-name strings."""

    def __init__(self) -> None:
        self._keep: dict[str, ctypes.Array[ctypes.c_char]] = {}

    def pointer(self, name: str) -> int:
        buf = self._keep.get(name)
        if buf is None:
            buf = ctypes.create_string_buffer(name.encode())
            self._keep[name] = buf
        return ctypes.addressof(buf)


def _memory(address: int, size: int) -> ctypes.Array[ctypes.c_char]:
    return (ctypes.c_char * size).from_address(address)


def write_kernel(
    address: int,
    *,
    start: int,
    end: int,
    correlation: int,
    name_ptr: int,
    device: int = 0,
    context: int = 1,
    stream: int = 7,
    grid: tuple[int, int, int] = (1, 1, 1),
    block: tuple[int, int, int] = (128, 1, 1),
    registers: int = 16,
    static_shared: int = 0,
    dynamic_shared: int = 0,
) -> int:
    """Write one kernel record at `address`; returns its size."""
    size = RECORD_SIZES[KIND_CONCURRENT_KERNEL]
    mem = _memory(address, size)
    ctypes.memset(address, 0, size)
    struct.pack_into("<i", mem, 0, KIND_CONCURRENT_KERNEL)
    struct.pack_into("<H", mem, 6, registers)
    struct.pack_into("<QQQ", mem, 16, start, end, end)  # start, end, completed
    struct.pack_into("<III", mem, 40, device, context, stream)
    struct.pack_into("<iiiiii", mem, 52, *grid, *block)
    struct.pack_into("<ii", mem, 76, static_shared, dynamic_shared)
    struct.pack_into("<I", mem, 92, correlation)
    struct.pack_into("<q", mem, 96, correlation)  # grid_id: any value
    struct.pack_into("<Q", mem, 104, name_ptr)
    return size


def write_memcpy(
    address: int,
    *,
    start: int,
    end: int,
    correlation: int,
    nbytes: int,
    copy_kind: int = 1,
    src_kind: int = 1,
    dst_kind: int = 3,
    device: int = 0,
    context: int = 1,
    stream: int = 7,
) -> int:
    size = RECORD_SIZES[KIND_MEMCPY]
    mem = _memory(address, size)
    ctypes.memset(address, 0, size)
    struct.pack_into("<iBBBB", mem, 0, KIND_MEMCPY, copy_kind, src_kind, dst_kind, 1)
    struct.pack_into("<QQQ", mem, 8, nbytes, start, end)
    struct.pack_into("<IIII", mem, 32, device, context, stream, correlation)
    return size


def write_memset(
    address: int,
    *,
    start: int,
    end: int,
    correlation: int,
    nbytes: int,
    value: int = 0,
    memory_kind: int = 3,
    device: int = 0,
    context: int = 1,
    stream: int = 7,
) -> int:
    size = RECORD_SIZES[KIND_MEMSET]
    mem = _memory(address, size)
    ctypes.memset(address, 0, size)
    struct.pack_into("<iI", mem, 0, KIND_MEMSET, value)
    struct.pack_into("<QQQ", mem, 8, nbytes, start, end)
    struct.pack_into("<IIII", mem, 32, device, context, stream, correlation)
    struct.pack_into("<H", mem, 50, memory_kind)
    return size


class SynthBuffer:
    """A growing run of records in memory this object owns (8-byte aligned)."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self._raw = (ctypes.c_char * (capacity + 8))()
        self.address = (ctypes.addressof(self._raw) + 7) & ~7
        self.capacity = capacity
        self.used = 0

    def _room(self, size: int) -> int:
        if self.used + size > self.capacity:
            raise ValueError("synthetic buffer full")
        at = self.address + self.used
        self.used += size
        return at

    def kernel(self, **fields: int | tuple[int, int, int]) -> None:
        write_kernel(self._room(RECORD_SIZES[KIND_CONCURRENT_KERNEL]), **fields)  # type: ignore[arg-type]

    def memcpy(self, **fields: int) -> None:
        write_memcpy(self._room(RECORD_SIZES[KIND_MEMCPY]), **fields)

    def memset(self, **fields: int) -> None:
        write_memset(self._room(RECORD_SIZES[KIND_MEMSET]), **fields)

    def raw_record(self, kind: int, size: int) -> None:
        """A record of another kind (e.g. CUDA_EVENT, 56 bytes): only its kind is set."""
        at = self._room(size)
        ctypes.memset(at, 0, size)
        struct.pack_into("<i", _memory(at, size), 0, kind)
