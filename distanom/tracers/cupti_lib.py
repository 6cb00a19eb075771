"""A thin, typed ctypes binding to NVIDIA's CUPTI activity API, and the raw-buffer pool.

Owns:
- finding and loading libcupti: the copy already mapped into this process (torch's
  Kineto may have loaded it: a second copy would be a second CUPTI), else
  `$DISTANOM_LIBCUPTI`, else the `nvidia/**/libcupti.so*` wheel beside torch, else
  `$CUDA_HOME/extras/CUPTI/lib64`, else the linker path;
- the handful of CUPTI functions distanom calls (`CuptiLib`), each return code checked
  and turned into a `CuptiError` carrying `cuptiGetResultString`'s message;
- the process-wide buffer callbacks (CUPTI takes one registration per process) and the
  `BufferPool` they hand buffers out of and back into; `ActivitySession` ties the three
  together for one tracer's lifetime.

Where the data goes: CUPTI writes activity records into buffers handed out by
`BufferPool.request` and returns them through the completion callback, which only
appends (buffer, valid size, arrival time) to the pool: no decoding and no large
allocation on CUPTI's thread. `distanom.tracers.cupti` reads the completed buffers later,
on its background thread, through `CuptiLib.record_offsets` and `cupti_records`.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from distanom.errors import TracerUnavailableError

log = logging.getLogger(__name__)

# CUpti_ActivityKind values used here (cupti_activity.h; checked on CUPTI 13.0).
KIND_MEMCPY = 1
KIND_MEMSET = 2
KIND_CONCURRENT_KERNEL = 10
TRACED_KINDS: tuple[int, ...] = (KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET)
KIND_NAMES = {
    KIND_MEMCPY: "MEMCPY",
    KIND_MEMSET: "MEMSET",
    KIND_CONCURRENT_KERNEL: "CONCURRENT_KERNEL",
}

# CUptiResult values with a meaning of their own here (cupti_result.h).
CUPTI_SUCCESS = 0
CUPTI_ERROR_MAX_LIMIT_REACHED = 12  # cuptiActivityGetNextRecord: no more records
CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39

FLUSH_FORCED = 1  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED

BUFFER_ALIGN = 8  # ACTIVITY_RECORD_ALIGNMENT
# CUPTI hands a buffer back only once every record in it is complete; on a GPU that is
# never idle the buffer being filled always ends with kernels still in flight, so a
# step's records arrive when their buffer fills. 1 MB (~4,800 kernel records, a few
# steps of a typical training loop) keeps that delay well inside `history_steps`;
# callbacks stay rare (one pair per buffer) and the ring simply has more slots.
DEFAULT_BUFFER_BYTES = 1 << 20


class DetachError(TracerUnavailableError):
    """`cuptiFinalize` failed or is missing: CUPTI stays attached (kinds disabled)."""


class CuptiError(TracerUnavailableError):
    """A CUPTI call returned an error code; `str()` names the call, the code and CUPTI's text."""

    def __init__(self, function: str, code: int, message: str) -> None:
        super().__init__(f"{function} failed: CUPTI error {code} ({message})")
        self.function = function
        self.code = code


# ---------------------------------------------------------------------------------------
# Finding the library


def _mapped_libcupti() -> list[str]:
    """Paths of libcupti already mapped into this process (Linux /proc/self/maps)."""
    found: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcupti.so" in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def _version_key(path: str) -> tuple[int, ...]:
    # libcupti.so.13.0.85 > libcupti.so.13 > libcupti.so: prefer the most specific.
    tail = os.path.basename(path).split(".so", 1)[-1].strip(".")
    parts = [int(p) for p in tail.split(".") if p.isdigit()]
    return tuple(parts)


def _torch_wheel_candidates() -> list[str]:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return []
    site = Path(spec.origin).resolve().parent.parent
    paths = glob.glob(str(site / "nvidia" / "**" / "libcupti.so*"), recursive=True)
    return sorted(set(paths), key=_version_key, reverse=True)


