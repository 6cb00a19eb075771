"""The tracer protocol every backend implements, and the step trace it hands on.

A tracer records device activity continuously and keeps the events of the last
`tracer.history_steps` steps in memory. The agent tells it where steps end
(`mark_step`, on the training thread, must be cheap); the capture worker later asks for
one step's events (`step_trace`, on a background thread) once all ranks have agreed that
the step is worth keeping. Events are chrome-trace dicts in Kineto's shape, so capture
can write them as a trace TraceLens, HTA and Perfetto open. Nothing here imports torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class Availability(enum.Enum):
    """Whether a step's events can be handed out now."""

    PENDING = "pending"  # not yet collected (the step's window or buffer is still open)
    READY = "ready"
    GONE = "gone"  # older than the history, never traced, or lost


@dataclass(frozen=True)
class StepTrace:
    """One step's events, ready to be written as a Kineto chrome trace.

    `events` use Kineto's conventions: `ts`/`dur` in microseconds relative to
    `base_time_ns` (Unix-epoch nanoseconds), `cat` kernel / gpu_memcpy / gpu_memset /
    cuda_runtime / cpu_op ..., `ph` X for spans, M for metadata, s/f for flows.
    `metadata` holds the trace's other top-level keys (deviceProperties, schemaVersion...).
    `stats` counts what the backend had to drop or flag (e.g. records with zero
    timestamps, records CUPTI reported dropped, kernels outside the step's bounds).
    """

    step: int
    events: list[dict[str, Any]]
    base_time_ns: int
    metadata: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class Tracer(Protocol):
    """A tracing backend. Implementations must never raise into the training thread
    from `mark_step`; `start`/`step_trace`/`close` may raise and are guarded by the agent."""

    name: str
    # flushes made at step boundaries so far: a step that follows one carries its cost
    boundary_flushes: int

    def start(self) -> None:
        """Begin recording. Called once, at the end of the first step (after the
        script has chosen its device)."""

    def mark_step(self, step: int, host_end_ns: int) -> None:
        """Step `step` just ended on the host at `host_end_ns` (time.time_ns())."""

    def set_tracing(self, on: bool) -> None:
        """Duty cycle: stop or resume recording from the next step on (the overhead
        governor uses it; detection keeps running either way). Called right after
        `mark_step`. A backend may defer the switch (e.g. during CUDA graph capture) or
        fail to make it: `tracing` says what is in force."""

    @property
    def tracing(self) -> bool:
        """Whether the step after the last boundary is being recorded."""

    @property
    def quiet(self) -> bool:
        """Whether tracing is off with no switch pending, and `mark_step` of a step that
        stays untraced then neither flushes nor switches: the boundary may skip the rest
        of its tracer work while the duty cycle keeps tracing off."""

    def end_of_training(self) -> None:
        """Training ended: stop recording; the steps already ended stay readable. Called
        on the training thread, only once the GPU has passed the last step boundary (a
        hung GPU must not hang the exit); `close` likewise."""

    def availability(self, step: int) -> Availability:
        """Whether `step_trace(step)` can answer now."""

    def step_trace(self, step: int) -> StepTrace:
        """The events of `step`. Raises KeyError if it is not READY."""

    def stats(self) -> dict[str, int]:
        """Counters for the run's status (records dropped, buffers held, switches)."""

    def close(self) -> None:
        """Stop recording and free buffers. Idempotent."""
