"""Tracer backends behind one protocol (see `base`); `create_tracer` picks one for this process.

`backend: auto` takes the CUPTI ring buffer on NVIDIA GPUs when CUPTI can be used (the
low-overhead path) and torch.profiler (Kineto) otherwise: ROCm, CPU-only jobs, or when
another profiler already holds CUPTI. The choice and its reason are logged once.
"""

from __future__ import annotations

import logging

import torch

from distanom.config import TracerConfig
from distanom.errors import TracerUnavailableError
from distanom.tracers.base import Availability, StepTrace, Tracer

__all__ = ["Availability", "StepTrace", "Tracer", "create_tracer"]

log = logging.getLogger(__name__)


def _cupti_reason_unavailable() -> str | None:
    try:
        from distanom.tracers.cupti import probe_cupti
    except ImportError as err:
        return f"CUPTI backend not importable ({err})"
    return probe_cupti()


def create_tracer(config: TracerConfig, *, rank: int, use_cuda: bool) -> tuple[Tracer | None, str]:
    """The tracer for this process and a one-line note saying why it was chosen."""
    backend = config.backend
    if backend == "none":
        return None, "tracer: none (detection only)"
    is_nvidia = use_cuda and torch.version.cuda is not None
    if backend in ("auto", "cupti"):
        reason = (
            _cupti_reason_unavailable()
            if is_nvidia
            else "no NVIDIA GPU in use"
            if torch.version.hip is None or not use_cuda
            else "ROCm"
        )
        if reason is None:
            try:
                from distanom.tracers.cupti import CuptiTracer

                return CuptiTracer(config, rank=rank), f"tracer: cupti ({backend})"
            except (ImportError, TracerUnavailableError) as err:
                reason = str(err)
        if backend == "cupti":
            log.warning("tracer: cupti requested but unavailable (%s); using kineto", reason)
        note = f"tracer: kineto ({'CUDA' if use_cuda else 'CPU'} activities; cupti: {reason})"
    else:
        note = f"tracer: kineto ({'CUDA' if use_cuda else 'CPU'} activities)"
    from distanom.tracers.kineto import KinetoTracer

    return KinetoTracer(config, use_cuda=use_cuda), note
