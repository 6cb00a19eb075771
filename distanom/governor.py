"""The overhead governor: which steps are traced, so that tracing costs at most a budget.

Owns the tracing duty cycle. Tracing is switched in windows of `window_steps` steps
(switching per step would put CUPTI's attach/detach on every boundary). The governor
measures the tracer's cost live, from the run itself: overhead = median(step times of
recent traced windows) / median(step times of recent untraced windows) - 1, plus the
cost of switching. A median does not see a cost paid once per switch, so the two steps
that carry one are kept apart: the first traced step after an untraced one carries the
attach (CUPTI re-initialises: ~10 ms measured on an H200), the first untraced step after
a traced one the drain and detach (~3-4 ms). Each kind's median excess (over the traced,
resp. untraced, median), times its switches per traced window seen so far, is charged
to tracing (per traced step). With a budget of B percent it traces a fraction f of the
windows, f = B / overhead, clamped to [min_fraction, 1 - 1/probe_every_windows] and
spread by an accumulator in bursts of `burst_windows` consecutive windows, so that one
pair of switches serves several traced windows. The hysteresis is one-sided, so the
budget holds: f is set to target / (1 + band / 2) and kept while the target stays
within [f, f * (1 + band)]. Without a budget it traces
every window but one in `probe_every_windows` (the first one after `first_probe_window`
windows, past the run's start, when detection is still filling its baselines), so every
run can still report what tracing costs.

Pure and deterministic: no torch, no clock, no I/O. Every rank feeds it the SAME
gathered data in step order (per step: the step time, max over ranks, and whether
tracing was on) and the decision for step s depends only on the complete windows that
ended at least `lag_steps` before the window holding s begins; so all ranks compute the
same schedule even though gathered data arrive late. It reads only what `record` is
given and hands decisions (`tracing_on`) and a summary (`report`) back to the agent.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distanom.config import TracerConfig


class GovernorNotReadyError(LookupError):
    """A decision was asked for before the data it depends on were recorded."""


@dataclass(frozen=True)
class GovernorParams:
    window_steps: int = 16  # steps per duty-cycle window
    lag_steps: int = 4  # data of the last `lag_steps` steps before a window are not used
    history_windows: int = 8  # traced / untraced windows the overhead is measured over
    # always trace this much, to keep measuring; low, since it overrides the budget when
    # tracing costs more than budget / min_fraction (2.56x the step at a 1% budget)
    min_fraction: float = 1 / 256
    probe_every_windows: int = 64  # at least one untraced window in this many
    first_probe_window: int = 8  # without a budget: the first untraced window
    hysteresis: float = 0.2  # keep the fraction while the target is at most 20% above it
    min_samples: int = 4  # step times each side needs before an overhead is trusted
    initial_fraction: float = 0.5  # before the first measurement (budgeted runs)
    # budgeted runs trace this many consecutive windows at a time: a switch costs about
    # as much as a whole traced window of a launch-bound step (bench/results/
    # cupti_switch_cost_probe_h200.json), so bursts leave more of the budget to tracing
    burst_windows: int = 4

    def __post_init__(self) -> None:
        if self.window_steps < 1 or self.lag_steps < 0 or self.history_windows < 1:
            raise ValueError("window_steps >= 1, lag_steps >= 0, history_windows >= 1")
        if self.probe_every_windows < 2:
            raise ValueError("probe_every_windows must be >= 2")
        if not 0 < self.min_fraction <= 1 - 1 / self.probe_every_windows:
            raise ValueError("min_fraction must be in (0, 1 - 1/probe_every_windows]")
        if not 0 <= self.hysteresis < 1 or self.min_samples < 1:
            raise ValueError("hysteresis in [0, 1), min_samples >= 1")
        if self.burst_windows < 1:
            raise ValueError("burst_windows must be >= 1")


@dataclass(frozen=True)
class _Window:
    kind: str  # "T" traced, "U" untraced, "M" mixed (not used to measure)
    times: tuple[float, ...]
    switch_times: tuple[float, ...] = ()  # untraced steps right after a traced one
    switch_on_times: tuple[float, ...] = ()  # traced steps right after an untraced one


class OverheadGovernor:
    """Decides `tracing_on(step)` from recorded (step time, traced) pairs.

    Memory is bounded whatever the run length: a measurement only ever looks at the last
    `history_windows` traced and untraced windows, so complete windows are folded into
    two such bounded queues as decisions advance; only the last `KEPT_DECISIONS`
    decisions are kept, and the report's medians use the last `REPORT_SAMPLES` traced /
    untraced step times.
    """

    MAX_UNCONSUMED_WINDOWS = 4096  # recorded, not yet needed by a decision (normally 1-2)
    KEPT_DECISIONS = 64
    REPORT_SAMPLES = 1024

    def __init__(
        self, budget_pct: float | None, params: GovernorParams | None = None, first_step: int = 0
    ) -> None:
        if budget_pct is not None and not budget_pct > 0:
            raise ValueError("budget_pct must be > 0 or None")
        self.budget_pct = budget_pct
        self.params = params or GovernorParams()
        self.first_step = first_step
        self._recorded = 0  # steps recorded so far
        self._steps_traced = 0
        self._pending_times: list[float | None] = []  # the window being filled
        self._pending_flags: list[bool] = []
        self._pending_switches: list[float] = []
        self._pending_switch_ons: list[float] = []
        self._previous_traced: bool | None = None
        self._last_window_kind: str | None = None
        # complete windows not yet seen by a decision, then the last history_windows
        # traced ("T") and untraced ("U") windows among those a decision has seen
        self._unconsumed: collections.deque[_Window] = collections.deque()
        self._consumed = 0
        self._seen: dict[str, collections.deque[_Window]] = {
            kind: collections.deque(maxlen=self.params.history_windows) for kind in ("T", "U")
        }
        self._seen_switches: collections.deque[float] = collections.deque(
            maxlen=self.params.history_windows
        )
        self._switches_consumed = 0
        self._seen_switch_ons: collections.deque[float] = collections.deque(
            maxlen=self.params.history_windows
        )
        self._switch_ons_consumed = 0
        self._traced_windows_consumed = 0
        self._n_windows = 0
        # decisions per window; _decisions[i] is window number _decisions_base + i
        self._decisions: collections.deque[bool] = collections.deque(maxlen=self.KEPT_DECISIONS)
        self._decisions_base = 0
        self._n_decided = 0
        self._n_traced_windows = 0
        self._recent_traced: collections.deque[float] = collections.deque(
            maxlen=self.REPORT_SAMPLES
        )
        self._recent_untraced: collections.deque[float] = collections.deque(
            maxlen=self.REPORT_SAMPLES
        )
        self._fraction: float | None = None
        self._credit = 0.0
        self._burst_left = 0  # traced windows still to come in the current burst
        self._last_overhead: float | None = None

    @classmethod
    def from_config(
        cls, config: TracerConfig, params: GovernorParams | None = None, first_step: int = 0
    ) -> OverheadGovernor:
        return cls(config.overhead_budget_pct, params, first_step)

    # -- data ------------------------------------------------------------------------

    def record(
        self, step: int, step_time_s: float | None, traced: bool, after_flush: bool = False
    ) -> None:
        """Add the next step's gathered data. Steps come in order without gaps; a step
        nobody could time is recorded with `step_time_s=None`. `after_flush`: the tracer
        did costly work at the step's start (a detach, a window hand-over)."""
        expected = self.first_step + self._recorded
        if step != expected:
            raise ValueError(f"governor expects step {expected} next, got {step}")
        if step_time_s is not None and not step_time_s >= 0:
            raise ValueError(f"step time must be >= 0 or None, got {step_time_s!r}")
        self._recorded += 1
        self._steps_traced += bool(traced)
        # a duty-cycle switch: the first step of a window, after a fully traced window
        # (a requested capture inside an untraced window is not the duty cycle's cost)
        switch = (
            not traced
            and self._previous_traced is True
            and not self._pending_times
            and self._last_window_kind == "T"
        )
        # the first step of a window, traced after an untraced step (kept only if its
        # window turns out fully traced: a duty-cycle switch, not a requested capture)
        switch_on = traced and self._previous_traced is False and not self._pending_times
        self._previous_traced = bool(traced)
        if switch or switch_on:
            # tracing's cost, not a sample: kept apart (see the module docstring)
            if step_time_s is not None:
                (self._pending_switches if switch else self._pending_switch_ons).append(step_time_s)
            step_time_s = None
        elif after_flush:
            # the tracer's own work outside the duty cycle (its start, a requested capture,
            # a switch that came late): neither a sample nor a duty-cycle switch
            step_time_s = None
        self._pending_times.append(step_time_s)
        self._pending_flags.append(bool(traced))
        if step_time_s is not None:
            (self._recent_traced if traced else self._recent_untraced).append(step_time_s)
        if len(self._pending_times) == self.params.window_steps:
            flags = self._pending_flags
            kind = "T" if all(flags) else ("U" if not any(flags) else "M")
            times = tuple(t for t in self._pending_times if t is not None)
            switch_ons = tuple(self._pending_switch_ons) if kind == "T" else ()
            self._unconsumed.append(_Window(kind, times, tuple(self._pending_switches), switch_ons))
            self._last_window_kind = kind
            self._n_windows += 1
            if len(self._unconsumed) > self.MAX_UNCONSUMED_WINDOWS:
                self._consume(1)  # nobody asks for decisions: fold instead of growing
            self._pending_times, self._pending_flags = [], []
            self._pending_switches, self._pending_switch_ons = [], []

    # -- decisions -------------------------------------------------------------------

    def _window_of(self, step: int) -> int:
        if step < self.first_step:
            raise ValueError(f"step {step} is before the governor's first step {self.first_step}")
        return (step - self.first_step) // self.params.window_steps

    def _usable_windows(self, window: int) -> int:
        """Complete data windows that ended at least lag_steps before `window` starts."""
        cutoff = window * self.params.window_steps - self.params.lag_steps
        return max(0, cutoff // self.params.window_steps)

    def ready(self, step: int) -> bool:
        """Whether `tracing_on(step)` can be answered from the data recorded so far."""
        return self._n_windows >= self._usable_windows(self._window_of(step))

    def tracing_on(self, step: int) -> bool:
        w = self._window_of(step)
        if w < self._decisions_base:
            raise GovernorNotReadyError(f"the decision for step {step} is no longer kept")
        while self._n_decided <= w:
            nxt = self._n_decided
            need = self._usable_windows(nxt)
            if self._n_windows < need:
                raise GovernorNotReadyError(
                    f"deciding step {step} needs the data of steps < "
                    f"{self.first_step + need * self.params.window_steps}; recorded up to "
                    f"{self.first_step + self._recorded - 1}"
                )
            self._consume(need - self._consumed)
            decision = self._decide(nxt)
            if len(self._decisions) == self._decisions.maxlen:
                self._decisions_base += 1
            self._decisions.append(decision)
            self._n_decided += 1
            self._n_traced_windows += decision
        return self._decisions[w - self._decisions_base]

    def _consume(self, count: int) -> None:
        """Let decisions see the next `count` complete windows, in order."""
        for _ in range(max(0, count)):
            window = self._unconsumed.popleft()
            self._consumed += 1
            if window.kind in self._seen:
                self._seen[window.kind].append(window)
            self._seen_switches.extend(window.switch_times)
            self._switches_consumed += len(window.switch_times)
            self._seen_switch_ons.extend(window.switch_on_times)
            self._switch_ons_consumed += len(window.switch_on_times)
            self._traced_windows_consumed += window.kind == "T"

    def _is_probe(self, window: int) -> bool:
        p, first = self.params.probe_every_windows, self.params.first_probe_window
        return window >= first and (window - first) % p == 0

    def _decide(self, window: int) -> bool:
        overhead = self._measure(
            self._seen["T"], self._seen["U"], self._seen_switches, self._seen_switch_ons,
            self._switch_counts(),
        )  # fmt: skip
        self._last_overhead = overhead
        if self.budget_pct is None:
            return not self._is_probe(window)
        if window < 2:
            return window == 0  # bootstrap: one traced, one untraced window
        prm = self.params
        if overhead is not None:
            budget = self.budget_pct / 100.0
            raw = math.inf if overhead <= 0 else budget / overhead
            ceiling = 1.0 - 1.0 / prm.probe_every_windows
            target = min(max(raw, prm.min_fraction), ceiling)
            f = self._fraction
            if f is None or not (f <= target <= f * (1 + prm.hysteresis)):
                # re-centre below the target, so noise around it does not switch again
                centred = raw / (1 + prm.hysteresis / 2)
                self._fraction = min(max(centred, prm.min_fraction), ceiling)
        fraction = self._fraction if self._fraction is not None else prm.initial_fraction
        # credit accrues in every window, so bursts keep the traced share at `fraction`
        self._credit += fraction
        if self._burst_left > 0:
            self._burst_left -= 1
            return True
        burst = prm.burst_windows
        if self._credit >= burst - 1e-9:
            self._credit -= burst
            self._burst_left = burst - 1
            return True
        return False

    def _switch_counts(self, pending: Iterable[_Window] = ()) -> tuple[int, int, int]:
        """(switches off, switches on, traced windows) over everything decisions have
        seen, plus `pending` windows."""
        offs, ons = self._switches_consumed, self._switch_ons_consumed
        traced = self._traced_windows_consumed
        for window in pending:
            offs += len(window.switch_times)
            ons += len(window.switch_on_times)
            traced += window.kind == "T"
        return offs, ons, traced

    def _measure(
        self,
        traced: Iterable[_Window],
        untraced: Iterable[_Window],
        offs: Iterable[float] = (),
        ons: Iterable[float] = (),
        counts: tuple[int, int, int] = (0, 0, 0),
    ) -> float | None:
        """Overhead (0.13 = 13%) from the given traced and untraced windows, plus the
        switch steps' median excess (`offs` over the untraced median, `ons` over the
        traced one), each as often per traced window as `counts` say."""
        t = [x for w in traced for x in w.times]
        u = [x for w in untraced for x in w.times]
        if len(t) < self.params.min_samples or len(u) < self.params.min_samples:
            return None
        mu, mt = statistics.median(u), statistics.median(t)
        if mu <= 0:
            return None
        n_off, n_on, n_traced = counts
        per_window = self._excess(offs, mu) * n_off + self._excess(ons, mt) * n_on
        return mt / mu - 1.0 + per_window / max(1, n_traced) / (self.params.window_steps * mu)

    @staticmethod
    def _excess(samples: Iterable[float], reference: float) -> float:
        """Median excess of switch steps over the steps they would otherwise be."""
        s = list(samples)
        return max(0.0, statistics.median(s) - reference) if s else 0.0

    @staticmethod
    def _measure_median(windows: Iterable[_Window]) -> float | None:
        times = [x for w in windows for x in w.times]
        return statistics.median(times) if times else None

    def report(self) -> dict[str, Any]:
        """Measured overhead, traced fraction and counts, for logs and the status file."""
        h = self.params.history_windows
        newest = {
            kind: [*self._seen[kind], *(w for w in self._unconsumed if w.kind == kind)][-h:]
            for kind in ("T", "U")
        }
        offs = [*self._seen_switches, *(x for w in self._unconsumed for x in w.switch_times)]
        ons = [*self._seen_switch_ons, *(x for w in self._unconsumed for x in w.switch_on_times)]
        offs, ons = offs[-h:], ons[-h:]
        counts = self._switch_counts(self._unconsumed)
        recent = self._measure(newest["T"], newest["U"], offs, ons, counts)
        untraced_median = self._measure_median(newest["U"])
        traced_median = self._measure_median(newest["T"])

        def excess_ms(samples: list[float], reference: float | None) -> float | None:
            if not samples or reference is None:
                return None
            return 1000.0 * self._excess(samples, reference)

        recorded = self._recorded
        fraction_steps = self._steps_traced / recorded if recorded else None
        return {
            "budget_pct": self.budget_pct,
            "window_steps": self.params.window_steps,
            "lag_steps": self.params.lag_steps,
            "burst_windows": self.params.burst_windows,
            "windows_decided": self._n_decided,
            "windows_traced": self._n_traced_windows,
            "traced_fraction": self._n_traced_windows / self._n_decided
            if self._n_decided
            else None,
            "target_fraction": self._fraction,
            "measured_overhead_pct": None if recent is None else 100.0 * recent,
            "effective_overhead_pct": (
                None
                if recent is None or fraction_steps is None
                else 100.0 * recent * fraction_steps
            ),
            "switches_off": counts[0],
            "switch_excess_ms": excess_ms(offs, untraced_median),
            "switches_on": counts[1],
            "switch_on_excess_ms": excess_ms(ons, traced_median),
            "steps_recorded": recorded,
            "steps_traced": self._steps_traced,
            "steps_untraced": recorded - self._steps_traced,
            "traced_median_s": (
                statistics.median(self._recent_traced) if self._recent_traced else None
            ),
            "untraced_median_s": (
                statistics.median(self._recent_untraced) if self._recent_untraced else None
            ),
        }