def _cuda_home_candidates() -> list[str]:
    roots = [os.environ.get(name) for name in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    paths: list[str] = []
    for root in roots:
        if not root:
            continue
        for sub in ("extras/CUPTI/lib64", "lib64"):
            paths.extend(
                sorted(
                    glob.glob(os.path.join(root, sub, "libcupti.so*")),
                    key=_version_key,
                    reverse=True,
                )
            )
    return paths


def libcupti_candidates() -> list[str]:
    """Where libcupti may be, best first (see the module docstring for the order)."""
    ordered: list[str] = list(_mapped_libcupti())
    override = os.environ.get("DISTANOM_LIBCUPTI")
    if override:
        ordered.append(override)
    ordered.extend(_torch_wheel_candidates())
    ordered.extend(_cuda_home_candidates())
    linker = ctypes.util.find_library("cupti")
    if linker:
        ordered.append(linker)
    unique: list[str] = []
    for path in ordered:
        if path not in unique:
            unique.append(path)
    return unique


# ---------------------------------------------------------------------------------------
# The binding

_RequestFunc = ctypes.CFUNCTYPE(
    None,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_size_t),
    ctypes.POINTER(ctypes.c_size_t),
)
_CompleteFunc = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t
)
_SubscriberFunc = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p
)


class CuptiLib:
    """The CUPTI functions distanom uses, with argument types declared and results checked.

    `ctypes.CDLL` releases the GIL during each call, so CUPTI's own threads can run the
    Python buffer callbacks while a call here (e.g. a flush) waits for them.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            dll = ctypes.CDLL(path)
        except OSError as err:
            raise TracerUnavailableError(f"cannot load libcupti from {path}: {err}") from None
        self._dll = dll
        c_int, c_uint32, c_size_t, c_void_p = (
            ctypes.c_int,
            ctypes.c_uint32,
            ctypes.c_size_t,
            ctypes.c_void_p,
        )
        self._get_result_string = self._bind(
            "cuptiGetResultString", [c_int, ctypes.POINTER(ctypes.c_char_p)]
        )
        self._get_version = self._bind("cuptiGetVersion", [ctypes.POINTER(c_uint32)])
        self._get_timestamp = self._bind("cuptiGetTimestamp", [ctypes.POINTER(ctypes.c_uint64)])
        self._register = self._bind("cuptiActivityRegisterCallbacks", [_RequestFunc, _CompleteFunc])
        self._enable = self._bind("cuptiActivityEnable", [c_int])
        self._disable = self._bind("cuptiActivityDisable", [c_int])
        self._flush_all = self._bind("cuptiActivityFlushAll", [c_uint32])
        self._next_record = self._bind(
            "cuptiActivityGetNextRecord", [c_void_p, c_size_t, ctypes.POINTER(c_void_p)]
        )
        self._num_dropped = self._bind(
            "cuptiActivityGetNumDroppedRecords", [c_void_p, c_uint32, ctypes.POINTER(c_size_t)]
        )
        self._subscribe = self._bind(
            "cuptiSubscribe", [ctypes.POINTER(c_void_p), _SubscriberFunc, c_void_p]
        )
        self._unsubscribe = self._bind("cuptiUnsubscribe", [c_void_p])
        # Dynamic detach (CUDA 11.x on); without it tracing can only be disabled, and
        # CUPTI's per-launch cost stays while it is attached.
        self._finalize: Callable[[], int] | None = None
        with contextlib.suppress(TracerUnavailableError):
            self._finalize = self._bind("cuptiFinalize", [])

    def _bind(self, name: str, argtypes: list[type]) -> Callable[..., int]:
        try:
            func = getattr(self._dll, name)
        except AttributeError:
            raise TracerUnavailableError(
                f"{self.path} has no symbol {name} (not a CUPTI library?)"
            ) from None
        func.argtypes = argtypes
        func.restype = ctypes.c_int
        return func  # type: ignore[no-any-return]

    @classmethod
    def load(cls, candidates: Sequence[str] | None = None) -> CuptiLib:
        """Load the first candidate that loads; TracerUnavailableError naming all tried."""
        paths = list(candidates) if candidates is not None else libcupti_candidates()
        if not paths:
            raise TracerUnavailableError(
                "libcupti not found (looked in this process's mappings, $DISTANOM_LIBCUPTI, "
                "site-packages/nvidia/**, $CUDA_HOME/extras/CUPTI/lib64, the linker path)"
            )
        problems: list[str] = []
        for path in paths:
            try:
                lib = cls(path)
            except TracerUnavailableError as err:
                problems.append(str(err))
                continue
            log.debug("loaded libcupti from %s", path)
            return lib
        raise TracerUnavailableError("no usable libcupti: " + "; ".join(problems))

    # -- error handling ------------------------------------------------------------

    def result_string(self, code: int) -> str:
        text = ctypes.c_char_p()
        rc = self._get_result_string(code, ctypes.byref(text))
        if rc != CUPTI_SUCCESS or not text.value:
            return f"no description (cuptiGetResultString returned {rc})"
        return text.value.decode("utf-8", errors="replace")

    def check(self, code: int, function: str) -> None:
        if code != CUPTI_SUCCESS:
            raise CuptiError(function, code, self.result_string(code))

    # -- calls ---------------------------------------------------------------------

    def version(self) -> int:
        value = ctypes.c_uint32()
        self.check(self._get_version(ctypes.byref(value)), "cuptiGetVersion")
        return int(value.value)

    def timestamp(self) -> int:
        value = ctypes.c_uint64()
        self.check(self._get_timestamp(ctypes.byref(value)), "cuptiGetTimestamp")
        return int(value.value)

    @property
    def can_detach(self) -> bool:
        return self._finalize is not None

    def finalize(self) -> None:
        """Detach CUPTI from the process (`cuptiFinalize`). CUPTI's contract: every CUDA
        launch it instrumented has completed and its buffers were flushed before this."""
        if self._finalize is None:
            raise CuptiError("cuptiFinalize", -1, "not in this libcupti")
        self.check(self._finalize(), "cuptiFinalize")

    def register_callbacks(self) -> None:
        self.check(self._register(_REQUEST_CB, _COMPLETE_CB), "cuptiActivityRegisterCallbacks")

    def enable(self, kind: int) -> None:
        self.check(self._enable(kind), f"cuptiActivityEnable({KIND_NAMES.get(kind, kind)})")

    def disable(self, kind: int) -> None:
        self.check(self._disable(kind), f"cuptiActivityDisable({KIND_NAMES.get(kind, kind)})")

    def flush_all(self, forced: bool = False) -> None:
        flag = FLUSH_FORCED if forced else 0
        self.check(self._flush_all(flag), f"cuptiActivityFlushAll({flag})")

    def dropped_records(self) -> int:
        """Records CUPTI dropped for want of a buffer since the last call (the count resets)."""
        value = ctypes.c_size_t()
        self.check(
            self._num_dropped(None, 0, ctypes.byref(value)), "cuptiActivityGetNumDroppedRecords"
        )
        return int(value.value)

    def subscriber_check(self) -> None:
        """Refuse when CUPTI already has a callback subscriber (Kineto / torch.profiler,
        Nsight...): that client's activity buffers are registered process-wide too, and
        registering ours would steal them. Subscribes and unsubscribes at once."""
        handle = ctypes.c_void_p()
        rc = self._subscribe(ctypes.byref(handle), _SUBSCRIBER_CB, None)
        if rc == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED:
            raise TracerUnavailableError(
                "CUPTI already has a subscriber in this process (torch.profiler/Kineto, Nsight, "
                f"another tool): {self.result_string(rc)}"
            )
        if rc != CUPTI_SUCCESS:
            # Not proof that activity tracing cannot work: registration will tell.
            log.warning("cuptiSubscribe returned %d (%s); continuing", rc, self.result_string(rc))
            return
        self.check(self._unsubscribe(handle), "cuptiUnsubscribe")

    def record_offsets(self, address: int, valid_size: int) -> list[int]:
        """Offsets (from `address`) of every record in a completed buffer, in buffer order,
        as `cuptiActivityGetNextRecord` walks it."""
        offsets: list[int] = []
        if valid_size <= 0:
            return offsets
        record = ctypes.c_void_p(None)
        ref = ctypes.byref(record)
        next_record = self._next_record
        limit = valid_size // BUFFER_ALIGN + 1  # a record is at least 8 bytes: never loop for ever
        for _ in range(limit):
            rc = next_record(address, valid_size, ref)
            if rc == CUPTI_ERROR_MAX_LIMIT_REACHED:
                return offsets
            if rc != CUPTI_SUCCESS:
                self.check(rc, "cuptiActivityGetNextRecord")
            value = record.value
            if value is None:
                return offsets
            offsets.append(value - address)
        raise CuptiError("cuptiActivityGetNextRecord", -1, "did not reach the end of the buffer")


# ---------------------------------------------------------------------------------------
# Buffers


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
        with self._lock:
            return sum(b.size for b in self._by_address.values())

    def stats(self) -> dict[str, int]:
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

# ---------------------------------------------------------------------------------------
# Process-wide callbacks. CUPTI keeps raw function pointers: these objects must live as
# long as the process, so they are module globals that dispatch to the active pool.

_active_pool: BufferPool | None = None
_session_lock = threading.Lock()
callback_errors = 0  # exceptions caught inside callbacks (never propagate into CUPTI)


def _on_buffer_request(
    buffer: ctypes._Pointer[ctypes.c_void_p],
    size: ctypes._Pointer[ctypes.c_size_t],
    max_records: ctypes._Pointer[ctypes.c_size_t],
) -> None:
    global callback_errors
    try:
        pool = _active_pool
        got = pool.request() if pool is not None else None
        if got is None:
            buffer[0] = None
            size[0] = 0
        else:
            buffer[0] = got[0]
            size[0] = got[1]
        max_records[0] = 0  # fill the buffer
    except BaseException:
        callback_errors += 1
        try:
            buffer[0] = None
            size[0] = 0
        except BaseException:
            pass


def _on_buffer_complete(
    context: int | None, stream_id: int, buffer: int | None, size: int, valid_size: int
) -> None:
    global callback_errors
    try:
        pool = _active_pool
        if pool is not None:
            pool.complete(buffer, valid_size)
    except BaseException:
        callback_errors += 1


def _on_subscriber_callback(userdata: int | None, domain: int, cbid: int, data: int | None) -> None:
    return None  # never enabled for any domain: only used to probe for another subscriber


_REQUEST_CB = _RequestFunc(_on_buffer_request)
_COMPLETE_CB = _CompleteFunc(_on_buffer_complete)
_SUBSCRIBER_CB = _SubscriberFunc(_on_subscriber_callback)


class ActivitySession:
    """One tracer's use of CUPTI's activity API: registration, the enabled kinds, flushes,
    and detaching CUPTI from the process while tracing is off.

    Only one session may be open per process (CUPTI's buffer callbacks are global). The
    training thread switches tracing; the reader thread flushes; a lock keeps a flush
    from racing a detach (the race CUPTI warns about).
    """

    def __init__(
        self, lib: CuptiLib, pool: BufferPool, kinds: Sequence[int] = TRACED_KINDS
    ) -> None:
        self.lib = lib
        self.pool = pool
        self.kinds = tuple(kinds)
        self.enabled = False
        self.is_open = False
        self.attached = False
        self.dropped_records = 0
        self.flushes = 0
        self.forced_flushes = 0
        self.detaches = 0
        self._lock = threading.RLock()

    def open(self) -> None:
        """Check for another subscriber, register the callbacks, enable the kinds."""
        global _active_pool
        with _session_lock:
            if _active_pool is not None:
                raise TracerUnavailableError(
                    "another distanom CUPTI session is open in this process"
                )
            self.lib.subscriber_check()
            _active_pool = self.pool
            try:
                self.lib.register_callbacks()
                self.enable()
            except BaseException:
                _active_pool = None
                self._disable_quietly()
                raise
            self.attached = True
            self.is_open = True

    def enable(self) -> None:
        done: list[int] = []
        with self._lock:
            try:
                for kind in self.kinds:
                    self.lib.enable(kind)
                    done.append(kind)
            except CuptiError:
                for kind in done:
                    with contextlib.suppress(CuptiError):
                        self.lib.disable(kind)
                raise
            self.enabled = True

    def disable(self) -> None:
        """Disable every kind; raise the first failure after trying them all."""
        first: CuptiError | None = None
        with self._lock:
            for kind in self.kinds:
                try:
                    self.lib.disable(kind)
                except CuptiError as err:
                    first = first or err
            self.enabled = False
        if first is not None:
            raise first

    def detach(self) -> None:
        """Disable, hand every buffer back, and detach CUPTI from the process.

        Disabled kinds alone leave CUPTI's per-launch cost in place (measured on an H200:
        ~1.2x per step on a launch-bound workload, the same as tracing); detached, none
        is left. The caller must first make sure every instrumented launch has completed
        (a device synchronize): CUPTI's condition for detaching outside its callbacks.
        """
        with self._lock:
            if not self.attached:
                return
            self.disable()
            self.flush(forced=True)
            try:
                self.lib.finalize()
            except CuptiError as err:
                raise DetachError(str(err)) from None
            self.attached = False
            self.detaches += 1
            self.pool.begin_epoch()

    def attach(self) -> None:
        """Re-attach after `detach`: refuse if another CUPTI client appeared meanwhile
        (registering would take its buffers), else register the callbacks and enable."""
        with self._lock:
            if self.attached:
                self.enable()
                return
            self.lib.subscriber_check()
            self.lib.register_callbacks()
            self.attached = True
            self.enable()

    def _disable_quietly(self) -> None:
        try:
            self.disable()
        except CuptiError as err:
            log.warning("while giving CUPTI up: %s", err)

    def flush(self, forced: bool = False) -> None:
        """Hand completed (forced: all) buffers back. A no-op while detached: the detach
        flushed everything, and a CUPTI call would attach CUPTI again."""
        with self._lock:
            if not self.attached:
                return
            self.lib.flush_all(forced)
            self.flushes += 1
            self.forced_flushes += int(forced)
            self.poll_dropped()

    def record_offsets(self, address: int, valid_size: int) -> list[int]:
        """`CuptiLib.record_offsets`, only while attached and never during a detach."""
        with self._lock:
            if not self.attached:
                raise CuptiError("cuptiActivityGetNextRecord", -1, "CUPTI is detached")
            return self.lib.record_offsets(address, valid_size)

    def poll_dropped(self) -> int:
        with self._lock:
            if self.attached:
                self.dropped_records += self.lib.dropped_records()
            return self.dropped_records

    def close(self) -> None:
        """Disable, hand every buffer back (forced flush), detach the pool. Idempotent;
        logs CUPTI errors instead of raising, since it runs on the way out."""
        global _active_pool
        if not self.is_open:
            return
        self.is_open = False
        if self.attached:
            self._disable_quietly()
            try:
                self.flush(forced=True)
            except CuptiError as err:
                log.warning("final CUPTI flush: %s", err)
        with _session_lock:
            if _active_pool is self.pool:
                _active_pool = None
        held = self.pool.release()
        if held:
            log.warning("CUPTI still holds %d activity buffer(s); kept alive until exit", held)
