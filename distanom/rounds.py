"""What a round covers: how many steps (the same on every rank), and this rank's steps
collected into it.

Rounds cover consecutive steps from step 1, each as many as take about
`consensus.interval_ms` at the median step time, at most `batch_steps` (`steps_per_round`).
With a tracer, a round holding a step the duty cycle may trace ends within half the
tracer's history of it (`cut_at_trace`), so that step's trace is still kept when the
decision about it arrives; rounds away from traced steps are as long as without one.
`RoundSizer` works the length out; `RoundBuilder` (control thread) collects the resolved
steps and the evidence that rides with them into the `LocalRound` that
`distanom.consensus` encodes and gathers.

Early rounds: a rank whose steps slow down (`StepInbox.put_step`) sends the steps it has
before the round is full (`take(early=True)`); the round then covers the fewest steps any
rank sent (`consensus.FLAG_EARLY`), and each rank sends the rest again (`rewind`). A
lasting slowdown so reaches the trace planner a few steps in, not a long round late.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from distanom.consensus import FLAG_EARLY, MAX_EVIDENCE_BACKLOG, LocalRound, evidence_slots
from distanom.records.anomalies import StepEvidence

if TYPE_CHECKING:
    from distanom.config import ConsensusConfig, TracerConfig
    from distanom.duty_cycle import DutyCycle


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


class RoundSizer:
    """The next round's length: `steps_per_round`, and with a tracer cut short near a
    step the duty cycle may trace (`cut_at_trace`). The same on every rank: the median,
    the governor's data and the scheduled steps all come from gathered rounds (not
    whether this rank's tracer started: that differs by rank)."""

    def __init__(self, consensus: ConsensusConfig, tracer: TracerConfig) -> None:
        self.interval_ms = consensus.interval_ms
        self.batch_steps = consensus.batch_steps
        self.history_steps = tracer.history_steps
        self.traced = tracer.backend != "none"
        # (first step, what it depended on, steps) of the last length worked out: asked
        # several times per round, worked out again only when what it reads moved
        self._last: tuple[int, tuple[object, ...], int] | None = None

    def steps(self, first: int | None, median_ms: float | None, duty: DutyCycle) -> int:
        """Steps of the round from `first` (None: the length away from traced steps)."""
        n = steps_per_round(median_ms, self.interval_ms, self.batch_steps)
        if first is None or not self.traced:
            return n
        governor = duty.governor
        recorded = governor.steps_recorded if governor is not None else -1
        key = (n, governor, recorded, duty.schedule_version)
        last = self._last
        if last is not None and last[0] == first and last[1] == key:
            return last[2]
        traced = duty.first_traced(first, first + n - 1)
        steps = cut_at_trace(n, first, traced, self.history_steps)
        self._last = (first, key, steps)
        return steps


@dataclass
class RoundBuilder:
    """Collects this rank's resolved step durations into rounds (consensus thread only).

    A round covers `n` consecutive steps from `next_first` (n <= `batch_steps`, the row's
    room), the same n on every rank (`RoundSizer`), unless a rank ends it early
    (`take(early=True)`, then `settle`)."""

    batch_steps: int
    next_first: int = 1
    _durations: dict[int, tuple[float, int, float]] = field(default_factory=dict)
    _max_step: int = 0
    _evidence: collections.deque[tuple[int, StepEvidence]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_EVIDENCE_BACKLOG)
    )
    _sent: dict[int, tuple[float, int, float]] = field(default_factory=dict)  # the last take

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

    def take(self, n: int | None = None, *, final: bool = False, early: bool = False) -> LocalRound:
        """The next round of `n` steps (default `batch_steps`); with `final` or `early`, a
        possibly partial one covering the steps resolved so far (the row's room stays n:
        every rank's row is as long)."""
        first = self.next_first
        size = min(n or self.batch_steps, self.batch_steps)
        count = max(0, min(size, self._max_step - first + 1)) if final or early else size
        durations: list[float] = []
        flags: list[int] = []
        own: list[float] = []
        sent: dict[int, tuple[float, int, float]] = {}
        for step in range(first, first + count):
            entry = self._durations.pop(step, None)
            if entry is not None:
                sent[step] = entry
            duration, step_flags, self_ms = (math.nan, 0, 0.0) if entry is None else entry
            durations.append(duration)
            flags.append(step_flags)
            own.append(self_ms)
        self._sent = sent
        self.next_first = first + size
        evidence = self._take_evidence(size)
        own_ms = tuple(own)
        cut = FLAG_EARLY if early and not final and count < size else 0
        return LocalRound(
            first, tuple(durations), tuple(flags), cut, self_ms=own_ms, evidence=evidence,
            room=size,
        )  # fmt: skip

    def settle(self, sent: LocalRound, covered: int, final_seen: bool) -> None:
        """After the gather of a round that was not this rank's final one: a round cut
        early (`consensus.FLAG_EARLY`) covered `covered` of its steps, and every rank
        sends the rest again. A round with some rank's final is never cut, so no rank
        rewinds after it: all go on from the same step."""
        if not final_seen and covered < sent.room:
            self.rewind(sent.first_step + covered)

    def rewind(self, next_first: int) -> None:
        """The last round covered only the steps before `next_first` (a rank ended it
        early): the steps from there on that it took go into the next rounds again."""
        if next_first >= self.next_first:
            return
        for step, entry in self._sent.items():
            if step >= next_first:
                self._durations[step] = entry
        self._sent = {}
        self.next_first = next_first
