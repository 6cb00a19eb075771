"""Step timing on the training thread: CUDA events (default on GPU) or the host clock.

`StepClock.mark(step)` is called at the end of every step and returns the durations that
became known since the last call, as `(step, duration_ms)` pairs in step order:

- `cuda_event`: records a CUDA event on the current stream at each step end; a step's
  duration is the GPU time between its end event and the previous one. Events are
  polled with `query()`, never waited on, so the training thread does not synchronize
  and durations arrive a few steps late, `POLL_EVERY` at a time.
- `host_sync`: the seed recipe: `torch.cuda.synchronize()` then the host clock, exact
  and immediate, at the cost of a synchronize per step.
- `host`: the host clock alone (CPU training, where there is nothing to wait for).

The event clock runs at every step of a launch-bound loop, so it makes as few calls as
it can (`CudaEventCalls`, docs/agent.md): the current stream is read as a tuple from
torch's C layer and a `Stream` object built only when it changes; events are pooled;
one poll every `POLL_EVERY` steps finds the newest event the GPU has passed with a query
or two (one stream's events complete in order), not one query per step.

The first step has no start boundary (distanom must not touch CUDA before the script
picks its device), so durations start with step 1. Durations go to the agent, which
queues them for the consensus thread.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Pending CUDA events are bounded: if the GPU falls this far behind, the oldest
# boundaries are given up (their steps get no duration) rather than growing memory.
MAX_PENDING_EVENTS = 256
# Durations are read every this many steps: fewer queries, a few steps' more delay
# (far below the tracer's history, which the capture decision must not outlive).
POLL_EVERY = 4
NOTHING_NEW: tuple[tuple[int, float], ...] = ()


def resolve_mode(mode: str) -> str:
    """Turn `auto` into a concrete mode for this process (called at the first step end)."""
    if mode != "auto":
        return mode
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "cuda_event"
    return "host"


class CudaEventCalls:
    """The CUDA calls the event clock makes, bound once. Uses torch's C-level event
    methods and stream lookup where they exist and agree with the public API (checked
    here, once); otherwise the public `torch.cuda` calls."""

    def __init__(self) -> None:
        public: Any = torch.cuda.Event
        self.new_event: Callable[[], Any] = lambda: public(enable_timing=True)
        self.record: Callable[[Any, Any], None] = public.record
        self.query: Callable[[Any], bool] = public.query
        self.elapsed_ms: Callable[[Any, Any], float] = public.elapsed_time
        self.stream_key: Callable[[], Any] = torch.cuda.current_stream
        self.fast = False
        base = getattr(torch._C, "_CudaEventBase", None)
        get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
        get_device = getattr(torch._C, "_cuda_getDevice", None)
        if base is None or get_stream is None or get_device is None:
            return
        try:
            key = get_stream(get_device())
            if self.stream_of(key) != torch.cuda.current_stream() or not issubclass(public, base):
                return
        except Exception:  # another torch's layout: the public calls serve
            return
        self.record, self.query, self.elapsed_ms = base.record, base.query, base.elapsed_time
        self.stream_key = lambda: get_stream(get_device())
        self.fast = True

    @staticmethod
    def stream_of(key: Any) -> Any:
        """The `torch.cuda.Stream` a stream key names (a key is a Stream on the public path)."""
        if isinstance(key, tuple):
            stream_id, device_index, device_type = key
            return torch.cuda.Stream(
                stream_id=stream_id, device_index=device_index, device_type=device_type
            )
        return key

    @staticmethod
    def device_of(key: Any) -> Any:
        """The device index a stream key is on."""
        return key[1] if isinstance(key, tuple) else getattr(key, "device_index", None)


class StepClock:
    """Times consecutive step boundaries; see the module docstring for the modes."""

    def __init__(self, mode: str, calls: CudaEventCalls | None = None) -> None:
        if mode not in ("cuda_event", "host_sync", "host"):
            raise ValueError(f"unknown clock mode {mode!r}")
        self.mode = mode
        self._last_host_ns: int | None = None
        self._last_step: int | None = None
        # (step, event, stream generation, device) in record order; events of two devices
        # are never paired
        self._pending: collections.deque[tuple[int, Any, int, Any]] = collections.deque()
        # (step, event, device) of the newest boundary the GPU has passed
        self._previous_event: tuple[int, Any, Any] | None = None
        self._spare_events: list[Any] = []
        self._calls = calls if calls is not None or mode != "cuda_event" else CudaEventCalls()
        self._stream_key: Any = None
        self._stream: Any = None
        self._generation = 0  # counts the streams events were recorded on
        self._device: Any = None  # the device of the current stream
        self._behind = 1  # how many boundaries the GPU had not passed at the last poll
        self._until_poll = POLL_EVERY
        self.lost_boundaries = 0

    def mark(self, step: int) -> Sequence[tuple[int, float]]:
        """Mark the end of `step`; returns the (step, duration_ms) pairs that became known."""
        if self.mode == "cuda_event":
            return self._mark_event(step)
        if self.mode == "host_sync":
            torch.cuda.synchronize()
        now = time.perf_counter_ns()
        out: list[tuple[int, float]] = []
        if self._last_host_ns is not None and self._last_step == step - 1:
            out.append((step, (now - self._last_host_ns) / 1e6))
        self._last_host_ns, self._last_step = now, step
        return out

    def _mark_event(self, step: int) -> Sequence[tuple[int, float]]:
        calls = self._calls
        assert calls is not None
        key = calls.stream_key()
        if key != self._stream_key:
            self._stream_key, self._stream = key, calls.stream_of(key)
            self._generation += 1
            device = calls.device_of(key)
            if device != self._device:  # the script moved to another GPU
                self._device = device
                self._spare_events.clear()  # an event records on its own device only
        spare = self._spare_events
        event = spare.pop() if spare else calls.new_event()
        calls.record(event, self._stream)
        pending = self._pending
        pending.append((step, event, self._generation, self._device))
        if len(pending) > MAX_PENDING_EVENTS:
            pending.popleft()
            self.lost_boundaries += 1
            self._previous_event = None
        self._until_poll -= 1
        if self._until_poll > 0:
            return NOTHING_NEW
        self._until_poll = POLL_EVERY
        return self.poll()

    def _passed(self) -> int:
        """How many pending boundaries (from the oldest) the GPU has passed."""
        pending, query = self._pending, self._calls.query  # type: ignore[union-attr]
        count = len(pending)
        if pending[0][2] != pending[-1][2]:
            # a stream change: no completion order across streams, ask each in turn
            passed = 0
            while passed < count and query(pending[passed][1]):
                passed += 1
            return passed
        # one stream: its events complete in order, so search from where the GPU was
        # last time (about as far behind): usually two queries
        index = max(0, count - 1 - self._behind)
        if query(pending[index][1]):
            index += 1
            while index < count and query(pending[index][1]):
                index += 1
            return index
        while index > 0:
            index -= 1
            if query(pending[index][1]):
                return index + 1
        return 0

    def poll(self) -> list[tuple[int, float]]:
        """Durations of every boundary the GPU has passed since the last call."""
        out: list[tuple[int, float]] = []
        pending = self._pending
        if not pending:
            return out
        passed = self._passed()
        self._behind = max(1, len(pending) - passed)
        elapsed_ms, spare = self._calls.elapsed_ms, self._spare_events  # type: ignore[union-attr]
        previous = self._previous_event
        device_now = self._device
        for _ in range(passed):
            step, event, _generation, device = pending.popleft()
            if previous is not None:
                if previous[0] == step - 1 and previous[2] == device:
                    out.append((step, float(elapsed_ms(previous[1], event))))
                if previous[2] == device_now:
                    spare.append(previous[1])
            previous = (step, event, device)
        self._previous_event = previous
        return out

    def drain(self, timeout_s: float = 10.0) -> tuple[list[tuple[int, float]], bool]:
        """At the end of training: the outstanding boundaries, polled until the GPU has
        passed them all or `timeout_s` passes (a hung GPU must not hang the exit).
        Returns the durations and whether the GPU got through; boundaries it never
        reached are dropped and counted in `lost_boundaries`."""
        out: list[tuple[int, float]] = []
        if self.mode != "cuda_event":
            return out, True
        deadline = time.monotonic() + timeout_s
        while True:
            out += self.poll()
            if not self._pending:
                return out, True
            if time.monotonic() >= deadline:
                self.lost_boundaries += len(self._pending)
                self._pending.clear()
                return out, False
            time.sleep(0.001)
