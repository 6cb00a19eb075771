"""The adaptive step clock on a fake GPU and a fake host clock: it moves to the host
clock only when short event-timed steps agreed with it and the GPU kept up, checks the
agreement with an event pair now and then, returns to events when a check fails or a
step spikes, and never loses, repeats or reorders a step across its switches."""

from __future__ import annotations

from typing import Any

from distanom import clock as clock_module
from distanom.clock import (
    AGREE_STEPS,
    CHECK_EVERY,
    EVENT_STEPS_AFTER_DISAGREEMENT,
    StepClock,
)


class Event:
    def __init__(self) -> None:
        self.seq: int | None = None
        self.at_ms = 0.0


class Machine:
    """A host clock and a GPU. The host takes `host_ms` per step; the GPU finishes a
    step's work `gpu_ms` after the later of its start and the previous step's end, so
    with gpu_ms <= host_ms it keeps up (an event completes before the next boundary)."""

    def __init__(self, host_ms: float = 3.0, gpu_ms: float = 2.5) -> None:
        self.host_ms, self.gpu_ms = host_ms, gpu_ms
        self.now_ms = 0.0
        self.gpu_done_ms = 0.0  # when the GPU finishes the work queued so far
        self.records = 0
        self.created = 0

    # the host side
    def now_ns(self) -> int:
        return int(self.now_ms * 1e6)

    def advance(self, host_ms: float | None = None, gpu_ms: float | None = None) -> None:
        """One step: the host launches for `host_ms`; the GPU work it queued takes `gpu_ms`."""
        start = max(self.now_ms, self.gpu_done_ms)
        self.gpu_done_ms = start + (self.gpu_ms if gpu_ms is None else gpu_ms)
        self.now_ms += self.host_ms if host_ms is None else host_ms

    # what the clock calls (CudaEventCalls)
    def new_event(self) -> Event:
        self.created += 1
        return Event()

    def stream_key(self) -> Any:
        return "s0"

    @staticmethod
    def stream_of(key: Any) -> Any:
        return key

    @staticmethod
    def device_of(key: Any) -> Any:
        return 0

    def record(self, event: Event, stream: Any) -> None:
        self.records += 1
        event.seq, event.at_ms = self.records, max(self.now_ms, self.gpu_done_ms)

    def query(self, event: Event) -> bool:
        return event.at_ms <= self.now_ms

    def elapsed_ms(self, start: Event, end: Event) -> float:
        assert self.query(start) and self.query(end), "read before done"
        return end.at_ms - start.at_ms


def make(machine: Machine) -> StepClock:
    return StepClock("adaptive", calls=machine, now_ns=machine.now_ns)  # type: ignore[arg-type]


def run(clock: StepClock, machine: Machine, steps: range, **step: float) -> dict[int, float]:
    got: dict[int, float] = {}
    for s in steps:
        machine.advance(**step)
        for done, ms in clock.mark(s):
            assert done not in got, f"step {done} timed twice"
            got[done] = ms
    return got


def test_short_steps_the_gpu_keeps_up_with_move_to_the_host_clock() -> None:
    machine = Machine(host_ms=3.0, gpu_ms=2.5)
    clock = make(machine)
    got = run(clock, machine, range(0, AGREE_STEPS + 50))
    assert clock.on_host_clock
    assert clock.host_timed_steps > 0
    # every step from 1 on timed once, in order of steps, 3 ms each (both clocks agree)
    assert sorted(got) == list(range(1, AGREE_STEPS + 50))
    assert all(abs(ms - 3.0) < 1e-6 for ms in got.values())
    # on the host clock, only the check pairs record events
    records = machine.records
    run(clock, machine, range(AGREE_STEPS + 50, AGREE_STEPS + 50 + 10 * CHECK_EVERY))
    assert machine.records - records <= 2 * 10 + 2
    assert clock.on_host_clock


