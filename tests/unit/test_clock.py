"""StepClock's CUDA-event mode with fake events: durations, and the bounded exit drain."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from distanom.clock import StepClock


class FakeEvent:
    """A CUDA event on a fake GPU: `done` once the GPU has passed it."""

    gpu_time: ClassVar[dict[str, float]] = {"now": 0.0}
    stuck: ClassVar[dict[str, bool]] = {"on": False}

    def __init__(self, enable_timing: bool = True) -> None:
        self.at: float | None = None

    def record(self) -> None:
        FakeEvent.gpu_time["now"] += 10.0  # each step takes 10 ms of GPU time
        self.at = FakeEvent.gpu_time["now"]

    def query(self) -> bool:
        return not FakeEvent.stuck["on"]

    def elapsed_time(self, other: Any) -> float:
        assert self.at is not None and other.at is not None
        return float(other.at - self.at)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> StepClock:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.stuck["on"] = False
    return StepClock("cuda_event")


def test_durations_come_from_consecutive_boundaries(clock: StepClock) -> None:
    got = [d for s in range(4) for d in clock.mark(s)]
    assert got == [(1, 10.0), (2, 10.0), (3, 10.0)]


def test_drain_returns_what_the_gpu_passes(clock: StepClock) -> None:
    FakeEvent.stuck["on"] = True  # the GPU is behind at the end of training...
    assert [d for s in range(3) for d in clock.mark(s)] == []
    FakeEvent.stuck["on"] = False  # ...and catches up while the drain polls
    drained, done = clock.drain(1.0)
    assert done and drained == [(1, 10.0), (2, 10.0)]
    assert clock.lost_boundaries == 0


def test_drain_gives_up_on_a_gpu_that_never_finishes(clock: StepClock) -> None:
    clock.mark(0)
    FakeEvent.stuck["on"] = True
    clock.mark(1)
    clock.mark(2)
    drained, done = clock.drain(0.05)  # polls, never synchronizes: returns
    assert not done and drained == []
    assert clock.lost_boundaries == 2


def test_other_modes_have_nothing_to_drain() -> None:
    assert StepClock("host").drain(0.0) == ([], True)
