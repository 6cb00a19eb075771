"""Step timing on the training thread: CUDA events (default on GPU) or the host clock.

`StepClock.mark(step)` is called at the end of every step and returns the durations that
became known since the last call, as `(step, duration_ms)` pairs in step order:

- `cuda_event`: records a CUDA event on the current stream at each step end; a step's
  duration is the GPU time between its end event and the previous one. Events are
  polled with `query()`, never waited on, so the training thread does not synchronize
  and durations arrive a few steps late, `POLL_EVERY` at a time. Deferred (the agent's
  `boundary.DEFER_EVENT_READS`, off): `mark` only records, and the control thread reads
  the events once a round (`collect`, then `release` once the step's phase events are
  read too).
- `host_sync`: the seed recipe: `torch.cuda.synchronize()` then the host clock, exact
  and immediate, at the cost of a synchronize per step.
- `host`: the host clock alone (CPU training, where there is nothing to wait for).
- `adaptive` (opt-in): CUDA events while they are needed or cheap next to the step;
  the host clock while steps are short (under `HOST_BELOW_MS`, where an event per step
  costs 0.5% and more of a launch-bound step on the H200 VM: docs/agent.md) and the GPU
  keeps up with the host, which is when both clocks give the same durations. It
  switches to the host clock only after `AGREE_STEPS` event-timed steps agreed with the
  host clock within a step of the GPU; while on it, a pair of events every
  `CHECK_EVERY` steps checks that they still agree, and a check that fails or a step
  `SPIKE_FACTOR` times the typical one brings the events back. What it gives up (why it
  is not the default): a GPU delay the host never waits for is not seen at all, and one
  it waits for is timed where the host waited, judged as a host stall, not `gpu_work`.

The event clock runs at every step of a launch-bound loop, so it makes as few calls as
it can (`CudaEventCalls`, docs/agent.md): the current stream is read as a tuple from
torch's C layer and a `Stream` object built only when it changes; events are pooled;
one poll every `POLL_EVERY` steps finds the newest event the GPU has passed with a query
or two (one stream's events complete in order), not one query per step.

A step whose boundary is the first after a CUDA graph capture (`distanom.graph_capture`)
gets no duration: its span holds the capture and the graph's replays, none of them a
step of the loop's. The first step has no start boundary (distanom must not touch CUDA
before the script picks its device), so durations start with step 1. Durations go to the
agent, which queues them for the consensus thread.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distanom.graph_capture import CAPTURES

# Pending CUDA events are bounded: if the GPU falls this far behind, the oldest
# boundaries are given up (their steps get no duration) rather than growing memory.
MAX_PENDING_EVENTS = 256
# A deferred clock's events wait for the control thread, which wakes about once a second
# or a round (at most `consensus.batch_steps`, 1,000 steps). As many steps as the
# boundary keeps the bookkeeping of (`boundary.KEEP_UNRESOLVED`, `phases.MAX_KEPT_STEPS`):
# after a longer stall of the reader the oldest steps are dropped whole, never made into
# records without their flags
MAX_DEFERRED_EVENTS = 2048
# Durations are read every this many steps: fewer queries, a few steps' more delay
# (far below the tracer's history, which the capture decision must not outlive).
POLL_EVERY = 4
NOTHING_NEW: tuple[tuple[int, float], ...] = ()
# The adaptive mode (see the module docstring; measured in docs/agent.md):
HOST_BELOW_MS = 10.0  # the host clock only for steps shorter than this
AGREE_STEPS = 256  # consecutive event-timed steps that must agree before the host clock
AGREE_SHARE, AGREE_FLOOR_MS = 0.1, 0.2  # agreement: within 10% of the step plus 0.2 ms
CHECK_EVERY = 128  # on the host clock, an event pair checks the agreement this often
EVENT_STEPS_AFTER_DISAGREEMENT = 4096  # a failed check keeps the events at least this long
SPIKE_FACTOR = 1.5  # a host-timed step this much over the typical one brings events back
TYPICAL_WEIGHT = 1 / 32  # the typical step: an exponential average of the durations


def resolve_mode(mode: str) -> str:
    """Turn `auto` (and `adaptive` without a GPU) into a concrete mode for this process
    (called at the first step end)."""
    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    if mode == "adaptive" and not gpu:
        return "host"  # nothing to adapt to: the host clock is all it would use
    if mode != "auto":
        return mode
    return "cuda_event" if gpu else "host"


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
    def use_device(index: Any) -> None:
        """Make `index` this thread's current device (a thread that reads events and has
        never set one would start a context on device 0: memory on another rank's GPU)."""
        torch.cuda.set_device(index)

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