def test_long_steps_keep_their_events() -> None:
    machine = Machine(host_ms=12.0, gpu_ms=11.0)
    clock = make(machine)
    got = run(clock, machine, range(0, 3 * AGREE_STEPS))
    assert not clock.on_host_clock and clock.host_timed_steps == 0
    assert len(got) >= 3 * AGREE_STEPS - 8  # the last few are still in flight


def test_a_gpu_behind_the_host_keeps_the_events() -> None:
    # GPU-bound: the host queues work faster than the GPU runs it
    machine = Machine(host_ms=1.0, gpu_ms=3.0)
    clock = make(machine)
    got = run(clock, machine, range(0, 3 * AGREE_STEPS))
    assert not clock.on_host_clock and clock.host_timed_steps == 0
    assert all(abs(ms - 3.0) < 1e-6 for ms in list(got.values())[5:])  # GPU time, not host


def test_a_failed_check_brings_the_events_back_for_a_while() -> None:
    machine = Machine(host_ms=3.0, gpu_ms=2.5)
    clock = make(machine)
    got = run(clock, machine, range(0, AGREE_STEPS + 20))
    assert clock.on_host_clock
    # the loop turns GPU-bound: the next check finds the GPU behind
    start = AGREE_STEPS + 20
    got |= run(clock, machine, range(start, start + 2 * CHECK_EVERY), gpu_ms=4.0)
    assert not clock.on_host_clock
    back_at = max(s for s in got if abs(got[s] - 3.0) < 1e-6 and s >= start)
    # the GPU turns fast again; the events stay for EVENT_STEPS_AFTER_DISAGREEMENT steps
    more = start + 2 * CHECK_EVERY
    got |= run(clock, machine, range(more, back_at + EVENT_STEPS_AFTER_DISAGREEMENT - 10))
    assert not clock.on_host_clock
    got |= run(
        clock,
        machine,
        range(
            back_at + EVENT_STEPS_AFTER_DISAGREEMENT - 10,
            back_at + EVENT_STEPS_AFTER_DISAGREEMENT + 2 * AGREE_STEPS,
        ),
    )
    assert clock.on_host_clock
    last = back_at + EVENT_STEPS_AFTER_DISAGREEMENT + 2 * AGREE_STEPS - 1
    assert sorted(got) == list(range(1, last + 1))


def test_a_spike_on_the_host_clock_is_timed_and_brings_the_events_back() -> None:
    machine = Machine(host_ms=3.0, gpu_ms=2.5)
    clock = make(machine)
    first = AGREE_STEPS + 20
    got = run(clock, machine, range(0, first))
    assert clock.on_host_clock
    got |= run(clock, machine, range(first, first + 1), host_ms=30.0)  # a host stall
    assert got[first] == 30.0
    assert not clock.on_host_clock
    got |= run(clock, machine, range(first + 1, first + 40))
    assert not clock.on_host_clock  # events again, until the steps agree anew
    assert sorted(got) == list(range(1, max(got) + 1))  # none lost, none twice
    assert max(got) >= first + 40 - 1 - clock_module.POLL_EVERY
    assert all(abs(got[s] - 3.0) < 1e-6 for s in range(first + 1, first + 30))


