"""How distanom's threads share the GIL with the training thread: the control thread
between a round's phases (`RoundPacer`, used by `distanom.control_loop`), the capture
worker between slices of a trace's encoding (`slice_pause_s`, `distanom.capture`).

A round of up to 128 steps is a few ms of Python on the control thread. In one piece it
stretches one training step by all of it: the step then looks like an anomaly (1.5x on
4.4 ms CPU steps, once per round, in `bench/probes/boundary_cost_probe.py`'s spike
census). A bare `time.sleep(0)` between phases does not prevent that: it drops the GIL
and takes it back before a waiting thread has woken up. Sleeping about one training step
between phases puts each phase in a different step (docs/agent.md).

Pauses are not free: each is a timed wake-up (0.15-0.28 ms of the thread's CPU on the
H200 VM) and a GIL hand-over each way. Where a round's whole work is a small share of a
step (short rounds, long steps) there is nothing to spread, so the round runs in one
piece. `RoundPacer` measures that work itself: the control thread's CPU time per loop
pass, pauses left out, from passes whose rounds were at least half as long as the next
one (rounds start at one step each, before a median is known; until a round about as
long has been measured, it is paced). Work measured while paced reads a little heavier
(the cold start after each wake-up), so near the limit a paced job tends to stay paced.
Each pause (and `mark`) ends a phase; the phases' CPU time since the last sleep goes to
the control loop's charge at the next sleep, which puts heavy work on the step it
stalled (docs/agent.md).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable

PACE_MAX_S = 0.01
# A round's pauses (three) take at most this share of the time its steps take, so the
# control thread keeps up with rounds of a few steps (`consensus.batch_steps: 1`).
ROUND_SHARE = 0.375
# A round whose expected work is at most this share of the median step runs without
# pauses: in one piece it stretches one step by about this much (an anomaly is 1.5x).
UNPACED_SHARE = 0.1
# the pause decision looks at the heaviest of this many latest passes that ran a round
# (a status write or a steps-file flush makes some passes heavier than others)
WORK_MEMORY = 8
# a slice pause without a known median step: about one step of a launch-bound loop
UNKNOWN_STEP_PAUSE_S = 0.002
# slices of a trace's encoding (`slice_events`): events a median step's ms, the fewest,
# and the most slices a trace is cut into
SLICE_EVENTS_PER_MS = 250
MIN_SLICE_EVENTS = 128
MAX_SLICES = 64


def slice_events(median_ms: float, events: int) -> int:
    """How many trace events to encode between two pauses: about a quarter of a median
    step's time at ~1 us an event (orjson on the 2-core VM; faster hosts take less),
    at least MIN_SLICE_EVENTS, and so many that a trace takes at most MAX_SLICES slices
    (each pause is a step: the next capture waits for them all)."""
    per_step = median_ms * SLICE_EVENTS_PER_MS if math.isfinite(median_ms) else 0.0
    wanted = max(MIN_SLICE_EVENTS, int(per_step))
    return max(wanted, -(-events // MAX_SLICES))


def slice_pause_s(median_ms: float) -> float:
    """The pause between slices of other work that shares the GIL with training (the
    capture worker's encode): one median step, so each slice falls in a step of its
    own, at most PACE_MAX_S; UNKNOWN_STEP_PAUSE_S without a median."""
    if not math.isfinite(median_ms) or median_ms <= 0:
        return UNKNOWN_STEP_PAUSE_S
    return min(PACE_MAX_S, median_ms / 1e3)


def pace_s(median_ms: float | None, round_steps: int, work_ms: float | None = None) -> float:
    """The pause between a round's phases: one step at the median step time, at most
    PACE_MAX_S (longer steps hide a phase anyway) and at most an eighth of the round's
    steps; 0 before a median is known, and 0 when the round's work (`work_ms`, CPU ms;
    None: not measured yet) is at most UNPACED_SHARE of the median step. Never more than
    a step: each pause delays the round's evidence by one step, and a round holding a
    traced step ends half of the steps the tracer keeps after it."""
    if median_ms is None or not math.isfinite(median_ms) or median_ms <= 0:
        return 0.0
    if work_ms is not None and work_ms <= UNPACED_SHARE * median_ms:
        return 0.0
    step_s = median_ms / 1e3
    return min(PACE_MAX_S, step_s, ROUND_SHARE / 3 * round_steps * step_s)


class RoundPacer:
    """The pauses of one control thread: `begin` at the top of each loop pass decides
    the pass's pause from the work measured in earlier ones, `pause` between phases,
    `end` records the pass's work (its CPU time, the pauses' own left out).

    The CPU time of the work since the last sleep (phases ended by `mark` or an unpaced
    `pause` add up: nothing let the training thread run between them) is handed to
    `charge` at the next sleep, or at `end`, while the control thread still holds the
    GIL: the training step it stalled has not ended yet, so the charge lands on that
    step, not on a later one (a paced pass's work falls in different steps)."""

    def __init__(self, charge: Callable[[int], None] | None = None) -> None:
        self._charge = charge
        self._phase_ns = -1  # thread CPU time at the start of the current phase (-1: none)
        self._unslept_ns = 0  # the phases' CPU time since the last sleep, not charged yet
        self.pause_s = 0.0  # the pause between phases in this pass; 0: none
        self.pauses = 0  # pauses slept so far
        # (CPU ms, steps its rounds covered) of the latest passes that ran a round
        self._works: collections.deque[tuple[float, int]] = collections.deque(maxlen=WORK_MEMORY)
        self._began_ns = 0
        self._paused_ns = 0
        self._final = False

    @property
    def work_ms(self) -> float | None:
        """The heaviest recent pass that ran a round (CPU ms), None before one."""
        return max(work for work, _ in self._works) if self._works else None

    def expected_work_ms(self, round_steps: int) -> float | None:
        """What a pass with a round of `round_steps` is expected to cost (CPU ms): the
        heaviest recent pass whose rounds covered at least half as many steps; None when
        there is none (rounds start at one step each, before a median is known, and a
        round many times longer costs many times more)."""
        comparable = [work for work, steps in self._works if 2 * steps >= round_steps]
        return max(comparable) if comparable else None

    def begin(self, median_ms: float | None, round_steps: int, *, final: bool) -> None:
        """Start a pass: no pause at the end of training (nothing to pace for)."""
        self._began_ns = self._phase_ns = time.thread_time_ns()
        self._paused_ns = 0
        self._final = final
        if final:
            self.pause_s = 0.0
        else:
            self.pause_s = pace_s(median_ms, round_steps, self.expected_work_ms(round_steps))

    def stop(self) -> None:
        """No more pauses in this pass (training ended somewhere: exit soon)."""
        self.pause_s = 0.0

    def pause(self) -> None:
        """Drop the GIL for the pass's pause, if it has one, charging the work since the
        last sleep first."""
        before = time.thread_time_ns()
        self._end_phase(before)
        if self.pause_s <= 0:
            return
        self._charge_unslept()
        time.sleep(self.pause_s)
        self._phase_ns = time.thread_time_ns()
        self._paused_ns += self._phase_ns - before
        self.pauses += 1

    def mark(self) -> None:
        """End a phase without a pause (it is charged with the work after it, at the
        next sleep or `end`)."""
        self._end_phase(time.thread_time_ns())

    def _end_phase(self, now_ns: int) -> None:
        if self._phase_ns >= 0:
            self._unslept_ns += now_ns - self._phase_ns
        self._phase_ns = now_ns

    def _charge_unslept(self) -> None:
        spent, self._unslept_ns = self._unslept_ns, 0
        if self._charge is not None and spent > 0:
            self._charge(spent)

    def end(self, *, steps: int) -> None:
        """End a pass whose rounds covered `steps` steps; only a pass that ran a round
        (and not the last ones, at the end of training) says what a round costs."""
        now = time.thread_time_ns()
        self._end_phase(now)
        self._charge_unslept()
        if steps > 0 and not self._final:
            spent = now - self._began_ns - self._paused_ns
            self._works.append((max(0, spent) / 1e6, steps))
