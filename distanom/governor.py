"""The overhead governor: which steps are traced, so that tracing costs at most a budget.

Owns the tracing duty cycle. Tracing is switched in windows of `window_steps` steps
(switching per step would put CUPTI's attach/detach on every boundary). The governor
measures the tracer's cost live, from the run itself. Each traced window is compared
with its local baseline, the untraced windows just before and just after its run of
traced windows (step times drift by +-15% over seconds on a shared machine: a baseline
from elsewhere in the run would swamp a 1% budget): its cost is median(its step times) /
median(baseline) - 1, and the overhead is the median cost over recent traced windows,
plus the cost of switching. A median does not see a cost paid once per switch, so the
two steps that carry one are kept apart: the first traced step after an untraced one
carries the attach (CUPTI re-initialises: ~10 ms on an H200), the first
untraced step after a traced one the drain and detach (~3-4 ms). Each kind's median
excess (over its traced window's median, resp. the baseline), times its switches per
traced window seen so far, is charged to tracing (per traced step); so is a traced step
that starts with the tracer's own flush (kineto's window hand-over), but for the first,
the tracer's start.

A budgeted run starts with one traced and one untraced window and traces nothing more
until their cost is known (with a decision lag of a whole gathering round, that takes
~9 windows). With a budget of B percent it traces a fraction f of the windows, f = B / overhead,
clamped to [min_fraction, 1 - 1/probe_every_windows] and spread by an accumulator in
bursts of `burst_windows` consecutive windows, so that one pair of switches serves
several traced windows, and never more than `max_run_windows` in a row: the untraced
window after a run is what costs it, so a wrong measurement is corrected within about
that many windows (plus the lag). The fraction is clamped to at most max_run_windows /
(max_run_windows + 1), falls at once, and rises at most twofold per newly costed run,
after two runs (the next run then starts at once, on credit): a run's cost rests on one
baseline, and a slow untraced window makes tracing look free. The hysteresis is one-
sided, so the budget holds: f is set to target / (1 + band / 2) and kept while the
target stays within [f, f * (1 + band)].

Tracing asked for outside the duty cycle (`distanom.trace_planner`: steps around
predicted anomalies) is charged to the same budget (`charge`): its cost, in traced
windows, comes off the credit of the first window whose decision the data recorded so
far cannot make yet, the same window on every rank (docs/budget.md).

Without a budget it traces every window but one in each period of `probe_every_windows`
windows (periods counted from window `first_probe_window`, past the run's start, when
detection is still filling its baselines), so every run can still report what tracing
costs. Where in its period the untraced window falls is drawn from a seed every rank
shares (the run id, `probe_window`): a different place each period and each run, so no
step is always left untraced; the first period draws among its first
`first_probe_window` windows only, so a short run measures too.

Pure and deterministic: no torch, no clock, no I/O. Every rank feeds it the SAME
gathered data in step order (per step: the step time, max over ranks, and whether
tracing was on) and the decision for step s depends only on the complete windows that
ended at least `lag_steps` before the window holding s begins; so all ranks compute the
same schedule even though gathered data arrive late. It reads only what `record` is
given and hands decisions (`tracing_on`) and a summary (`report`) back to the agent.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distanom.config import TracerConfig


class GovernorNotReadyError(LookupError):
    """A decision was asked for before the data it depends on were recorded."""


@dataclass(frozen=True)
class GovernorParams:
    """Tuning of the duty cycle: window size, decision lag, probes, bursts, hysteresis."""

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
    # as much as a whole traced window of a launch-bound step (docs/measurements.md,
    # switch cost), so bursts leave more of the budget to tracing
    burst_windows: int = 4
    # budgeted runs: at most this many traced windows in a row, then one untraced window,
    # which costs the run just traced: a wrong measurement is corrected within this many
    max_run_windows: int = 16

    def __post_init__(self) -> None:
        if self.window_steps < 1 or self.lag_steps < 0 or self.history_windows < 1:
            raise ValueError("window_steps >= 1, lag_steps >= 0, history_windows >= 1")
        if self.probe_every_windows < 2:
            raise ValueError("probe_every_windows must be >= 2")
        if not 0 < self.min_fraction <= 1 - 1 / self.probe_every_windows:
            raise ValueError("min_fraction must be in (0, 1 - 1/probe_every_windows]")
        if not 0 <= self.hysteresis < 1 or self.min_samples < 1:
            raise ValueError("hysteresis in [0, 1), min_samples >= 1")
        if not 1 <= self.burst_windows <= self.max_run_windows < self.probe_every_windows:
            raise ValueError("need 1 <= burst_windows <= max_run_windows < probe_every_windows")


def probe_window(seed: str, period: int, params: GovernorParams) -> int:
    """The untraced window of a run without a budget in `period` (0, 1, ...): drawn from
    `seed` by a hash every process computes alike (Python's `hash` differs per process),
    among the period's first `first_probe_window` windows for period 0, else its all."""
    first, every = params.first_probe_window, params.probe_every_windows
    span = min(first, every) if period == 0 else every
    digest = hashlib.blake2b(f"{seed}/{period}".encode(), digest_size=8).digest()
    return first + period * every + int.from_bytes(digest, "big") % max(1, span)


@dataclass(frozen=True)
class MeasuredCosts:
    """Tracing's costs measured so far, as fractions of an untraced step (None: not yet):
    a traced step's extra time, a switch on and a switch off, and the overhead per traced
    step with the duty cycle's switches spread over its windows."""

    traced_step: float | None
    switch_on: float | None
    switch_off: float | None
    overhead: float | None


@dataclass(frozen=True)
class _Window:
    kind: str  # "T" traced, "U" untraced, "M" mixed (not used to measure)
    times: tuple[float, ...]
    switch_times: tuple[float, ...] = ()  # untraced steps right after a traced one
    switch_on_times: tuple[float, ...] = ()  # traced steps right after an untraced one
    flush_times: tuple[float, ...] = ()  # traced steps after the tracer's own flush


class _Costs:
    """Tracing's costs relative to local baselines, from complete windows in step order
    (see the module docstring). Bounded: the last `history` values of each kind."""

    def __init__(self, history: int, min_samples: int, window_steps: int) -> None:
        self.min_samples, self.window_steps = min_samples, window_steps

        def bounded() -> collections.deque[Any]:
            return collections.deque(maxlen=history)

        # relative costs: traced window median / baseline - 1; a switch-on or flush step's
        # excess over its traced window's median, a switch-off step's over the baseline
        self.traced: collections.deque[float] = bounded()
        self.switch_on: collections.deque[float] = bounded()
        self.switch_off: collections.deque[float] = bounded()
        self.flush: collections.deque[float] = bounded()
        self.offs = self.ons = self.flushes = self.traced_windows = 0  # over the whole run
        self.untraced_windows = 0  # complete untraced windows, over the whole run
        self.settled_runs = 0  # runs of traced windows costed so far
        # the untraced step times just before the current run of traced windows
        self._before: collections.deque[float] = collections.deque(
            maxlen=max(min_samples, window_steps)
        )
        # the current run, waiting for the untraced window after it: traced window
        # medians, (switch-on or flush step, its window's median), switch-off steps
        self._waiting: collections.deque[float] = bounded()
        self._waiting_ons: collections.deque[tuple[float, float]] = bounded()
        self._waiting_flushes: collections.deque[tuple[float, float]] = bounded()
        self._waiting_offs: collections.deque[float] = bounded()

    def copy(self) -> _Costs:
        other = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, collections.deque):
                setattr(other, name, copy.copy(value))
        return other

    def add(self, window: _Window) -> None:
        self.offs += len(window.switch_times)
        self.ons += len(window.switch_on_times)
        if window.kind == "T":
            self.traced_windows += 1
            self.flushes += len(window.flush_times)
            if window.times:  # else its switch and flush steps have no reference
                own = statistics.median(window.times)
                self._waiting.append(own)
                self._waiting_ons.extend((x, own) for x in window.switch_on_times)
                self._waiting_flushes.extend((x, own) for x in window.flush_times)
            return
        self._waiting_offs.extend(window.switch_times)
        if window.kind == "U":
            self.untraced_windows += 1
            pooled = [*self._before, *window.times]
            if len(pooled) >= self.min_samples and statistics.median(pooled) > 0:
                self._settle(statistics.median(pooled))
            for waiting in (self._waiting, self._waiting_ons, self._waiting_flushes):
                waiting.clear()
            self._waiting_offs.clear()
            self._before.extend(window.times)

    def _settle(self, base: float) -> None:
        if self._waiting:
            self.settled_runs += 1
        self.traced.extend(own / base - 1.0 for own in self._waiting)
        self.switch_on.extend((x - own) / base for x, own in self._waiting_ons)
        self.flush.extend((x - own) / base for x, own in self._waiting_flushes)
        self.switch_off.extend((x - base) / base for x in self._waiting_offs)

    def overhead(self) -> float | None:
        """Per traced step, as a fraction (0.13 = 13%); None before any measurement."""
        if not self.traced:
            return None
        share = 0.0
        for values, count in (
            (self.switch_on, self.ons), (self.switch_off, self.offs), (self.flush, self.flushes)
        ):  # fmt: skip
            if values:
                share += max(0.0, statistics.median(values)) * count
        per_step = share / max(1, self.traced_windows) / self.window_steps
        return statistics.median(self.traced) + per_step


