"""Frozen copy of the reverted step clock of c60ff5f, for bench/probes/clock_mark_probe.py
to measure (the device machine has no git history); only what the probe times is kept
(`mark` and `poll`; no end-of-training `wait_for_gpu`/`abandon`).

Step timing: CUDA events (default on GPU) or the host clock.

`StepClock.mark(step)` is called on the training thread at the end of every step:

- `cuda_event`: records a CUDA event on the stream current at the step's end and returns
  NaN; a step's duration is the GPU time between its end event and the previous one,
  read later by `poll()` on the control thread. The training thread only records: on
  the H200 VM `query()` and `elapsed_time()` cost 10-20 us each and
  `torch.cuda.current_stream()` 40 us (bench/results/event_clock_probe_h200.json), so
  the stream is looked up every `STREAM_RECHECK` steps, not every step, and the reads
  run on the control thread, once per round. Events are polled, never waited on.
- `host_sync`: the seed recipe: `torch.cuda.synchronize()` then the host clock, exact
  and immediate (returned by `mark`), at the cost of a synchronize per step.
- `host`: the host clock alone (CPU training, where there is nothing to wait for).

The first step has no start boundary (distanom must not touch CUDA before the script
picks its device), so durations start with step 1. Durations reach the control thread
with the step's mark (host modes) or from `poll()` (`inbox.PendingSteps` joins them).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any

import torch

# Pending CUDA events are bounded: if they pile up this far (a GPU far behind, or no
# thread polling any more), new boundaries get no event (their steps no duration)
# rather than growing memory.
MAX_PENDING_EVENTS = 8192
# The stream an event is recorded on is looked up again every this many steps: a script
# that changes the stream its steps end on is timed on the new one from then on.
STREAM_RECHECK = 64


class StepClock:
    """Times consecutive step boundaries; see the module docstring for the modes.
    `mark` is the training thread's; `poll` and `abandon` may run on another thread
    (serialized by a lock the training thread never takes)."""

    def __init__(self, mode: str) -> None:
        if mode not in ("cuda_event", "host_sync", "host"):
            raise ValueError(f"unknown clock mode {mode!r}")
        self.mode = mode
        self._last_host_ns: int | None = None
        self._last_step: int | None = None
        # (step, event, stream generation) in record order: appended by the training
        # thread, taken by `poll`
        self._pending: collections.deque[tuple[int, Any, int]] = collections.deque()
        self._previous_event: tuple[int, Any] | None = None
        self._spare_events: collections.deque[Any] = collections.deque()
        self._stream: Any = None
        self._generation = 0  # counts the streams events were recorded on
        self._marks_on_stream = 0
        self._poll_lock = threading.Lock()
        self.lost_boundaries = 0

    def mark(self, step: int) -> float:
        """Mark the end of `step`: its duration in ms when known now (host modes), else
        NaN (`cuda_event`: `poll` gives it once the GPU has passed the boundary)."""
        if self.mode == "cuda_event":
            self._record(step)
            return math.nan
        if self.mode == "host_sync":
            torch.cuda.synchronize()
        now = time.perf_counter_ns()
        duration = math.nan
        if self._last_host_ns is not None and self._last_step == step - 1:
            duration = (now - self._last_host_ns) / 1e6
        self._last_host_ns, self._last_step = now, step
        return duration

    def _record(self, step: int) -> None:
        if len(self._pending) >= MAX_PENDING_EVENTS:
            self.lost_boundaries += 1
            return
        if self._stream is None or self._marks_on_stream >= STREAM_RECHECK:
            stream = torch.cuda.current_stream()
            if stream != self._stream:
                self._stream = stream
                self._generation += 1
            self._marks_on_stream = 0
        self._marks_on_stream += 1
        spare = self._spare_events
        event = spare.pop() if spare else torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        self._pending.append((step, event, self._generation))

    def poll(self) -> list[tuple[int, float]]:
        """Durations of every boundary the GPU has passed since the last call, in step
        order (`cuda_event`; other modes have nothing pending)."""
        out: list[tuple[int, float]] = []
        with self._poll_lock:
            pending = self._pending
            if not pending:
                return out
            # one stream's events complete in order: when the newest is done, all are
            # (one query, not one per step); across a stream change, read from the oldest
            queued = len(pending)  # the training thread may append meanwhile
            done = 0
            if pending[0][2] == pending[queued - 1][2] and pending[queued - 1][1].query():
                done = queued
            else:
                while done < queued and pending[done][1].query():
                    done += 1
            for _ in range(done):
                step, event, _ = pending.popleft()
                previous = self._previous_event
                if previous is not None:
                    if previous[0] == step - 1:
                        out.append((step, float(previous[1].elapsed_time(event))))
                    self._spare_events.append(previous[1])
                self._previous_event = (step, event)
        return out
