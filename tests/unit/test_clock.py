"""StepClock with fake CUDA events: the boundary records, `poll` reads durations (one
query per round), the bounded wait at the end, the stream looked up every few steps."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import pytest
import torch

from distanom.clock import STREAM_RECHECK, StepClock


class FakeEvent:
    """A CUDA event on a fake GPU: `done` once the GPU has passed it."""

    gpu_time: ClassVar[dict[str, float]] = {"now": 0.0}
    stuck_at: ClassVar[dict[str, float | None]] = {"t": None}  # GPU time it stopped at
    queries: ClassVar[dict[str, int]] = {"n": 0}
    made: ClassVar[dict[str, int]] = {"n": 0}

    def __init__(self, enable_timing: bool = True) -> None:
        self.at: float | None = None
        FakeEvent.made["n"] += 1

    def record(self, stream: Any = None) -> None:
        FakeEvent.gpu_time["now"] += 10.0  # each step takes 10 ms of GPU time
        self.at = FakeEvent.gpu_time["now"]

    def query(self) -> bool:
        """Passed unless recorded after the GPU got stuck (the GPU runs in order)."""
        FakeEvent.queries["n"] += 1
        stuck_at = FakeEvent.stuck_at["t"]
        return stuck_at is None or (self.at is not None and self.at <= stuck_at)

    def elapsed_time(self, other: Any) -> float:
        assert self.at is not None and other.at is not None
        return float(other.at - self.at)


def stuck() -> None:
    """The GPU stops: events recorded from now on are never passed."""
    FakeEvent.stuck_at["t"] = FakeEvent.gpu_time["now"]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> StepClock:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "stream")
    FakeEvent.stuck_at["t"] = None
    FakeEvent.queries["n"] = 0
    return StepClock("cuda_event")


def test_marks_record_and_the_durations_come_from_poll(clock: StepClock) -> None:
    assert all(math.isnan(clock.mark(s)) for s in range(4))  # the boundary only records
    assert clock.poll() == [(1, 10.0), (2, 10.0), (3, 10.0)]
    assert clock.poll() == []
    clock.mark(4)
    assert clock.poll() == [(4, 10.0)]  # the step before it was read earlier


def test_one_query_reads_a_whole_round(clock: StepClock) -> None:
    for s in range(32):
        clock.mark(s)
    assert len(clock.poll()) == 31
    assert FakeEvent.queries["n"] == 1  # the newest passed: every older one did


def test_a_gpu_behind_gives_only_what_it_passed(clock: StepClock) -> None:
    clock.mark(0)
    clock.mark(1)
    stuck()
    clock.mark(2)
    assert clock.poll() == [(1, 10.0)]  # from the oldest, up to the first not passed
    FakeEvent.stuck_at["t"] = None
    assert clock.poll() == [(2, 10.0)]


def test_the_wait_at_the_end_returns_once_the_gpu_passed(clock: StepClock) -> None:
    stuck()  # the GPU is behind at the end of training...
    for s in range(3):
        clock.mark(s)
    assert not clock.wait_for_gpu(0.01)
    FakeEvent.stuck_at["t"] = None  # ...and catches up
    assert clock.wait_for_gpu(1.0)
    assert clock.poll() == [(1, 10.0), (2, 10.0)]
    assert clock.lost_boundaries == 0


def test_a_gpu_that_never_finishes_is_given_up(clock: StepClock) -> None:
    clock.mark(0)
    stuck()
    clock.mark(1)
    clock.mark(2)
    assert not clock.wait_for_gpu(0.05)  # polls, never synchronizes: returns
    clock.abandon()
    assert clock.lost_boundaries == 2
    assert clock.poll() == []


def test_host_modes_give_the_duration_at_the_mark() -> None:
    clock = StepClock("host")
    assert math.isnan(clock.mark(0))  # no start boundary for the first step
    assert clock.mark(1) >= 0.0
    assert clock.poll() == []
    assert clock.wait_for_gpu(0.0)


def test_the_stream_is_looked_up_again_every_recheck(
    clock: StepClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    looked_up: list[int] = []

    def current_stream() -> str:
        looked_up.append(1)
        return "stream"

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    for s in range(2 * STREAM_RECHECK):
        clock.mark(s)
    assert len(looked_up) == 2


def test_events_are_reused_once_read(clock: StepClock) -> None:
    for s in range(8):
        clock.mark(s)
    clock.poll()
    made = FakeEvent.made["n"]
    for s in range(8, 14):
        clock.mark(s)
    assert FakeEvent.made["n"] == made  # the spares of the first round served
