"""Kernel names of CUPTI records: reading the char* safely, demangling, caching.

Owns `NameTable` (name pointer -> raw and displayed name, read once per CUPTI attachment),
`SafeMemoryReader` (reads a C string through a pipe, so a bad pointer is an error rather
than a segfault) and the libstdc++ demangler that gives Kineto's readable names. Read by
`records` (marker detection and decoding); nothing here calls CUPTI or imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class SafeMemoryReader:
    """Reads bytes at a raw address without risking a segfault: the bytes go through a
    pipe, so an unmapped address is an EFAULT error rather than a crash. Kernel names
    are char* pointers inside records; if a record were misread, a bad pointer must cost
    one name, not the training job."""

    _PAGE = 4096

    def __init__(self) -> None:
        self._pipe: tuple[int, int] | None = None
        try:
            self._pipe = os.pipe()
        except OSError:
            self._pipe = None

    def read_cstring(self, address: int, limit: int = 1 << 16) -> bytes | None:
        """The NUL-terminated string at `address` (at most `limit` bytes), None if unreadable."""
        if address <= 0:
            return None
        if self._pipe is None:
            return ctypes.string_at(address)[:limit]
        out = bytearray()
        pos = address
        while len(out) < limit:
            # Reads never cross a page boundary: a page is mapped or not as a whole.
            chunk = min(self._PAGE - (pos % self._PAGE), limit - len(out))
            piece = self._read(pos, chunk)
            if piece is None:
                return None
            nul = piece.find(b"\0")
            if nul >= 0:
                out += piece[:nul]
                return bytes(out)
            out += piece
            pos += chunk
        return bytes(out)

    def _read(self, address: int, size: int) -> bytes | None:
        assert self._pipe is not None
        read_fd, write_fd = self._pipe
        source = (ctypes.c_char * size).from_address(address)
        try:
            written = os.write(write_fd, memoryview(source).cast("B"))
        except OSError:
            return None
        data = b""
        while len(data) < written:
            data += os.read(read_fd, written - len(data))
        return data

    def close(self) -> None:
        """Close the pipe (idempotent)."""
        if self._pipe is not None:
            for fd in self._pipe:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._pipe = None


class _Demangler:
    """C++ names → Kineto's readable form through libstdc++'s __cxa_demangle."""

    def __init__(self) -> None:
        self._func: Any = None
        self._free: Any = None
        try:
            cxx = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            func = getattr(cxx, "__cxa_demangle")  # getattr: no private-name mangling
            func.argtypes = [
                ctypes.c_char_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.POINTER(ctypes.c_int),
            ]
            func.restype = ctypes.c_void_p
            free = libc.free
            free.argtypes = [ctypes.c_void_p]
            free.restype = None
            self._func, self._free = func, free
        except (OSError, AttributeError) as err:
            log.info("no C++ demangler (%s): kernel names stay mangled", err)

    def __call__(self, name: str) -> str:
        if self._func is None or not name.startswith("_Z"):
            return name
        status = ctypes.c_int(1)
        ptr = self._func(name.encode(), None, None, ctypes.byref(status))
        if not ptr:
            return name
        try:
            if status.value != 0:
                return name
            return ctypes.string_at(ptr).decode("utf-8", errors="replace")
        finally:
            self._free(ptr)


class NameTable:
    """Kernel-name pointers → names. CUPTI shares one name string per kernel across its
    records, so each pointer is read (and demangled) once per CUPTI attachment (`epoch`):
    after a detach CUPTI may place other names at the same addresses."""

    UNREADABLE = "<unreadable kernel name>"

    def __init__(
        self,
        read_cstring: Callable[[int], bytes | None] | None = None,
        demangle: Callable[[str], str] | None = None,
        max_entries: int = 200_000,
    ) -> None:
        self._reader: SafeMemoryReader | None = None
        if read_cstring is None:
            self._reader = SafeMemoryReader()
            read_cstring = self._reader.read_cstring
        self._read = read_cstring
        self._demangle = demangle if demangle is not None else _Demangler()
        self._raw: dict[int, str] = {}
        self._shown: dict[int, str] = {}
        self._max = max_entries
        self.unreadable = 0

    def raw(self, pointer: int, epoch: int = 0) -> str:
        """The name at `pointer` as CUPTI wrote it (mangled), read once per `epoch`."""
        key = (epoch << 64) | pointer
        name = self._raw.get(key)
        if name is None:
            data = self._read(pointer) if pointer else None
            if data is None:
                self.unreadable += 1
                name = self.UNREADABLE
            else:
                name = data.decode("utf-8", errors="replace")
            if len(self._raw) >= self._max:
                self._raw.clear()
                self._shown.clear()
            self._raw[key] = name
        return name

    def display(self, pointer: int, epoch: int = 0) -> str:
        """The name at `pointer` as Kineto shows it (demangled), cached per `epoch`."""
        key = (epoch << 64) | pointer
        shown = self._shown.get(key)
        if shown is None:
            shown = self._demangle(self.raw(pointer, epoch))
            self._shown[key] = shown
        return shown

    def close(self) -> None:
        """Release the memory reader this table opened, if any."""
        if self._reader is not None:
            self._reader.close()
