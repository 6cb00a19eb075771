"""The tracing duty cycle shared by the agent's two threads.

The control thread feeds the overhead governor with gathered step times and schedules
requested steps; the training thread asks, at each boundary, whether the next step is
traced. With a budget, the trace planner (`distanom.trace_planner`) adds steps around
the anomalies detection predicts, charged to the governor's budget (docs/budget.md).
Every rank computes the same schedule from the same gathered data. The governor and the
planner are guarded by one lock (taken only when a decision, a plan or a report needs
it); the set of requested steps is read and changed by whole-set operations, which the
GIL keeps atomic.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable
from typing import Any

from distanom.config import Config
from distanom.consensus import REQUEST_LEAD_STEPS
from distanom.detect import AnomalyJudgment, StepSample
from distanom.governor import GovernorNotReadyError, GovernorParams, OverheadGovernor
from distanom.trace_planner import (
    DEFAULT_COSTS,
    DEFAULT_SWITCH_OFF,
    DEFAULT_SWITCH_ON,
    Costs,
    PlannerParams,
    TracePlanner,
)

log = logging.getLogger(__name__)


class DutyCycle:
    """Which steps are traced: requested steps always, the rest as the governor decides."""

    def __init__(self, config: Config) -> None:
        self.schedule_version = 0  # moves when what the steps' tracing depends on does
        # the governor is replaced or removed only between steps (tests; a failure)
        self._governor: OverheadGovernor | None = None
        if config.tracer.backend != "none":
            # decisions wait for gathered data: with rounds of up to batch_steps steps, a
            # lag shorter than a round would leave the governor unready at window
            # boundaries, and the switch would come late, mid-window; a round's length is
            # also chosen from the decisions for all its steps (`first_traced`)
            params = GovernorParams(lag_steps=config.consensus.batch_steps + 4)
            self._governor = OverheadGovernor.from_config(config.tracer, params, first_step=1)
        self._probe_seed = config.tracer.probe_seed  # None: the run id places the probes
        if self._governor is not None and self._probe_seed is not None:
            self._governor.seed_probes(str(self._probe_seed))
        # without a budget every window but the probes is traced: nothing to plan (and a
        # planned step in a probe window would spoil the measurement it is there for)
        self.planner: TracePlanner | None = None
        budget = config.tracer.overhead_budget_pct
        if self.governor is not None and budget is not None:
            self.planner = TracePlanner(
                budget, config.detect.merge_gap_steps, PlannerParams(lead_steps=REQUEST_LEAD_STEPS)
            )
        self._cached_costs: tuple[int, Costs] | None = None  # (windows recorded, costs)
        self._lock = threading.Lock()
        self._forced_on: set[int] = set()  # requested steps: traced whatever the governor says
        # the same steps as the control thread scheduled them: the training thread drops
        # steps from `_forced_on` as it passes them, rounds still need to know of them
        self._scheduled: set[int] = set()
        # (governor, window's first step, step after it, decision) of the last window asked
        # about: the training thread asks at every boundary, the answer changes per window
        self._decided: tuple[OverheadGovernor, int, int, bool] | None = None

    @property
    def governor(self) -> OverheadGovernor | None:
        """The overhead governor (None: tracing stays as it is)."""
        return self._governor

    @governor.setter
    def governor(self, governor: OverheadGovernor | None) -> None:
        # a new governor decides anew: rounds sized from the old one's decisions
        # (`first_traced`) and quiet runs of its untraced windows must ask again
        self._governor = governor
        self.schedule_version += 1

    def seed_probes(self, run_id: str) -> None:
        """Place the untraced probe windows (no budget) by the run id every rank got from
        rank 0, unless the config fixed their seed. Before the first round: no decision
        is made before gathered data."""
        governor = self._governor
        if governor is not None and self._probe_seed is None:
            with self._lock:
                try:
                    governor.seed_probes(run_id)
                except ValueError as err:  # a setup slower than 8 windows: keep the default
                    log.warning("tracer: probe windows not moved (%s)", err)

    # -- training thread ---------------------------------------------------------------

    def wanted(self, next_step: int) -> bool | None:
        """Whether `next_step` should be traced; None to keep the current state (no
        governor, or its gathered data lag behind)."""
        forced = self._forced_on
        if forced:
            for past in [s for s in list(forced) if s < next_step]:
                forced.discard(past)  # scheduled after the host had passed them
            if next_step in forced:
                forced.discard(next_step)
                return True
        governor = self.governor
        if governor is None:
            return None
        decided = self._decided
        if decided is not None and decided[0] is governor and decided[1] <= next_step < decided[2]:
            return decided[3]  # a window's decision, once made, never changes
        with self._lock:
            if not governor.ready(next_step):
                return None
            try:
                decision = governor.tracing_on(next_step)
            except GovernorNotReadyError:
                return None
            first, end = governor.window_bounds(next_step)
            self._decided = (governor, first, end, decision)
            return decision

    def untraced_until(self, next_step: int) -> int:
        """The first step from `next_step` on that may be traced: the steps before it lie
        in the last window `wanted` decided, decided untraced, and none of them is
        requested. `next_step` itself when that window does not hold it or is traced.
        The answer holds while `schedule_version` does not move (a request, a new
        governor)."""
        decided = self._decided
        if (
            decided is None
            or decided[3]
            or decided[0] is not self._governor
            or not decided[1] <= next_step < decided[2]
        ):
            return next_step
        end = decided[2]
        return min((s for s in list(self._forced_on) if next_step <= s < end), default=end)

    # -- control thread ----------------------------------------------------------------

    def force(self, steps: Iterable[int]) -> None:
        """Trace these steps whatever the governor decides."""
        steps = set(steps)
        self._scheduled |= steps
        self._forced_on.update(steps)
        # last: a training thread that reads the new version finds the steps in place
        # (`untraced_until`'s caller compares versions to know its answer still holds)
        self.schedule_version += 1

    def first_traced(self, first: int, last: int) -> int | None:
        """The first step of `first`..`last` that may be traced, None if none will be: a
        round holding one must end soon after it (`rounds.cut_at_trace`).

        Counted as traced: requested and planned steps, windows the governor traces or
        cannot decide yet, and the `window_steps` steps after each of those (where a
        decision that reached the training thread late kept tracing on for a few
        steps). Without a governor tracing stays as it is: every step counts. Every rank
        gets the same answer: it reads the steps scheduled in rounds and the governor's
        gathered data, and is asked between rounds."""
        governor = self.governor
        if governor is None:
            return first
        pad = governor.params.window_steps
        for past in [s for s in self._scheduled if s + pad < first]:
            self._scheduled.discard(past)
        found = min((s for s in self._scheduled if s <= last), default=None)
        if found is not None:
            found = max(first, found)
        with self._lock:
            window_first = max(governor.first_step, first - pad)
            # only windows before a scheduled step found can come first
            while window_first <= last and (found is None or window_first < found):
                start, end = governor.window_bounds(window_first)
                if _maybe_traced(governor, start):
                    return max(first, start)  # <= found: start <= window_first < found
                window_first = end
        return found

    def request(self, steps: list[int]) -> None:
        """Trace requested steps (on demand, a straggler's) and, with a budget, charge
        them to it like the planner's: each traced step and a pair of switches, as whole
        windows' worth of the governor's credit. Every rank charges the same (requests
        reach every rank in the same round)."""
        if not steps:
            return
        governor = self.governor
        if governor is not None and governor.budget_pct is not None:
            with self._lock:
                costs = self._costs(governor)
                governor.charge(costs.in_windows(costs.tracing(len(steps))))
        self.force(steps)

    def record(self, samples: Iterable[StepSample]) -> None:
        """Feed gathered step times to the governor; ValueError on data it refuses."""
        governor = self.governor
        if governor is None:
            return
        with self._lock:
            for sample in samples:
                step_ms = sample.step_ms
                seconds = step_ms / 1000.0 if math.isfinite(step_ms) else None
                governor.record(sample.step, seconds, sample.traced, sample.after_flush)

    def plan(
        self, judged: Iterable[AnomalyJudgment], through_step: int, furthest_host_step: int
    ) -> None:
        """Trace the steps the planner wants after a round's judgments (`through_step`:
        the round's last step; `furthest_host_step`: the furthest rank's training loop).
        A failure is logged once and the planner steps aside; the duty cycle goes on."""
        planner, governor = self.planner, self.governor
        if planner is None or governor is None:
            return
        try:
            with self._lock:
                plan = planner.plan(
                    [(j.step, j.traced, j.ratio) for j in judged],
                    through_step,
                    furthest_host_step,
                    governor.steps_recorded,
                    lambda: self._costs(governor),
                )
                governor.charge(plan.charge_windows)
        except Exception as err:
            self.planner = None
            log.warning("trace planner: %s; tracing follows the duty cycle alone", err)
            return
        if plan.steps:
            self.force(plan.steps)

    def _costs(self, governor: OverheadGovernor) -> Costs:
        """`costs_of(governor)`, worked out again only once a new window is recorded."""
        key = governor.steps_recorded // governor.params.window_steps
        if self._cached_costs is None or self._cached_costs[0] != key:
            self._cached_costs = (key, costs_of(governor))
        return self._cached_costs[1]

    def disable(self) -> None:
        """Stop deciding: tracing stays as it is from now on."""
        self.governor = None  # moves schedule_version

    def report(self) -> dict[str, Any] | None:
        """The governor's summary (duty cycle, measured overhead), None without one."""
        governor = self.governor
        if governor is None:
            return None
        with self._lock:
            report = governor.report()
            planner = self.planner
            if planner is not None:  # flat: status.json's tracer holds scalars two deep
                report.update({f"planner_{k}": v for k, v in planner.summary().items()})
            return report


def _maybe_traced(governor: OverheadGovernor, step: int) -> bool:
    """Whether `step`'s window is traced, or cannot be told yet (lock held)."""
    try:
        return governor.tracing_on(step)
    except GovernorNotReadyError:  # not decidable yet, or no longer kept
        return True


def costs_of(governor: OverheadGovernor) -> Costs:
    """The planner's costs, in step times, from the governor's measurements (defaults for
    what is not measured yet)."""
    measured = governor.measured_costs()
    traced = measured.traced_step
    if traced is None:
        traced = DEFAULT_COSTS.traced_step
    # each way measured apart: a run that starts traced has no switch on to measure
    on, off = measured.switch_on, measured.switch_off
    on = DEFAULT_SWITCH_ON if on is None else on
    switch = on + (DEFAULT_SWITCH_OFF if off is None else off)
    overhead = measured.overhead
    window = DEFAULT_COSTS.window
    if overhead is not None and overhead > 0:
        window = governor.params.window_steps * overhead
    return Costs(traced, switch, window)
