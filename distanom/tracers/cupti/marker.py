"""The step-marker kernel of the cupti backend: one tiny launch per step boundary.

Owns launching the marker whose CUPTI record bounds a step (see `matching`) and whose
grid size encodes `step % K`. Two launchers, the cheaper first:

- `DriverMarker`: a kernel named `distanom_step_marker`, loaded once from PTX text
  through the CUDA driver API (`ctypes` on libcuda) and launched with `cuLaunchKernel`
  on torch's current stream, grid = code + 1: a few µs of host time per step.
- `JiteratorMarker`: torch's jiterator compiles an elementwise kernel of that name; its
  input length (1 + code * 4096 elements) sets the grid. Much dearer per step, so it is
  used only where the driver path is unavailable (no libcuda symbol, PTX rejected).

Neither touches disk or CUPTI; the tracer learns grid -> code by calibration either way
(see `calibration`). Docs: docs/cupti.md (why the driver marker).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Protocol

from distanom.errors import TracerUnavailableError

log = logging.getLogger(__name__)

MARKER_NAME = "distanom_step_marker"
MARKER_SOURCE = f"template <typename T> T {MARKER_NAME}(T x) {{ return x + T(1); }}"
MARKER_LENGTH_STRIDE = 4096  # elements between two codes' jiterator inputs (> any block's work)

# An empty kernel; PTX ISA 7.0 for sm_70 is JIT-compiled by the driver for any newer GPU.
MARKER_PTX = f"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry {MARKER_NAME}()
{{
    ret;
}}
"""


def marker_length(code: int) -> int:
    """Elements of the jiterator marker's input for `code`."""
    return 1 + code * MARKER_LENGTH_STRIDE


class StepMarker(Protocol):
    """A way to launch the step marker for a code (see `create_marker`)."""

    kind: str

    def launch(self, code: int) -> None:
        """Launch the marker for `code` on the current stream (training thread)."""

    def close(self) -> None:
        """Release what `__init__` loaded."""


class DriverMarker:
    """`distanom_step_marker` from PTX, launched through the CUDA driver API."""

    kind = "driver"

    def __init__(self, torch: Any, codes: int) -> None:
        self._torch = torch
        self._codes = codes
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise TracerUnavailableError(f"libcuda not loadable: {err}") from None
        c_void_p, c_uint = ctypes.c_void_p, ctypes.c_uint
        try:
            self._get_error_name = lib.cuGetErrorName
            self._ctx_get_current = lib.cuCtxGetCurrent
            self._module_load_data = lib.cuModuleLoadData
            self._module_get_function = lib.cuModuleGetFunction
            self._module_unload = lib.cuModuleUnload
            self._launch = lib.cuLaunchKernel
        except AttributeError as err:
            raise TracerUnavailableError(f"libcuda lacks a driver function: {err}") from None
        self._get_error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._ctx_get_current.argtypes = [ctypes.POINTER(c_void_p)]
        self._module_load_data.argtypes = [ctypes.POINTER(c_void_p), ctypes.c_char_p]
        self._module_get_function.argtypes = [
            ctypes.POINTER(c_void_p), c_void_p, ctypes.c_char_p,
        ]  # fmt: skip
        self._module_unload.argtypes = [c_void_p]
        self._launch.argtypes = [
            c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
            c_void_p, c_void_p,
        ]  # fmt: skip
        for fn in (
            self._get_error_name, self._ctx_get_current, self._module_load_data,
            self._module_get_function, self._module_unload, self._launch,
        ):  # fmt: skip
            fn.restype = ctypes.c_int
        context = c_void_p()
        self._check(self._ctx_get_current(ctypes.byref(context)), "cuCtxGetCurrent")
        if not context.value:
            raise TracerUnavailableError("no current CUDA context on this thread")
        self._module = c_void_p()
        self._check(
            self._module_load_data(ctypes.byref(self._module), MARKER_PTX.encode()),
            "cuModuleLoadData",
        )
        self._function = c_void_p()
        self._check(
            self._module_get_function(
                ctypes.byref(self._function), self._module, MARKER_NAME.encode()
            ),
            "cuModuleGetFunction",
        )

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self._get_error_name(rc, ctypes.byref(name))
            text = name.value.decode() if name.value else "unknown"
            raise TracerUnavailableError(f"{call} failed: CUDA error {rc} ({text})")

    def launch(self, code: int) -> None:
        """Launch the marker with grid `code + 1` on torch's current stream."""
        stream = self._torch.cuda.current_stream().cuda_stream
        rc = self._launch(self._function, code + 1, 1, 1, 1, 1, 1, 0, stream, None, None)
        if rc != 0:
            self._check(rc, "cuLaunchKernel")

    def close(self) -> None:
        """Unload the PTX module (idempotent)."""
        if self._module.value:
            self._module_unload(self._module)
            self._module = ctypes.c_void_p()


class JiteratorMarker:
    """`distanom_step_marker` compiled by torch's jiterator; grid set by input length."""

    kind = "jiterator"

    def __init__(self, torch: Any, codes: int) -> None:
        from torch.cuda import jiterator

        device = torch.cuda.current_device()
        self._fn: Any = jiterator._create_jit_fn(MARKER_SOURCE)
        self._inputs = [
            torch.zeros(marker_length(c), dtype=torch.int32, device=f"cuda:{device}")
            for c in range(codes)
        ]
        for x in self._inputs:  # compile now, not at the first step
            self._fn(x)

    def launch(self, code: int) -> None:
        """Launch the marker on the input whose length encodes `code`."""
        self._fn(self._inputs[code])

    def close(self) -> None:
        """Drop the marker inputs."""
        self._inputs = []


def create_marker(torch: Any, codes: int) -> StepMarker:
    """The driver marker when it loads, else the jiterator one (logged once)."""
    try:
        return DriverMarker(torch, codes)
    except TracerUnavailableError as err:
        log.info("step marker: driver launch unavailable (%s); using jiterator", err)
    return JiteratorMarker(torch, codes)
