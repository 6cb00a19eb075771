"""What a round covers: how many steps (the same on every rank), and this rank's steps
collected into it.

Rounds cover consecutive steps from step 1, each as many as take about
`consensus.interval_ms` at the median step time, at most `batch_steps` (`steps_per_round`).
With a tracer, a round holding a step the duty cycle may trace ends within half the
tracer's history of it (`cut_at_trace`), so that step's trace is still kept when the
decision about it arrives; rounds away from traced steps are as long as without one.
`RoundBuilder` (control thread) collects the resolved steps and the evidence that rides
with them into the `LocalRound` that `distanom.consensus` encodes and gathers.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from distanom.consensus import MAX_EVIDENCE_BACKLOG, LocalRound, evidence_slots
from distanom.records.anomalies import StepEvidence


def traced_round_steps(history_steps: int) -> int:
    """The most steps a round may cover from its first traced step on: half the tracer's
    history, so that step's trace is still kept when the decision about it arrives."""
    return max(1, history_steps // 2)


def cut_at_trace(n: int, first: int, first_traced: int | None, history_steps: int) -> int:
    """A round of `n` steps from `first`, cut to end within `traced_round_steps` of its
    first (possibly) traced step; `first_traced` None: no step of it is traced."""
    if first_traced is None or first_traced > first + n - 1:
        return n
    return max(1, min(n, first_traced - first + traced_round_steps(history_steps)))


def steps_per_round(median_ms: float | None, interval_ms: float, max_steps: int) -> int:
    """How many steps the next round covers: as many as take about `interval_ms` at the
    median step time, 1 to `max_steps` (1 before a median exists). Every rank computes
    it from the same gathered data, so the rounds stay aligned."""
    if median_ms is None or not math.isfinite(median_ms) or median_ms <= 0:
        return 1
    return max(1, min(max_steps, int(interval_ms // median_ms)))


@dataclass
class RoundBuilder:
    """Collects this rank's resolved step durations into rounds (consensus thread only).

    A round covers `n` consecutive steps from `next_first` (n <= `batch_steps`, the row's
    room), the same n on every rank (`steps_per_round`)."""

    batch_steps: int
    next_first: int = 1
    _durations: dict[int, tuple[float, int, float]] = field(default_factory=dict)
    _max_step: int = 0
    _evidence: collections.deque[tuple[int, StepEvidence]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_EVIDENCE_BACKLOG)
    )

    def add_evidence(self, items: Sequence[tuple[int, StepEvidence]]) -> None:
        """Steps whose evidence became final, in step order; sent with the next rounds."""
        self._evidence.extend(items)

    def evidence_backlog(self) -> int:
        """Steps of evidence still waiting for a round."""
        return len(self._evidence)

    def _take_evidence(self, room: int) -> tuple[tuple[int, StepEvidence], ...]:
        out: list[tuple[int, StepEvidence]] = []
        slots = evidence_slots(room)
        while self._evidence and len(out) < slots:
            if out and self._evidence[0][0] != out[-1][0] + 1:
                break  # a gap: the rest goes with the next round
            out.append(self._evidence.popleft())
        return tuple(out)

    def add(self, step: int, duration_ms: float, step_flags: int, self_ms: float = 0.0) -> None:
        """Record a resolved step's duration and flags (steps already sent are ignored)."""
        if step >= self.next_first:
            self._durations[step] = (duration_ms, step_flags, self_ms)
            self._max_step = max(self._max_step, step)

    def add_many(self, steps: Iterable[tuple[int, float, int, float]]) -> None:
        """`add` for each (step, duration_ms, step_flags, self_ms), in one loop: a round's
        steps at once on the control thread."""
        durations, first, top = self._durations, self.next_first, self._max_step
        for step, duration_ms, step_flags, self_ms in steps:
            if step >= first:
                durations[step] = (duration_ms, step_flags, self_ms)
                if step > top:
                    top = step
        self._max_step = top

    def ready(self, n: int | None = None) -> bool:
        """A round of `n` steps (default `batch_steps`) is ready once a step at or past its
        end has resolved (gaps become NaN)."""
        return self.missing(n) == 0

    def missing(self, n: int | None = None) -> int:
        """Steps still to resolve before a round of `n` steps is ready."""
        end = self.next_first + (n or self.batch_steps) - 1
        return max(0, end - self._max_step)

    def pending_steps(self) -> int:
        """How many steps (gaps included) are waiting for the next rounds."""
        return max(0, self._max_step - self.next_first + 1)

    def take(self, n: int | None = None, *, final: bool = False) -> LocalRound:
        """The next round of `n` steps (default `batch_steps`); with `final`, a possibly
        partial one covering what is left of them."""
        first = self.next_first
        size = min(n or self.batch_steps, self.batch_steps)
        count = max(0, min(size, self._max_step - first + 1)) if final else size
        durations: list[float] = []
        flags: list[int] = []
        own: list[float] = []
        for step in range(first, first + count):
            duration, step_flags, self_ms = self._durations.pop(step, (math.nan, 0, 0.0))
            durations.append(duration)
            flags.append(step_flags)
            own.append(self_ms)
        self.next_first = first + size
        evidence = self._take_evidence(size)
        own_ms = tuple(own)
        return LocalRound(
            first, tuple(durations), tuple(flags), self_ms=own_ms, evidence=evidence, room=size
        )
