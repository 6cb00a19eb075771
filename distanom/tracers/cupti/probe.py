"""Whether the cupti backend can work in this process, answered without starting it.

Owns `probe_cupti` (used by `create_tracer` to choose a backend) and `cuda_reason` (the
torch/CUDA part of that answer, also checked by `CuptiTracer.start`). Loads libcupti and
subscribes/unsubscribes once to detect another CUPTI client; imports torch only when
called.
"""

from __future__ import annotations

import distanom.tracers.cupti.callbacks as callbacks
from distanom.errors import TracerUnavailableError
from distanom.tracers.cupti.library import CuptiLib


def cuda_reason() -> str | None:
    """None if torch can drive an NVIDIA GPU here, else a one-line reason why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if getattr(torch.version, "hip", None):
        return "ROCm build of torch: CUPTI is NVIDIA-only"
    if torch.version.cuda is None:
        return "torch was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def probe_cupti() -> str | None:
    """None if the cupti backend can work in this process, else a one-line reason
    (no CUDA, no libcupti, another CUPTI subscriber such as torch.profiler)."""
    reason = cuda_reason()
    if reason is not None:
        return reason
    if callbacks.active_pool is not None:
        return "a distanom CUPTI tracer is already running in this process"
    try:
        lib = CuptiLib.load()
        lib.version()
        lib.subscriber_check()
    except TracerUnavailableError as err:
        return str(err)
    return None