def test_the_adaptive_mode_is_chosen_by_name_only(monkeypatch: Any) -> None:
    monkeypatch.setattr(clock_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(clock_module.torch.cuda, "is_initialized", lambda: True)
    assert clock_module.resolve_mode("auto") == "cuda_event"
    assert clock_module.resolve_mode("adaptive") == "adaptive"


def test_the_adaptive_mode_without_a_gpu_is_the_host_clock(monkeypatch: Any) -> None:
    monkeypatch.setattr(clock_module.torch.cuda, "is_available", lambda: False)
    assert clock_module.resolve_mode("adaptive") == "host"


class Streams(Machine):
    """The machine with a current stream the script can change, events the GPU can hold
    back (`stuck`: another stream's work it waits on), and an `elapsed_ms` that fails as
    CUDA does on an event not yet done."""

    def __init__(self) -> None:
        super().__init__(host_ms=3.0, gpu_ms=2.5)
        self.stream = "s0"
        self.stuck: set[int] = set()
        self.hung = False

    def stream_key(self) -> Any:
        return self.stream

    def query(self, event: Event) -> bool:
        return not self.hung and event.seq not in self.stuck and super().query(event)

    def elapsed_ms(self, start: Event, end: Event) -> float:
        if not (self.query(start) and self.query(end)):
            raise RuntimeError("CUDA error: device not ready")
        return end.at_ms - start.at_ms


def test_drain_reads_the_last_event_timed_steps() -> None:
    machine = Machine(host_ms=12.0, gpu_ms=11.0)  # long steps: events all along
    clock = make(machine)
    got = run(clock, machine, range(0, 50))
    machine.advance()  # the GPU finishes what was queued
    drained, done = clock.drain(1.0)
    assert done and sorted({**got, **dict(drained)}) == list(range(1, 50))


def test_drain_on_the_host_clock_still_sees_a_hung_gpu() -> None:
    machine = Streams()
    clock = make(machine)
    run(clock, machine, range(0, AGREE_STEPS + 20))
    assert clock.on_host_clock
    assert clock.drain(1.0) == ([], True)
    machine.hung = True
    assert clock.drain(0.05) == ([], False)  # the exit does not wait on it


def test_a_stream_change_while_switching_to_the_host_clock_loses_no_step() -> None:
    machine = Streams()
    clock = make(machine)
    assert clock._adaptive is not None
    got: dict[int, float] = {}
    step = 0
    while not clock._adaptive.want_host:
        got |= run(clock, machine, range(step, step + 1))
        step += 1
    clock._adaptive.want_host = False  # two more event-timed boundaries first
    got |= run(clock, machine, range(step, step + 1))
    got |= run(clock, machine, range(step + 1, step + 2))
    machine.stuck.add(machine.records)  # that event's stream waits on other work
    machine.stream = "s1"
    got |= run(clock, machine, range(step + 2, step + 3))
    clock._adaptive.want_host = True
    got |= run(clock, machine, range(step + 3, step + 4))  # cannot switch yet
    machine.stuck.clear()
    got |= run(clock, machine, range(step + 4, step + 30))
    assert clock.on_host_clock
    assert sorted(got) == list(range(1, step + 30)) and clock.lost_boundaries == 0


def test_a_stream_change_inside_a_check_pair_neither_raises_nor_stops_timing() -> None:
    machine = Streams()
    clock = make(machine)
    assert clock._adaptive is not None
    step = AGREE_STEPS + 20
    got = run(clock, machine, range(0, step))
    assert clock.on_host_clock
    while not clock._adaptive.check:  # until the first event of a check pair is recorded
        got |= run(clock, machine, range(step, step + 1))
        step += 1
    machine.stuck.add(machine.records)  # its stream is busy with other work
    machine.stream = "s1"
    got |= run(clock, machine, range(step, step + 3 * CHECK_EVERY))
    assert sorted(got) == list(range(1, step + 3 * CHECK_EVERY))
    assert clock.on_host_clock  # the pair restarted on the new stream and agreed


def test_steps_growing_past_the_limit_leave_the_host_clock() -> None:
    machine = Machine(host_ms=3.0, gpu_ms=2.5)
    clock = make(machine)
    got = run(clock, machine, range(0, AGREE_STEPS + 20))
    assert clock.on_host_clock
    step, host_ms = AGREE_STEPS + 20, 3.0
    while host_ms < 30.0:  # 1% longer per step: never a spike
        host_ms *= 1.01
        got |= run(clock, machine, range(step, step + 1), host_ms=host_ms, gpu_ms=host_ms - 0.5)
        step += 1
    assert not clock.on_host_clock
    assert sorted(got) == list(range(1, max(got) + 1))