class OverheadGovernor:
    """Decides `tracing_on(step)` from recorded (step time, traced) pairs.

    Memory is bounded whatever the run length: a measurement only ever looks at the last
    `history_windows` costs of each kind, so complete windows are folded into `_Costs`'
    bounded queues as decisions advance; only the last `KEPT_DECISIONS`
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
        # every switch of tracing seen in the data, the duty cycle's and any other (a
        # planned or requested capture): the costed switches are only the duty cycle's
        self._tracing_starts = self._tracing_stops = 0
        self._pending_times: list[float | None] = []  # the window being filled
        self._pending_flags: list[bool] = []
        self._pending_switches: list[float] = []
        self._pending_switch_ons: list[float] = []
        self._pending_flushes: list[float] = []
        self._start_seen = False  # the tracer's start: the first traced step
        self._previous_traced: bool | None = None
        self._last_window_kind: str | None = None
        # complete windows not yet seen by a decision, then what decisions have seen
        self._unconsumed: collections.deque[_Window] = collections.deque()
        self._consumed = 0
        prm = self.params
        self._costs = _Costs(prm.history_windows, prm.min_samples, prm.window_steps)
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
        self.probe_seed = ""  # where the probe windows fall (no budget): `seed_probes`
        self._probes: dict[int, int] = {}  # period -> its probe window
        self._fraction: float | None = None
        self._credit = 0.0
        self._burst_left = 0  # traced windows still to come in the current burst
        self._run_windows = 0  # traced windows decided in a row
        self._raised_at_run = 0  # settled runs when the fraction was last raised
        self._measure_now = False  # a raise was capped: start the next run at once
        self._last_overhead: float | None = None
        # tracing asked for outside the duty cycle: (window, traced windows' worth), due
        # from that window's decision on (see `charge`)
        self._charges: collections.deque[tuple[int, float]] = collections.deque()
        self._charged_windows = 0.0

    @classmethod
    def from_config(
        cls, config: TracerConfig, params: GovernorParams | None = None, first_step: int = 0
    ) -> OverheadGovernor:
        """A governor for `config.overhead_budget_pct` (None: trace all but the probe windows)."""
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
        if step_time_s is not None and not (math.isfinite(step_time_s) and step_time_s >= 0):
            raise ValueError(f"step time must be finite and >= 0, or None, got {step_time_s!r}")
        self._recorded += 1
        self._steps_traced += bool(traced)
        if self._previous_traced is not None and self._previous_traced != bool(traced):
            if traced:
                self._tracing_starts += 1
            else:
                self._tracing_stops += 1
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
        # the tracer flushed at the start of a traced step (kineto's window hand-over):
        # tracing's cost too, paid on some steps only; its very first one is the start
        flush = traced and after_flush and not switch_on and self._start_seen
        if traced:
            self._start_seen = True  # the first traced step is the start, flagged or not
        self._previous_traced = bool(traced)
        if switch or switch_on or flush:
            # tracing's cost, not a sample: kept apart (see the module docstring)
            if step_time_s is not None:
                kept = (
                    self._pending_switches
                    if switch
                    else (self._pending_switch_ons if switch_on else self._pending_flushes)
                )
                kept.append(step_time_s)
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
            flushes = tuple(self._pending_flushes) if kind == "T" else ()
            self._unconsumed.append(
                _Window(kind, times, tuple(self._pending_switches), switch_ons, flushes)
            )
            self._last_window_kind = kind
            self._n_windows += 1
            if len(self._unconsumed) > self.MAX_UNCONSUMED_WINDOWS:
                self._consume(1)  # nobody asks for decisions: fold instead of growing
            self._pending_times, self._pending_flags = [], []
            self._pending_switches, self._pending_switch_ons = [], []
            self._pending_flushes = []

    @property
    def steps_recorded(self) -> int:
        """Steps recorded so far."""
        return self._recorded

    def measured_costs(self) -> MeasuredCosts:
        """Tracing's costs from every window recorded so far (the same on every rank,
        however far decisions have got)."""
        costs = self._costs.copy()
        for window in self._unconsumed:
            costs.add(window)

        def median(values: collections.deque[float]) -> float | None:
            return max(0.0, statistics.median(values)) if values else None

        return MeasuredCosts(
            median(costs.traced), median(costs.switch_on), median(costs.switch_off),
            costs.overhead(),
        )  # fmt: skip

    def charge(self, windows: float) -> None:
        """Take `windows` traced windows' worth of credit, for tracing asked for outside
        the duty cycle: from the first window the data recorded so far cannot decide yet,
        so that no rank has decided it and every rank charges the same window."""
        if self.budget_pct is None or not windows > 0 or not math.isfinite(windows):
            return
        window = self._n_windows
        while self._usable_windows(window) <= self._n_windows:
            window += 1
        self._charges.append((window, windows))

    # -- decisions -------------------------------------------------------------------

    def _window_of(self, step: int) -> int:
        if step < self.first_step:
            raise ValueError(f"step {step} is before the governor's first step {self.first_step}")
        return (step - self.first_step) // self.params.window_steps

    def _usable_windows(self, window: int) -> int:
        """Complete data windows that ended at least lag_steps before `window` starts."""
        cutoff = window * self.params.window_steps - self.params.lag_steps
        return max(0, cutoff // self.params.window_steps)

    def window_bounds(self, step: int) -> tuple[int, int]:
        """The first step of `step`'s window and the first step after it."""
        first = self.first_step + self._window_of(step) * self.params.window_steps
        return first, first + self.params.window_steps

    def ready(self, step: int) -> bool:
        """Whether `tracing_on(step)` can be answered from the data recorded so far."""
        return self._n_windows >= self._usable_windows(self._window_of(step))

    def tracing_on(self, step: int) -> bool:
        """Whether `step` is traced; `GovernorNotReadyError` if that cannot be answered now."""
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
            self._costs.add(window)

    def seed_probes(self, seed: str) -> None:
        """Place the untraced probe windows (no budget) by `seed`, which every rank must
        share; before a window that may be a probe is decided (the training thread decides
        window 0 without gathered data, possibly before the control thread's setup has
        the seed: windows under `first_probe_window` are never probes, so that is safe)."""
        if self._n_decided > self.params.first_probe_window:
            raise ValueError("probe windows are seeded before the first probe window is decided")
        self.probe_seed = seed
        self._probes.clear()

    def _is_probe(self, window: int) -> bool:
        p, first = self.params.probe_every_windows, self.params.first_probe_window
        if window < first:
            return False
        period = (window - first) // p
        if period not in self._probes:
            if len(self._probes) > 4:  # decisions go forward: old periods are done
                self._probes.clear()
            self._probes[period] = probe_window(self.probe_seed, period, self.params)
        return window == self._probes[period]

    def _decide(self, window: int) -> bool:
        overhead = self._costs.overhead()
        self._last_overhead = overhead
        if self.budget_pct is None:
            return not self._is_probe(window)
        if window < 2:
            return window == 0  # bootstrap: one traced, one untraced window
        if overhead is None and self._consumed < 2:
            # the bootstrap's measurement is still on its way (a lag longer than two
            # windows): wait for it untraced, accruing no credit, or the blind windows
            # would spend at the initial fraction what the first measurement forbids
            return False
        prm = self.params
        if overhead is not None:
            budget = self.budget_pct / 100.0
            raw = math.inf if overhead <= 0 else budget / overhead
            # the most that can be traced: runs end after max_run_windows
            run = prm.max_run_windows
            ceiling = min(1.0 - 1.0 / prm.probe_every_windows, run / (run + 1))
            target = min(max(raw, prm.min_fraction), ceiling)
            f = self._fraction
            if f is None or not (f <= target <= f * (1 + prm.hysteresis)):
                # re-centre below the target, so noise around it does not switch again
                centred = min(max(raw / (1 + prm.hysteresis / 2), prm.min_fraction), ceiling)
                current = f if f is not None else prm.initial_fraction
                runs = self._costs.settled_runs
                if centred <= current:
                    self._fraction = centred  # spending less: at once
                elif runs >= 2 and runs > self._raised_at_run:
                    # spending more rests on one baseline per run: a slow untraced
                    # window makes tracing look cheap. At most double, once per new run.
                    self._fraction = min(centred, 2.0 * current)
                    self._raised_at_run = runs
                    # capped: measure again now rather than after burst / fraction
                    # windows (a burst borrowed from future credit: the spend is the same)
                    self._measure_now = self._fraction < centred
        fraction = self._fraction if self._fraction is not None else prm.initial_fraction
        while self._charges and self._charges[0][0] <= window:
            charged = self._charges.popleft()[1]
            self._credit -= charged
            self._charged_windows += charged
        # credit accrues in every window, so bursts keep the traced share at `fraction`;
        # never banked beyond two bursts: a window forced off by max_run_windows cannot
        # spend it, and a later fall of the fraction would be spent at full duty
        self._credit = min(self._credit + fraction, 2.0 * prm.burst_windows)
        decision = self._next_decision(prm.burst_windows, prm.max_run_windows)
        self._run_windows = self._run_windows + 1 if decision else 0
        return decision

    def _next_decision(self, burst: int, max_run: int) -> bool:
        if self._run_windows >= max_run:
            self._burst_left = 0  # see GovernorParams.max_run_windows
            return False
        if self._burst_left > 0:
            self._burst_left -= 1
            return True
        borrow = self._measure_now and self._credit > -burst  # one burst owed at most
        self._measure_now = False
        if self._credit >= burst - 1e-9 or borrow:
            self._credit -= burst
            self._burst_left = burst - 1
            return True
        return False

    def report(self) -> dict[str, Any]:
        """Measured overhead, traced fraction and counts, for logs and the status file."""
        costs = self._costs.copy()  # with the windows no decision has seen yet
        for window in self._unconsumed:
            costs.add(window)
        recent = costs.overhead()
        untraced_median = (
            statistics.median(self._recent_untraced) if self._recent_untraced else None
        )

        def excess_ms(values: collections.deque[float]) -> float | None:
            if not values or untraced_median is None:
                return None
            return 1000.0 * max(0.0, statistics.median(values)) * untraced_median

        recorded = self._recorded
        fraction_steps = self._steps_traced / recorded if recorded else None
        return {
            "budget_pct": self.budget_pct,
            "window_steps": self.params.window_steps,
            "min_fraction": self.params.min_fraction,
            "lag_steps": self.params.lag_steps,
            "burst_windows": self.params.burst_windows,
            "windows_decided": self._n_decided,
            "windows_traced": self._n_traced_windows,
            "traced_fraction": self._n_traced_windows / self._n_decided
            if self._n_decided
            else None,
            "target_fraction": self._fraction,
            "measured_overhead_pct": None if recent is None else 100.0 * recent,
            # what it rests on: runs of traced windows costed against the untraced window
            # after them (one such comparison swings by tens of % on a busy host), and the
            # complete windows of each kind so far (a short run has too few to compare)
            "overhead_comparisons": costs.settled_runs,
            "complete_traced_windows": costs.traced_windows,
            "complete_untraced_windows": costs.untraced_windows,
            "effective_overhead_pct": (
                None
                if recent is None or fraction_steps is None
                else 100.0 * recent * fraction_steps
            ),
            "charged_windows": round(self._charged_windows, 3),
            "switches_off": costs.offs,
            "switch_excess_ms": excess_ms(costs.switch_off),
            "switches_on": costs.ons,
            "tracing_starts": self._tracing_starts,
            "tracing_stops": self._tracing_stops,
            "switch_on_excess_ms": excess_ms(costs.switch_on),
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
