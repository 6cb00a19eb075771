"""The bounded pool of raw buffers CUPTI writes activity records into.

Owns the buffers themselves (aligned ctypes memory), their life cycle (free -> held by
CUPTI -> completed -> recycled), the ring's eviction rule and its counters. CUPTI's
callbacks (see `callbacks`) call `BufferPool.request` and `BufferPool.complete`; the
completion only appends (buffer, valid size, arrival time): no decoding on CUPTI's
thread. Readers (`resolver`, `calibration`) list `completed()` buffers and pin the ones
they read. Nothing here calls CUPTI or imports torch.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

BUFFER_ALIGN = 8  # ACTIVITY_RECORD_ALIGNMENT: CUPTI's buffers and records are 8-byte aligned

# CUPTI hands a buffer back only once every record in it is complete; on a GPU that is
# never idle the buffer being filled always ends with kernels still in flight, so a
# step's records arrive when their buffer fills. 1 MB (~4,800 kernel records, a few
# steps of a typical training loop) keeps that delay well inside `history_steps`;
# callbacks stay rare (one pair per buffer) and the ring simply has more slots.
DEFAULT_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True)
class CompletedBuffer:
    """A buffer CUPTI handed back: `seq` counts completions in arrival order."""

    seq: int
    address: int
    valid_size: int
    completed_ns: int  # time.time_ns() when the completion callback ran
    epoch: int = 0  # CUPTI attachments before this buffer's (see BufferPool.begin_epoch)


class _Buffer:
    __slots__ = (
        "address", "completed_ns", "epoch", "pins", "raw", "requested_ns", "seq", "size", "state",
        "valid_size",
    )  # fmt: skip

    def __init__(self, size: int) -> None:
        # ctypes zero-fills through calloc: large blocks are lazily mapped pages, so this is
        # cheap even when CUPTI asks for a buffer from inside a kernel launch.
        self.raw = (ctypes.c_char * (size + BUFFER_ALIGN))()
        base = ctypes.addressof(self.raw)
        self.address = (base + BUFFER_ALIGN - 1) & ~(BUFFER_ALIGN - 1)
        self.size = size
        self.state = "free"  # free | cupti | done
        self.seq = -1
        self.valid_size = 0
        self.completed_ns = 0
        self.requested_ns = 0
        self.epoch = 0
        self.pins = 0


class BufferPool:
    """At most `max_buffers` buffers of `buffer_bytes`, handed to CUPTI and kept once full.

    Completed buffers stay, in arrival order, until CUPTI needs a buffer and none is free
    and the budget is spent: then the oldest completed buffer that no reader has pinned
    is recycled. `lost_through_ns` is the latest completion time of a recycled buffer:
    every record it held had completed by then, so a step whose first launch came later
    lost nothing. Thread-safe: callbacks run on CUPTI's threads and on whichever thread
    launches work; readers pin buffers while they read them.
    """

    def __init__(
        self, buffer_bytes: int, max_buffers: int, clock: Callable[[], int] = time.time_ns
    ) -> None:
        if buffer_bytes < 4096 or buffer_bytes % BUFFER_ALIGN:
            raise ValueError(f"buffer_bytes must be a multiple of {BUFFER_ALIGN} and >= 4096")
        if max_buffers < 2:
            raise ValueError("max_buffers must be >= 2 (CUPTI holds one while another is read)")
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max_buffers
        self._clock = clock
        self._lock = threading.Lock()
        self._by_address: dict[int, _Buffer] = {}
        self._free: list[_Buffer] = []
        self._done: list[_Buffer] = []  # arrival order
        self._next_seq = 0
        self.lost_through_ns = 0
        # Bumped each time CUPTI is detached: correlation ids are only known to increase
        # within one attachment, so readers order records by (epoch, correlation).
        self.epoch = 0
        self.counters: dict[str, int] = {
            "buffers_allocated": 0,
            "buffers_completed": 0,
            "buffers_empty": 0,
            "buffers_evicted": 0,
            "buffer_requests": 0,
            "buffer_requests_refused": 0,
            "unknown_buffers_completed": 0,
            "bytes_completed": 0,
            "buffers_abandoned": 0,
        }

    @classmethod
    def for_ring(
        cls,
        ring_mb: int,
        clock: Callable[[], int] = time.time_ns,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ) -> BufferPool:
        """Split `ring_mb` into `buffer_bytes` buffers (at least 4 buffers)."""
        ring_bytes = int(ring_mb) << 20
        size = min(buffer_bytes, ring_bytes // 4)
        size -= size % BUFFER_ALIGN
        return cls(size, max(2, ring_bytes // size), clock)

    # -- CUPTI side (callbacks) ----------------------------------------------------

    def request(self) -> tuple[int, int] | None:
        """A buffer for CUPTI as (address, size), or None when every buffer is held or pinned (CUPTI
        then drops records and counts them)."""
        with self._lock:
            self.counters["buffer_requests"] += 1
            buf: _Buffer | None
            if self._free:
                buf = self._free.pop()
            elif len(self._by_address) < self.max_buffers:
                buf = _Buffer(self.buffer_bytes)
                self._by_address[buf.address] = buf
                self.counters["buffers_allocated"] += 1
            else:
                buf = self._evict_oldest_locked()
                if buf is None:
                    self.counters["buffer_requests_refused"] += 1
                    return None
            buf.state = "cupti"
            buf.valid_size = 0
            buf.seq = -1
            buf.requested_ns = self._clock()
            return buf.address, buf.size

    def _evict_oldest_locked(self) -> _Buffer | None:
        for i, buf in enumerate(self._done):
            if buf.pins == 0:
                del self._done[i]
                self.lost_through_ns = max(self.lost_through_ns, buf.completed_ns)
                self.counters["buffers_evicted"] += 1
                return buf
        return None

    def complete(self, address: int | None, valid_size: int) -> None:
        """CUPTI handed buffer `address` back with `valid_size` bytes of records: keep it (an empty
        or unknown buffer is only counted)."""
        now = self._clock()
        with self._lock:
            buf = self._by_address.get(address) if address is not None else None
            if buf is None or buf.state != "cupti":
                self.counters["unknown_buffers_completed"] += 1
                return
            if valid_size <= 0:
                buf.state = "free"
                self._free.append(buf)
                self.counters["buffers_empty"] += 1
                return
            buf.state = "done"
            buf.valid_size = min(int(valid_size), buf.size)
            buf.completed_ns = now
            buf.epoch = self.epoch
            buf.seq = self._next_seq
            self._next_seq += 1
            self._done.append(buf)
            self.counters["buffers_completed"] += 1
            self.counters["bytes_completed"] += buf.valid_size

    # -- reader side -----------------------------------------------------------------

    def completed(self) -> list[CompletedBuffer]:
        """The retained completed buffers, oldest first."""
        with self._lock:
            return [
                CompletedBuffer(b.seq, b.address, b.valid_size, b.completed_ns, b.epoch)
                for b in self._done
            ]

    def pin(self, seq: int) -> bool:
        """Keep buffer `seq` from being recycled while it is read; False if already gone."""
        with self._lock:
            for buf in self._done:
                if buf.seq == seq:
                    buf.pins += 1
                    return True
            return False

    def unpin(self, seq: int) -> None:
        """Undo one `pin` of buffer `seq` (a no-op if it is gone or not pinned)."""
        with self._lock:
            for buf in self._done:
                if buf.seq == seq and buf.pins > 0:
                    buf.pins -= 1
                    return

    def held_since(self, before_ns: int, not_before_ns: int = 0) -> int:
        """How many buffers CUPTI still holds that it asked for in [not_before_ns,
        before_ns): they may hold records of work that ran before then. CUPTI keeps a
        buffer per launching thread (the autograd thread launches the backward pass), so
        a step whose markers have come back can still have records in a buffer CUPTI has
        not handed back. (`not_before_ns`: buffers older than a forced flush that kept
        them will not come back; they are not waited for again.)"""
        with self._lock:
            return sum(
                1
                for b in self._by_address.values()
                if b.state == "cupti" and not_before_ns <= b.requested_ns < before_ns
            )

    def retained_bytes(self) -> int:
        """Bytes of every buffer the pool owns (free, held by CUPTI or completed)."""
        with self._lock:
            return sum(b.size for b in self._by_address.values())

    def stats(self) -> dict[str, int]:
        """The pool's counters plus the buffers retained and held by CUPTI now."""
        with self._lock:
            out = dict(self.counters)
            out["buffers_retained"] = len(self._done)
            out["buffers_held_by_cupti"] = sum(
                1 for b in self._by_address.values() if b.state == "cupti"
            )
            return out

    def begin_epoch(self) -> int:
        """CUPTI was detached: later buffers belong to the next attachment. A buffer CUPTI
        still held (the forced flush before detaching should leave none) is never reused.
        Returns how many such buffers were abandoned."""
        with self._lock:
            self.epoch += 1
            held = [b for b in self._by_address.values() if b.state == "cupti"]
            for buf in held:
                del self._by_address[buf.address]
            _UNRETURNED_BUFFERS.extend(held)
            self.counters["buffers_abandoned"] += len(held)
            return len(held)

    def release(self) -> int:
        """Drop every buffer CUPTI does not hold; those it still holds are kept alive for
        the life of the process (CUPTI may still write to them). Returns how many."""
        with self._lock:
            held = [b for b in self._by_address.values() if b.state == "cupti"]
            _UNRETURNED_BUFFERS.extend(held)
            self._by_address.clear()
            self._free.clear()
            self._done.clear()
            return len(held)


# Buffers CUPTI never handed back before their session closed: never freed.
_UNRETURNED_BUFFERS: list[_Buffer] = []