@dataclass(slots=True)
class AdaptiveState:
    """What the adaptive mode keeps between boundaries."""

    on_host: bool = False  # timing by the host clock now
    want_host: bool = False  # the event-timed steps agreed: switch when the GPU is idle
    agreeing: int = 0  # consecutive event-timed steps that agreed with the host clock
    host_not_before: int = 0  # no switch to the host clock before this step
    typical_ms: float | None = None  # exponential average of the durations
    host_ns: dict[int, int] = field(default_factory=dict)  # event-timed: host time per boundary
    until_check: int = CHECK_EVERY
    check: list[tuple[int, Any, float]] = field(default_factory=list)  # a check pair so far
    check_events: list[Any] = field(default_factory=list)
    check_device: Any = None
    check_generation: int = 0  # the stream generation the pair so far was recorded on
    host_steps: int = 0


class StepClock:
    """Times consecutive step boundaries; see the module docstring for the modes."""

    def __init__(
        self,
        mode: str,
        calls: CudaEventCalls | None = None,
        now_ns: Callable[[], int] = time.perf_counter_ns,
        *,
        deferred: bool = False,
    ) -> None:
        if mode not in ("cuda_event", "host_sync", "host", "adaptive"):
            raise ValueError(f"unknown clock mode {mode!r}")
        self.mode = mode
        self._now_ns = now_ns
        self._last_host_ns: int | None = None
        self._last_step: int | None = None
        # (step, event, stream generation, device) in record order; events of two devices
        # are never paired
        self._pending: collections.deque[tuple[int, Any, int, Any]] = collections.deque()
        # (step, event, device) of the newest boundary the GPU has passed
        self._previous_event: tuple[int, Any, Any] | None = None
        self._spare_events: list[Any] = []
        events = mode in ("cuda_event", "adaptive")
        self._calls = calls if calls is not None or not events else CudaEventCalls()
        self._stream_key: Any = None
        self._stream: Any = None
        self._generation = 0  # counts the streams events were recorded on
        self._device: Any = None  # the device of the current stream
        self._behind = 1  # how many boundaries the GPU had not passed at the last poll
        self._until_poll = POLL_EVERY
        self.lost_boundaries = 0
        self.last_event: Any = None  # the CUDA event of the latest boundary (None: host-timed)
        self._adaptive = AdaptiveState() if mode == "adaptive" else None
        # deferred: `mark` only records; the control thread reads the events (`collect`)
        self.deferred = deferred and mode == "cuda_event"
        self._reader_device: Any = None  # the device `collect` set current on its thread
        # CUDA graph captures seen at the last mark; steps whose boundary is the first after
        # a capture, never given a duration (`mark`)
        self._captures_seen = CAPTURES.seen
        self._gaps: set[int] = set()

    @property
    def event_calls(self) -> CudaEventCalls | None:
        """The bound CUDA event calls (None for a host clock), for phase events."""
        return self._calls

    @property
    def behind(self) -> int:
        """How many boundaries the GPU had not passed at the last poll (at least 1)."""
        return self._behind

    @property
    def on_host_clock(self) -> bool:
        """Whether steps are timed by the host clock now (an adaptive clock switches)."""
        adaptive = self._adaptive
        return self.mode != "cuda_event" if adaptive is None else adaptive.on_host

    @property
    def host_timed_steps(self) -> int:
        """Steps an adaptive clock timed with the host clock so far."""
        return self._adaptive.host_steps if self._adaptive is not None else 0

    def mark(self, step: int) -> Sequence[tuple[int, float]]:
        """Mark the end of `step`; returns the (step, duration_ms) pairs that became known."""
        self.last_event = None
        if CAPTURES.seen != self._captures_seen:
            # a CUDA graph was captured since the last boundary (and maybe replayed many
            # times): this step's span is no step of the loop's, so it gets no duration
            self._captures_seen = CAPTURES.seen
            self._last_host_ns = None
            if self._calls is not None:  # event-timed: `_poll` pairs the events
                self._gaps.add(step)
        if self.mode == "cuda_event":
            return self._mark_event(step)
        if self._adaptive is not None:
            return self._mark_adaptive(step, self._adaptive)
        if self.mode == "host_sync":
            torch.cuda.synchronize()
        now = time.perf_counter_ns()
        out: list[tuple[int, float]] = []
        if self._last_host_ns is not None and self._last_step == step - 1:
            out.append((step, (now - self._last_host_ns) / 1e6))
        self._last_host_ns, self._last_step = now, step
        return out

    def _follow_stream(self, calls: CudaEventCalls) -> None:
        """Look up the current stream; a new one starts a generation (and a new device
        drops the spare events, which record on their own device only)."""
        key = calls.stream_key()
        if key != self._stream_key:
            self._stream_key, self._stream = key, calls.stream_of(key)
            self._generation += 1
            device = calls.device_of(key)
            if device != self._device:  # the script moved to another GPU
                self._device = device
                # a new list, not a clear: a deferred clock's reader may be appending
                self._spare_events = []

    def _mark_event(self, step: int) -> Sequence[tuple[int, float]]:
        calls = self._calls
        assert calls is not None
        self._follow_stream(calls)
        spare = self._spare_events
        event = spare.pop() if spare else calls.new_event()
        calls.record(event, self._stream)
        self.last_event = event
        pending = self._pending
        pending.append((step, event, self._generation, self._device))
        if self.deferred:  # the reader polls, drops and recycles (this thread appends, and
            # pops only when no reader has come for twice the reader's own bound)
            if len(pending) > 2 * MAX_DEFERRED_EVENTS:  # no reader any more: bound memory
                with contextlib.suppress(IndexError):
                    pending.popleft()
                self.lost_boundaries += 1
            return NOTHING_NEW
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
        out, passed_events = self._poll()
        self.release(passed_events)
        return out

    def collect(self, through_step: int) -> tuple[list[tuple[int, float]], list[tuple[Any, Any]]]:
        """A deferred clock's read (the control thread, never with `drain` at once): the
        durations the GPU has given since the last call, of steps up to `through_step`
        (the last whose boundary finished its bookkeeping: a later one's event may be
        pending already), and the (event, device) pairs passed, for `release` once
        nothing reads them any more (a step's phase events are read against its boundary
        events). Beyond MAX_DEFERRED_EVENTS pending, the oldest boundaries are given up."""
        device = self._device  # the reader's own thread is on the events' device
        if device is not None and device != self._reader_device:
            self._calls.use_device(device)  # type: ignore[union-attr]
            self._reader_device = device
        pending = self._pending
        excess = len(pending) - MAX_DEFERRED_EVENTS
        if excess > 0:
            for _ in range(excess):
                pending.popleft()
            self.lost_boundaries += excess
            self._previous_event = None
        return self._poll(through_step)

    def release(self, passed_events: list[tuple[Any, Any]]) -> None:
        """Give events `poll` or `collect` passed back to the pool (those of the current
        device: an event records on its own device only)."""
        spare, device_now = self._spare_events, self._device
        for event, device in passed_events:
            if device == device_now:
                spare.append(event)

    def _poll(
        self, through_step: int | None = None
    ) -> tuple[list[tuple[int, float]], list[tuple[Any, Any]]]:
        out: list[tuple[int, float]] = []
        freed: list[tuple[Any, Any]] = []
        pending = self._pending
        if not pending:
            return out, freed
        passed = self._passed()
        if through_step is not None:  # pending is in step order: the newest come off
            while passed and pending[passed - 1][0] > through_step:
                passed -= 1
        self._behind = max(1, len(pending) - passed)
        elapsed_ms = self._calls.elapsed_ms  # type: ignore[union-attr]
        previous = self._previous_event
        gaps = self._gaps
        for _ in range(passed):
            step, event, _generation, device = pending.popleft()
            if previous is not None:
                if previous[0] == step - 1 and previous[2] == device and step not in gaps:
                    out.append((step, float(elapsed_ms(previous[1], event))))
                freed.append((previous[1], previous[2]))
            previous = (step, event, device)
        self._previous_event = previous
        if gaps and previous is not None:
            gaps.difference_update([gap for gap in list(gaps) if gap <= previous[0]])
        return out, freed

    def drain(self, timeout_s: float = 10.0) -> tuple[list[tuple[int, float]], bool]:
        """At the end of training: the outstanding boundaries, polled until the GPU has
        passed them all or `timeout_s` passes (a hung GPU must not hang the exit).
        Returns the durations and whether the GPU got through; boundaries it never
        reached are dropped and counted in `lost_boundaries`."""
        out: list[tuple[int, float]] = []
        if self.mode not in ("cuda_event", "adaptive"):
            return out, True
        deadline = time.monotonic() + timeout_s
        if self._adaptive is not None and self._adaptive.on_host:
            return out, self._gpu_passes_a_last_event(deadline)
        while True:
            out += self.poll()
            if not self._pending:
                return out, True
            if time.monotonic() >= deadline:
                self.lost_boundaries += len(self._pending)
                self._pending.clear()
                return out, False
            time.sleep(0.001)

    def _gpu_passes_a_last_event(self, deadline: float) -> bool:
        """On the host clock at the end: whether the GPU gets through its queued work by
        `deadline` (an event recorded now, polled; a hung GPU must not hang the exit)."""
        calls = self._calls
        assert calls is not None
        self._follow_stream(calls)
        event = calls.new_event()
        calls.record(event, self._stream)
        while not calls.query(event):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    # -- the adaptive mode -----------------------------------------------------------------

    def _mark_adaptive(self, step: int, state: AdaptiveState) -> Sequence[tuple[int, float]]:
        now = self._now_ns()
        last_ns, last_step = self._last_host_ns, self._last_step
        self._last_host_ns, self._last_step = now, step
        follows = last_ns is not None and last_step == step - 1
        if state.on_host:
            if not follows or last_ns is None:
                return NOTHING_NEW
            ms = (now - last_ns) / 1e6
            state.host_steps += 1
            typical = state.typical_ms
            if typical is not None and ms > SPIKE_FACTOR * typical:
                # a slow step: time the next ones on the GPU (this one stays host-timed)
                return self._back_to_events(step, now, ms, state, step + AGREE_STEPS)
            if typical is not None:
                state.typical_ms = typical = typical + (ms - typical) * TYPICAL_WEIGHT
                if typical >= HOST_BELOW_MS:  # steps grew: an event per step is cheap again
                    return self._back_to_events(step, now, ms, state, step + AGREE_STEPS)
            state.until_check -= 1
            if state.until_check <= 0 and not self._check_agrees(step, ms, state):
                hold = step + EVENT_STEPS_AFTER_DISAGREEMENT
                return self._back_to_events(step, now, ms, state, hold)
            return ((step, ms),)
        polled: list[tuple[int, float]] = []
        if state.want_host:
            polled, switched = self._to_host(step, now, last_ns if follows else None, state)
            if switched:
                return polled
        out = self._mark_event(step)
        state.host_ns[step] = now
        if out:
            self._judge_agreement(out, state)
        return [*polled, *out] if polled else out

    def _judge_agreement(self, out: Sequence[tuple[int, float]], state: AdaptiveState) -> None:
        """Compare event-timed durations with the host clock's for the same steps; ask for
        the host clock once enough consecutive short steps agreed."""
        host_ns = state.host_ns
        for step, ms in out:
            end, start = host_ns.get(step), host_ns.pop(step - 1, None)
            typical = state.typical_ms
            state.typical_ms = ms if typical is None else typical + (ms - typical) * TYPICAL_WEIGHT
            if end is None or start is None:
                continue  # a gap (no earlier boundary): nothing to compare, no disagreement
            if abs((end - start) / 1e6 - ms) <= AGREE_SHARE * ms + AGREE_FLOOR_MS:
                state.agreeing += 1
            else:
                state.agreeing = 0
        if self._behind > 1:  # the GPU was more than a step behind the host at this poll
            state.agreeing = 0
        if len(host_ns) > 2 * MAX_PENDING_EVENTS:  # boundaries the GPU never timed
            newest = out[-1][0]
            for old in [s for s in host_ns if s < newest]:
                del host_ns[old]
        typical = state.typical_ms
        state.want_host = (
            state.agreeing >= AGREE_STEPS
            and typical is not None
            and typical < HOST_BELOW_MS
            and out[-1][0] >= state.host_not_before
        )

    def _to_host(
        self, step: int, now: int, last_ns: int | None, state: AdaptiveState
    ) -> tuple[list[tuple[int, float]], bool]:
        """Switch to the host clock at this boundary if the GPU has passed every event
        (so no step is timed twice, and durations stay in step order). Returns the
        durations read on the way (kept even when it does not switch) and whether it did."""
        calls, pending = self._calls, self._pending
        assert calls is not None
        if pending and not calls.query(pending[-1][1]):
            return [], False
        out = self.poll() if pending else []
        if pending:  # another stream's events, passed out of order: next boundary
            return out, False
        if last_ns is not None:
            out.append((step, (now - last_ns) / 1e6))
            state.host_steps += 1
        previous = self._previous_event
        if previous is not None and previous[2] == self._device:
            self._spare_events.append(previous[1])
        self._previous_event = None
        state.on_host, state.want_host, state.agreeing = True, False, 0
        state.until_check = CHECK_EVERY
        state.host_ns.clear()
        return out, True

    def _back_to_events(
        self, step: int, now: int, ms: float, state: AdaptiveState, hold_until: int
    ) -> Sequence[tuple[int, float]]:
        """Leave the host clock at this boundary: this step is host-timed, its event
        starts the next step's duration."""
        state.on_host, state.agreeing = False, 0
        state.host_not_before = hold_until
        state.check.clear()
        state.host_ns.clear()
        self._previous_event = None
        out = [(step, ms), *self._mark_event(step)]
        state.host_ns[step] = now
        return out

    def _check_agrees(self, step: int, host_ms: float, state: AdaptiveState) -> bool:
        """On the host clock: record a pair of events on two consecutive boundaries, and
        at the one after, compare their GPU time with the host's. False when it differs
        or the GPU has not passed the pair a step later (it fell behind the host)."""
        calls = self._calls
        assert calls is not None
        check = state.check
        if len(check) < 2:
            self._follow_stream(calls)
            if state.check_device != self._device or len(state.check_events) < 2:
                state.check_events = [calls.new_event(), calls.new_event()]
                state.check_device = self._device
                check.clear()  # a pair never spans two devices
            if check and state.check_generation != self._generation:
                check.clear()  # nor two streams: start the pair again on this one
            state.check_generation = self._generation
            event = state.check_events[len(check)]
            calls.record(event, self._stream)
            check.append((step, event, host_ms))
            return True
        (first_step, first, _), (second_step, second, pair_host_ms) = check
        check.clear()
        state.until_check = CHECK_EVERY
        if second_step != first_step + 1 or step != second_step + 1:
            return True  # not consecutive (cannot happen while steps count by one)
        if not (calls.query(first) and calls.query(second)):
            return False
        try:
            gpu_ms = float(calls.elapsed_ms(first, second))
        except Exception:  # an unreadable pair: time with events again, never stop timing
            return False
        return abs(pair_host_ms - gpu_ms) <= AGREE_SHARE * gpu_ms + AGREE_FLOOR_MS
