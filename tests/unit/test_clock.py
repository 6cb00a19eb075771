"""StepClock's CUDA-event mode on a fake GPU: durations, batched polling that asks few
queries, stream changes, the bounded exit drain, and the C-level fast path's checks."""

from __future__ import annotations

from typing import Any

import pytest

from distanom import clock as clock_module
from distanom.clock import POLL_EVERY, StepClock


class FakeEvent:
    def __init__(self) -> None:
        self.seq: int | None = None  # order of its last record on the fake GPU
        self.at_ms: float | None = None
        self.stream: Any = None


class FakeGpu:
    """Stands in for `CudaEventCalls`: each recorded event completes once the GPU has
    `passed` its sequence number; each step takes 10 ms of GPU time."""

    def __init__(self) -> None:
        self.recorded = 0
        self.passed = 0  # events with seq < passed are done
        self.follow = True  # the GPU keeps up with the host, `lag` boundaries behind
        self.lag = 0
        self.queries = 0
        self.stream = "s0"
        self.created = 0
        self.devices_used: list[Any] = []  # use_device calls, in order

    def new_event(self) -> FakeEvent:
        self.created += 1
        return FakeEvent()

    def stream_key(self) -> Any:
        return self.stream

    def use_device(self, index: Any) -> None:
        self.devices_used.append(index)

    @staticmethod
    def stream_of(key: Any) -> Any:
        return key

    @staticmethod
    def device_of(key: Any) -> Any:
        return key[1] if isinstance(key, tuple) else 0

    def record(self, event: FakeEvent, stream: Any) -> None:
        device = self.device_of(stream)
        assert event.stream is None or self.device_of(event.stream) == device, "wrong device"
        event.seq, event.at_ms, event.stream = self.recorded, 10.0 * self.recorded, stream
        self.recorded += 1
        if self.follow:
            self.passed = max(self.passed, self.recorded - self.lag)

    def query(self, event: FakeEvent) -> bool:
        self.queries += 1
        assert event.seq is not None
        return event.seq < self.passed

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        assert start.at_ms is not None and end.at_ms is not None
        assert start.seq is not None and end.seq is not None
        assert start.seq < self.passed and end.seq < self.passed, "read before done"
        assert self.device_of(start.stream) == self.device_of(end.stream), "two devices"
        return end.at_ms - start.at_ms


@pytest.fixture
def gpu() -> FakeGpu:
    return FakeGpu()


def make_clock(gpu: FakeGpu) -> StepClock:
    return StepClock("cuda_event", calls=gpu)  # type: ignore[arg-type]


def run(clock: StepClock, steps: range) -> list[tuple[int, float]]:
    return [d for s in steps for d in clock.mark(s)]


def test_every_step_gets_its_duration_in_order(gpu: FakeGpu) -> None:
    gpu.lag = 2
    clock = make_clock(gpu)
    got = run(clock, range(40))
    gpu.passed = 40
    got += clock.drain(1.0)[0]
    assert got == [(s, 10.0) for s in range(1, 40)]
    assert clock.lost_boundaries == 0


def test_durations_arrive_in_batches_a_few_steps_late(gpu: FakeGpu) -> None:
    gpu.lag = 1
    clock = make_clock(gpu)
    arrived_at: dict[int, int] = {}
    for s in range(100):
        for step, _ in clock.mark(s):
            arrived_at[step] = s
    delays = [arrived_at[s] - s for s in arrived_at]
    assert max(delays) <= POLL_EVERY + 1
    assert sum(1 for s in range(100) if s in arrived_at.values()) < 100 / (POLL_EVERY - 1)


def test_polling_asks_far_fewer_queries_than_steps(gpu: FakeGpu) -> None:
    for lag in (0, 1, 3, 12):
        gpu.__init__()  # type: ignore[misc]
        gpu.lag = lag
        clock = make_clock(gpu)
        got = run(clock, range(400))
        assert len(got) >= 400 - lag - POLL_EVERY - 1
        assert gpu.queries / 400 <= 0.75, (lag, gpu.queries)  # one query per step before


def test_a_gpu_falling_behind_and_catching_up_keeps_every_duration_in_order(
    gpu: FakeGpu,
) -> None:
    clock = make_clock(gpu)
    got: list[tuple[int, float]] = []
    for step in range(300):
        gpu.lag = step // 10 if step < 150 else max(0, 30 - (step - 150) // 3)  # 0 -> 15 -> 0
        got += clock.mark(step)
    assert [s for s, _ in got] == list(range(1, len(got) + 1))
    assert len(got) >= 300 - POLL_EVERY - 2 and all(ms == 10.0 for _, ms in got)
    assert gpu.queries / 300 <= 0.75


def test_events_are_reused_not_created_per_step(gpu: FakeGpu) -> None:
    gpu.lag = 2
    run(make_clock(gpu), range(300))
    assert gpu.created <= 2 * POLL_EVERY + 4


def test_a_stream_change_keeps_every_duration(gpu: FakeGpu) -> None:
    gpu.lag = 1
    clock = make_clock(gpu)
    got = run(clock, range(10))
    gpu.stream = "s1"  # the script moves its steps to another stream
    got += run(clock, range(10, 20))
    gpu.passed = 20
    got += clock.drain(1.0)[0]
    assert [s for s, _ in got] == list(range(1, 20))


def test_a_move_to_another_gpu_pairs_no_events_across_devices(gpu: FakeGpu) -> None:
    gpu.lag = 1
    gpu.stream = ("s", 0, 1)
    clock = make_clock(gpu)
    got = run(clock, range(20))
    gpu.stream = ("s", 1, 1)  # the script moved to cuda:1: pooled events stay behind
    got += run(clock, range(20, 40))
    gpu.passed = 40
    got += clock.drain(1.0)[0]
    assert [s for s, _ in got] == [s for s in range(1, 40) if s != 20]


def test_drain_returns_what_the_gpu_passes(gpu: FakeGpu) -> None:
    gpu.follow = False  # the GPU is behind at the end of training...
    clock = make_clock(gpu)
    assert run(clock, range(3)) == []
    gpu.passed = 3  # ...and catches up while the drain polls
    drained, done = clock.drain(1.0)
    assert done and drained == [(1, 10.0), (2, 10.0)]
    assert clock.lost_boundaries == 0


def test_drain_gives_up_on_a_gpu_that_never_finishes(gpu: FakeGpu) -> None:
    gpu.follow = False
    clock = make_clock(gpu)
    gpu.passed = 1
    run(clock, range(3))
    drained, done = clock.drain(0.05)  # polls, never synchronizes: returns
    assert not done and drained == []
    assert clock.lost_boundaries == 2


def test_a_gpu_far_behind_loses_the_oldest_boundaries_not_memory(gpu: FakeGpu) -> None:
    gpu.follow = False
    clock = make_clock(gpu)
    run(clock, range(clock_module.MAX_PENDING_EVENTS + 10))
    assert clock.lost_boundaries == 10
    assert len(clock._pending) == clock_module.MAX_PENDING_EVENTS


def test_other_modes_have_nothing_to_drain() -> None:
    assert StepClock("host").drain(0.0) == ([], True)


def test_host_mode_times_consecutive_steps() -> None:
    clock = StepClock("host")
    assert list(clock.mark(0)) == []
    ((step, duration),) = clock.mark(1)
    assert step == 1 and duration >= 0.0
    assert list(clock.mark(5)) == []  # not consecutive: no duration
