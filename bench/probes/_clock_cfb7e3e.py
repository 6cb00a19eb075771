"""Frozen copy of distanom/clock.py at cfb7e3e, for bench/probes/clock_mark_probe.py to
measure beside the clock that replaced it (the device machine has no git history);
only what the probe times is kept (`mark` and the `poll` it makes; no `drain`).

Step timing on the training thread: CUDA events (default on GPU) or the host clock.

`StepClock.mark(step)` is called at the end of every step and returns the durations that
became known since the last call, as `(step, duration_ms)` pairs in step order:

- `cuda_event`: records a CUDA event on the current stream at each step end; a step's
  duration is the GPU time between its end event and the previous one. Events are
  polled with `query()`, never waited on, so the training thread does not synchronize
  and a duration arrives a step or two late.
- `host_sync`: the seed recipe: `torch.cuda.synchronize()` then the host clock, exact
  and immediate, at the cost of a synchronize per step.
- `host`: the host clock alone (CPU training, where there is nothing to wait for).

The first step has no start boundary (distanom must not touch CUDA before the script
picks its device), so durations start with step 1. Durations go to the agent, which
queues them for the consensus thread.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import torch

# Pending CUDA events are bounded: if the GPU falls this far behind, the oldest
# boundaries are given up (their steps get no duration) rather than growing memory.
MAX_PENDING_EVENTS = 256


class StepClock:
    """Times consecutive step boundaries; see the module docstring for the modes."""

    def __init__(self, mode: str) -> None:
        if mode not in ("cuda_event", "host_sync", "host"):
            raise ValueError(f"unknown clock mode {mode!r}")
        self.mode = mode
        self._last_host_ns: int | None = None
        self._last_step: int | None = None
        self._pending: collections.deque[tuple[int, Any]] = collections.deque()
        self._previous_event: tuple[int, Any] | None = None
        self._spare_events: list[Any] = []
        self.lost_boundaries = 0

    def mark(self, step: int) -> list[tuple[int, float]]:
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

    def _new_event(self) -> Any:
        if self._spare_events:
            return self._spare_events.pop()
        return torch.cuda.Event(enable_timing=True)

    def _mark_event(self, step: int) -> list[tuple[int, float]]:
        event = self._new_event()
        event.record()
        self._pending.append((step, event))
        if len(self._pending) > MAX_PENDING_EVENTS:
            self._pending.popleft()
            self.lost_boundaries += 1
            self._previous_event = None
        return self.poll()

    def poll(self) -> list[tuple[int, float]]:
        """Durations of every boundary the GPU has passed since the last call."""
        out: list[tuple[int, float]] = []
        while self._pending and self._pending[0][1].query():
            step, event = self._pending.popleft()
            previous = self._previous_event
            if previous is not None and previous[0] == step - 1:
                out.append((step, float(previous[1].elapsed_time(event))))
                self._spare_events.append(previous[1])
            self._previous_event = (step, event)
        return out
