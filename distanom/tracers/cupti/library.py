"""Finding libcupti and a thin, typed ctypes binding to its activity API.

Owns finding and loading libcupti, in this order: the copy already mapped into this
process (torch's Kineto may have loaded it: a second copy would be a second CUPTI), else
`$DISTANOM_LIBCUPTI`, else the `nvidia/**/libcupti.so*` wheel beside torch, else
`$CUDA_HOME/extras/CUPTI/lib64`, else the linker path; the CUPTI constants distanom uses;
and `CuptiLib`, the handful of CUPTI functions distanom calls, each return code checked
and turned into a `CuptiError` carrying `cuptiGetResultString`'s message.

Reads nothing but the library; the buffer callbacks it registers live in `callbacks`,
the buffers they hand out in `buffers`, and `session` drives the calls for one tracer.
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
from collections.abc import Callable, Sequence
from pathlib import Path

from distanom.errors import TracerUnavailableError
from distanom.tracers.cupti.buffers import BUFFER_ALIGN
from distanom.tracers.cupti.callbacks import (
    COMPLETE_CB,
    REQUEST_CB,
    SUBSCRIBER_CB,
    CompleteFunc,
    RequestFunc,
    SubscriberFunc,
)

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
    parts = [int(p) for p in tail.split(".") if p.isdecimal()]
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


# The binding


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
        self._register = self._bind("cuptiActivityRegisterCallbacks", [RequestFunc, CompleteFunc])
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
            "cuptiSubscribe", [ctypes.POINTER(c_void_p), SubscriberFunc, c_void_p]
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
        """CUPTI's description of result `code` (a placeholder if it has none)."""
        text = ctypes.c_char_p()
        rc = self._get_result_string(code, ctypes.byref(text))
        if rc != CUPTI_SUCCESS or not text.value:
            return f"no description (cuptiGetResultString returned {rc})"
        return text.value.decode("utf-8", errors="replace")

    def check(self, code: int, function: str) -> None:
        """Raise CuptiError naming `function` unless `code` is CUPTI_SUCCESS."""
        if code != CUPTI_SUCCESS:
            raise CuptiError(function, code, self.result_string(code))

    # -- calls ---------------------------------------------------------------------

    def version(self) -> int:
        """The CUPTI API version (`cuptiGetVersion`)."""
        value = ctypes.c_uint32()
        self.check(self._get_version(ctypes.byref(value)), "cuptiGetVersion")
        return int(value.value)

    def timestamp(self) -> int:
        """CUPTI's current timestamp in ns, the clock its records use (`cuptiGetTimestamp`)."""
        value = ctypes.c_uint64()
        self.check(self._get_timestamp(ctypes.byref(value)), "cuptiGetTimestamp")
        return int(value.value)

    @property
    def can_detach(self) -> bool:
        """Whether this libcupti has `cuptiFinalize` (CUPTI can be detached)."""
        return self._finalize is not None

    def finalize(self) -> None:
        """Detach CUPTI from the process (`cuptiFinalize`). CUPTI's contract: every CUDA
        launch it instrumented has completed and its buffers were flushed before this."""
        if self._finalize is None:
            raise CuptiError("cuptiFinalize", -1, "not in this libcupti")
        self.check(self._finalize(), "cuptiFinalize")

    def register_callbacks(self) -> None:
        """Register distanom's process-wide buffer callbacks (see `callbacks`)."""
        self.check(self._register(REQUEST_CB, COMPLETE_CB), "cuptiActivityRegisterCallbacks")

    def enable(self, kind: int) -> None:
        """Enable activity `kind` (`cuptiActivityEnable`)."""
        self.check(self._enable(kind), f"cuptiActivityEnable({KIND_NAMES.get(kind, kind)})")

    def disable(self, kind: int) -> None:
        """Disable activity `kind` (`cuptiActivityDisable`)."""
        self.check(self._disable(kind), f"cuptiActivityDisable({KIND_NAMES.get(kind, kind)})")

    def flush_all(self, forced: bool = False) -> None:
        """Ask CUPTI to hand back completed buffers (forced: every buffer, finished or not)."""
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
        rc = self._subscribe(ctypes.byref(handle), SUBSCRIBER_CB, None)
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
