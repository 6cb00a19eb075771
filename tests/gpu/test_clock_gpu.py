"""The CUDA-event step clock on a real GPU (skipped without CUDA): the C-level fast path
is taken and agrees with the public API, and durations follow the GPU's work, across a
change of stream and through the exit drain.

Run on the device machine (`python3 -m pytest tests/gpu -q -m gpu`).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def spin_cycles_per_ms() -> float:
    """How many `torch.cuda._sleep` cycles take one ms on this GPU."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def test_fast_path_is_taken_and_names_the_current_stream() -> None:
    from distanom.clock import CudaEventCalls

    torch.cuda.init()
    calls = CudaEventCalls()
    assert calls.fast, "torch's C-level event calls were not usable"
    assert calls.stream_of(calls.stream_key()) == torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert calls.stream_of(calls.stream_key()) == side


def test_durations_follow_the_gpu_work_across_a_stream_change() -> None:
    from distanom.clock import StepClock

    cycles = spin_cycles_per_ms()
    wanted = {s: (2.0 if s % 3 == 0 else 0.5) for s in range(60)}  # ms of GPU work
    clock = StepClock("cuda_event")
    side = torch.cuda.Stream()
    got: dict[int, float] = {}
    for step in range(60):
        stream = side if step >= 30 else torch.cuda.current_stream()
        if step == 30:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(wanted[step] * cycles))
            got.update(clock.mark(step))
    drained, done = clock.drain(10.0)
    got.update(drained)
    assert done and clock.lost_boundaries == 0
    assert sorted(got) == list(range(1, 60)), sorted(got)
    for step, ms in got.items():
        assert ms == pytest.approx(wanted[step], rel=0.25, abs=0.1), (step, ms)
