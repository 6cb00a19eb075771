"""CuptiTracer where CUDA is absent: it says why, never breaks the training loop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from distanom.config import TracerConfig
from distanom.errors import TracerUnavailableError
from distanom.tracers.base import Availability, Tracer
from distanom.tracers.cupti import CuptiTracer, probe_cupti
from distanom.tracers.cupti.marker import MARKER_PTX, marker_length

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU paths")


def test_implements_the_tracer_protocol() -> None:
    tracer = CuptiTracer(TracerConfig(backend="cupti"), rank=0)
    assert isinstance(tracer, Tracer)
    assert tracer.name == "cupti"


def test_the_class_has_every_member_of_the_tracer_protocol() -> None:
    declared = set(Tracer.__annotations__) | {n for n in vars(Tracer) if not n.startswith("_")}
    assert {"name", "boundary_flushes", "tracing", "stats", "mark_step"} <= declared
    data = set(Tracer.__annotations__)  # set per instance, in __init__
    on_class = {n for n in declared - data if hasattr(CuptiTracer, n)}
    assert on_class == declared - data
    properties = {"tracing", "quiet"}
    assert all(callable(getattr(CuptiTracer, n)) for n in declared - data - properties)
    assert all(isinstance(vars(CuptiTracer)[n], property) for n in properties)
    tracer = CuptiTracer(TracerConfig(backend="cupti"), rank=0)
    assert all(hasattr(tracer, n) for n in data)


def test_probe_gives_a_one_line_reason() -> None:
    reason = probe_cupti()
    assert isinstance(reason, str) and reason and "\n" not in reason


def test_start_raises_unavailable_and_everything_else_is_harmless() -> None:
    tracer = CuptiTracer(TracerConfig(backend="cupti", history_steps=8, ring_mb=16), rank=3)
    with pytest.raises(TracerUnavailableError):
        tracer.start()
    tracer.mark_step(1, 123)  # before/without start: remembered for start(), never raises
    assert tracer._boundary_before_start == (1, 123)
    tracer.set_tracing(False)
    assert tracer.availability(1) is Availability.GONE
    with pytest.raises(KeyError):
        tracer.step_trace(1)
    tracer.close()
    tracer.close()


def test_accepts_a_plain_namespace_config() -> None:
    # Device scripts run where pydantic may be missing: only three fields are read.
    cfg = SimpleNamespace(history_steps=4, ring_mb=8, overhead_budget_pct=None)
    tracer = CuptiTracer(cfg, rank=0)  # type: ignore[arg-type]
    assert (tracer.history_steps, tracer.ring_mb) == (4, 8)


def test_marker_lengths_give_distinct_grids_for_any_block_work_up_to_the_stride() -> None:
    import math

    for bw in (128, 256, 512, 1024, 2048, 4096):
        grids = [math.ceil(marker_length(c) / bw) for c in range(16)]
        assert len(set(grids)) == 16, bw


def test_marker_ptx_declares_the_marker_entry() -> None:
    assert MARKER_PTX.lstrip().startswith(".version")
    assert ".visible .entry distanom_step_marker()" in MARKER_PTX


def test_driver_marker_without_libcuda_is_unavailable_not_a_crash() -> None:
    import ctypes

    from distanom.errors import TracerUnavailableError
    from distanom.tracers.cupti.marker import DriverMarker

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("this machine has libcuda")
    with pytest.raises(TracerUnavailableError, match="libcuda not loadable"):
        DriverMarker(object(), 16)
