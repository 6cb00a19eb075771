"""Anomaly detection over the gathered step times: which steps to capture, deterministically.

Pure: no I/O, no torch, no clocks. Every rank feeds its `Detector` the same gathered
samples (one per step: every rank's duration, and whether tracing was on), so every
rank takes the same decisions in the same order without any further communication.

Rules (all thresholds come from `DetectConfig` / `CaptureConfig`):
- A step's time is the slowest rank's duration (in synchronous training every rank
  waits for the slowest, in asynchronous work the slowest is the anomaly).
- The baseline is the median of the last `window_steps` steps measured under the same
  condition, after `warmup_steps`; a step is judged once `min_steps` such steps exist
  (`RARE_CONDITION_MIN_STEPS` for the rarer conditions). It is anomalous above
  `multiplier` x that median. Conditions: traced or not (tracing has a cost), and
  whether the tracer flushed at the step's start (kineto's per-window flush makes the
  next step slower every time: judged against its own kind). Each
  condition keeps its own window of its own last steps, so rare conditions (a
  duty-cycled tracer's traced steps) still get a baseline. A step must also be above
  the window's spread fence, the median plus `spread_sigmas` robust standard deviations
  (1.4826 x the median absolute deviation): where steps jitter (a loaded host) the fence
  is over `multiplier` x median and the jitter stays under it; where they are steady (a
  quiet GPU) it is far under, and the multiplier decides. The deviation, like the
  median, holds while under half the window is slow, so a recurring stall or a lasting
  slowdown does not raise its own fence (docs/evidence.md, "Noise"). And it must be
  `min_slowdown_ms` over the median: a launch-bound loop of a few ms, however steady,
  has host hiccups of a ms or two that are 1.5-2.5x its step.
- distanom's own capture work (decoding, writing a trace) competes with the training
  thread for the GIL. A step is judged on its time minus the longest such work on any
  rank during it (`self_ms`, the most it can have slowed the step), capped at
  `SELF_DISCOUNT_CAP` x median: while a rank sleeps or waits, its capture worker runs
  freely, and a real stall must not be explained away by work that cost it nothing.
  Disturbed steps stay out of the baseline, so a capture cannot make the next steps
  look slow enough to trigger more captures.
- Anomalous steps at most `merge_gap_steps` apart form one episode (a slowdown that
  persists is one event with a count, not a capture per step). An episode's first
  traced step is captured, and so is a later step whose slowdown (time over the median)
  is at least `ESCALATION` times that of the episode's last capture: jitter just over
  the threshold must not hide the real event a few steps later, while the steps of a
  lasting slowdown, alike in size, stay one capture. Subject to `min_gap_steps` and
  `max_captures`; when the budget is full, a more severe capture replaces the least
  severe one kept.
- Untraced steps (the governor's probe windows, duty-cycled runs) are judged against
  untraced steps only; until the first untraced window holds `RARE_CONDITION_MIN_STEPS`
  of them, against the traced median (tracing only adds time, so that is the safe side).
- Every `reference_every_steps` a typical healthy traced step is captured as the
  reference the kernel diff compares against; the newest replaces the previous one.
- No step after warm-up goes unjudged: where its condition's window is still too short
  (disturbed steps left out of it, a rare condition), it is judged against a wider
  baseline, the first that holds `RARE_CONDITION_MIN_STEPS` steps: every condition's
  undisturbed steps ("all_conditions"), then every step seen, warm-up and disturbed ones
  included ("all_steps"), then the other ranks' times in the same step ("ranks"). A
  wider baseline is noisier, so it flags a step only above `FALLBACK_MIN_MULTIPLIER` x
  its median (slow beyond doubt; `FALLBACK_AFTER_FLUSH_MULTIPLIER` for a step after a
  flush, whose extra cost is not measured yet), and it never sets the headline median.
  Every anomalous step is kept as an `AnomalyJudgment` (`take_anomalies`) saying which
  baseline judged it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from distanom.config import CaptureConfig, DetectConfig
from distanom.rolling import RollingWindow

CaptureKind = Literal["anomaly", "reference", "requested"]

# A reference step must be a typical step: within these multiples of the median. Not
# faster either: the step right after a slow one can be a short catch-up step (the host
# catching up with a GPU that ran ahead), no healthy step to compare later captures with.
REFERENCE_MAX_RATIO = 1.1
REFERENCE_MIN_RATIO = 0.9
# When no step has been typical for this many due steps (steps of two speeds), a faster
# one is taken after all, but never one under half the median.
REFERENCE_FAST_PATIENCE = 10
REFERENCE_FLOOR_RATIO = 0.5
# Within an episode, a step with this many times the slowdown (step / median - 1) of the
# episode's last capture is captured too. Measured on the slowdown, not the whole step,
# so that jitter just over the threshold cannot hide a real stall of under one median a
# few steps later; a third more slowdown keeps a lasting slowdown with +-8% noise at 1-2
# captures per 100 steps.
ESCALATION = 4 / 3

# The most a step's own capture work may explain away, in medians: above what a capture
# costs a short step (a few medians, docs/measurements.md), the rest is the step's own.
SELF_DISCOUNT_CAP = 4.0

# Steps a rarer condition needs before it is judged (after-flush steps come every
# kineto_window_steps-th step, untraced ones in probe windows): a median of 5 is stable
# enough and does not leave them unjudged for hundreds of steps. The main condition (the
# one most steps since the start were measured under: untraced in a budgeted run, traced
# when nearly every step is) needs min_steps and gives the headline median and threshold.
RARE_CONDITION_MIN_STEPS = 5

# A wider (fallback) baseline flags a step only above this multiple of its median, or the
# configured multiplier if that is larger: it mixes conditions, so it is noisier.
FALLBACK_MIN_MULTIPLIER = 2.0
# A step after a tracer flush is slower by a cost its own window has not measured yet:
# judged against a wider baseline, it is flagged only above this multiple.
FALLBACK_AFTER_FLUSH_MULTIPLIER = 8.0

# a normal distribution's standard deviation over its median absolute deviation
ROBUST_SIGMA = 1.4826


def floor_threshold(detect: DetectConfig, median: float, multiplier: float) -> float:
    """The threshold at `median` without the spread fence: `multiplier` x the median, or
    `detect.min_slowdown_ms` over it where that is higher (`observe_many` has it inline;
    the control loop's early rounds use it as it is)."""
    return max(multiplier * median, median + detect.min_slowdown_ms)


def wider_multiplier(configured: float, after_flush: bool) -> float:
    """The multiplier a wider (fallback) baseline judges a step by."""
    floor = FALLBACK_AFTER_FLUSH_MULTIPLIER if after_flush else FALLBACK_MIN_MULTIPLIER
    return max(configured, floor)


@dataclass(frozen=True)
class StepSample:
    """One step as gathered from every rank."""

    step: int
    times_ms: tuple[float, ...]  # index = rank; NaN where a rank has no duration
    traced: bool
    after_flush: bool = False
    disturbed: bool = False
    self_ms: float = 0.0  # the longest distanom capture work on any rank during the step

    @classmethod
    def of_fields(
        cls,
        step: int,
        times_ms: tuple[float, ...],
        traced: bool,
        after_flush: bool,
        disturbed: bool,
        self_ms: float,
    ) -> StepSample:
        """The same sample as the constructor, made without the frozen dataclass's
        `object.__setattr__` per field (a third of the cost): decoding makes one per step
        on the control thread."""
        sample = object.__new__(cls)
        fields = sample.__dict__
        fields["step"] = step
        fields["times_ms"] = times_ms
        fields["traced"] = traced
        fields["after_flush"] = after_flush
        fields["disturbed"] = disturbed
        fields["self_ms"] = self_ms
        return sample

    @property
    def condition(self) -> tuple[bool, bool]:
        """(traced, after_flush): the condition whose baseline judges this step."""
        return (self.traced, self.after_flush)

    @property
    def step_ms(self) -> float:
        """The step's time: the slowest rank's duration (NaN when no rank has one)."""
        finite = [t for t in self.times_ms if math.isfinite(t)]
        return max(finite) if finite else math.nan

    @property
    def slowest_rank(self) -> int:
        """The rank with the longest duration (-1 when no rank has one)."""
        best, best_rank = -math.inf, -1
        for rank, t in enumerate(self.times_ms):
            if math.isfinite(t) and t > best:
                best, best_rank = t, rank
        return best_rank


@dataclass(frozen=True)
class CaptureDecision:
    """Capture `step` on `ranks` (None: every rank); drop `replaces` if set."""

    step: int
    kind: CaptureKind
    step_ms: float
    median_ms: float
    threshold_ms: float
    slowest_rank: int
    ranks: tuple[int, ...] | None = None
    replaces: int | None = None
    episode: int | None = None
    request_id: str | None = None

    @property
    def ratio(self) -> float:
        """The step's time over the median (NaN without a median)."""
        return self.step_ms / self.median_ms if self.median_ms > 0 else math.nan


@dataclass(frozen=True)
class AnomalyJudgment:
    """A step judged anomalous, traced or not, and the baseline that judged it."""

    step: int
    step_ms: float  # as judged (own capture work discounted)
    median_ms: float
    threshold_ms: float
    traced: bool
    judged_by: str  # "condition", "all_conditions", "all_steps" or "ranks"
    slowest_rank: int

    @property
    def ratio(self) -> float:
        """The step's time over the median."""
        return self.step_ms / self.median_ms if self.median_ms > 0 else math.nan


@dataclass
class Episode:
    """A run of anomalous steps (gaps up to merge_gap_steps)."""

    index: int
    first_step: int
    last_step: int
    steps: int = 1
    max_ratio: float = 0.0
    worst_step: int = -1
    captured_step: int | None = None
    captured_ratio: float = 0.0


@dataclass
class DetectorCounts:
    """Running counts of what the detector judged, found, captured and skipped."""

    judged: int = 0
    anomalous: int = 0
    anomalous_untraced: int = 0
    disturbed: int = 0
    captured: int = 0
    replaced: int = 0
    skipped_budget: int = 0
    skipped_min_gap: int = 0
    references: int = 0
    judged_fallback: int = 0  # judged against a wider baseline than their condition's


# (traced, after a flush), in the order the detector keeps their windows
CONDITIONS = ((True, True), (True, False), (False, True), (False, False))


@dataclass
class Detector:
    """The deterministic detection state machine fed by the consensus thread."""

    detect: DetectConfig
    capture: CaptureConfig
    counts: DetectorCounts = field(default_factory=DetectorCounts)
    episodes: list[Episode] = field(default_factory=list)
    median_ms: float = math.nan
    threshold_ms: float = math.nan
    _windows: dict[tuple[bool, bool], RollingWindow] = field(init=False)
    _kept: dict[int, float] = field(default_factory=dict)  # anomaly step -> ratio
    _last_capture_step: int | None = None
    _reference_step: int | None = None
    _last_reference_at: int | None = None
    _fast_while_due: int = 0  # due steps passed over as too fast since the last reference
    _max_episodes_kept: int = 1000
    # every finite step time, warm-up and disturbed included: read only by the widest
    # fallback baseline (rare), so not kept sorted
    _all_steps: collections.deque[float] = field(init=False)
    _main: tuple[bool, bool] = (True, False)  # the condition with the most steps
    # steps each condition's window was given since the start: its window holds only the
    # last window_steps of them, so the windows' lengths tie once the rarer one fills
    _seen: dict[tuple[bool, bool], int] = field(init=False)
    _judged: list[AnomalyJudgment] = field(default_factory=list)
    _max_judged_kept: int = 4096

    def __post_init__(self) -> None:
        self._all_steps = collections.deque(maxlen=self.detect.window_steps)
        self._windows = {
            condition: RollingWindow(self.detect.window_steps) for condition in CONDITIONS
        }
        self._seen = dict.fromkeys(CONDITIONS, 0)

    @property
    def kept_anomalies(self) -> dict[int, float]:
        """A copy of the anomaly captures kept: step -> ratio to the median."""
        return dict(self._kept)

    def _baseline(self, condition: tuple[bool, bool]) -> float | None:
        same = self._windows[condition]
        needed = self.detect.min_steps
        main = self._main_condition()
        if condition != main:  # rarer ones fill their window more slowly
            needed = min(needed, RARE_CONDITION_MIN_STEPS)
            if len(same) < needed and condition == (False, False) and main[0]:
                # the first steps of the first untraced (probe) window: tracing only adds
                # time, so the traced median is a safe stand-in, and a slow step there is
                # still counted (anomalous_untraced) instead of going unjudged
                traced = self._windows[main]
                if len(traced) >= self.detect.min_steps:
                    return traced.median()
        if len(same) < needed:
            return None
        return same.median()

    def _fallback(self, sample: StepSample) -> tuple[float | None, str]:
        """A wider baseline for a step its condition cannot judge yet, and its name."""
        pooled = [t for window in self._windows.values() for t in window]
        if len(pooled) >= RARE_CONDITION_MIN_STEPS:
            return statistics.median(pooled), "all_conditions"
        if len(self._all_steps) >= RARE_CONDITION_MIN_STEPS:
            return statistics.median(self._all_steps), "all_steps"
        others = sorted(t for t in sample.times_ms if math.isfinite(t))[:-1]
        if others:
            return statistics.median(others), "ranks"
        return None, ""

    def take_anomalies(self) -> list[AnomalyJudgment]:
        """The anomalous steps judged since the last call, in step order."""
        judged, self._judged = self._judged, []
        return judged

    def _main_condition(self) -> tuple[bool, bool]:
        """The condition most steps so far were measured under (traced, no flush first)."""
        return self._main

    def _grows_main(self, condition: tuple[bool, bool]) -> bool:
        """Whether `condition`, just given a step, now outranks the main condition (counts
        only grow, and only the one just grown can overtake: kept up to date here)."""

        def rank(c: tuple[bool, bool]) -> tuple[int, bool, int]:
            # most steps since the start (not in the window: a budgeted run's traced
            # window fills too, and then a tie made the traced steps' median the run's);
            # then traced without a flush; then the first in CONDITIONS
            return self._seen[c], c == (True, False), -CONDITIONS.index(c)

        return condition != self._main and rank(condition) > rank(self._main)

    def threshold_before(self, sample: StepSample) -> float:
        """The threshold `observe(sample)` judges the step by (NaN while not judged)."""
        detect = self.detect
        if sample.step < detect.warmup_steps:
            return math.nan
        median = self._baseline(sample.condition)
        multiplier, fence = detect.multiplier, 0.0
        if median is not None:
            fence = self.fence_for(self._windows[sample.condition], median)
        else:  # a wider baseline judges it, as in `observe_many`
            median, _ = self._fallback(sample)
            multiplier = wider_multiplier(multiplier, sample.after_flush)
        if not median:
            return math.nan
        return max(floor_threshold(detect, median, multiplier), fence)

    def observe(self, sample: StepSample) -> list[CaptureDecision]:
        """Judge one step (steps must arrive in order) and return what to capture."""
        return self.observe_many((sample,))

    def observe_many(self, samples: Iterable[StepSample]) -> list[CaptureDecision]:
        """Judge steps in order, as `observe` one at a time, and return what to capture.

        One loop for a whole round with the common case inline (the condition's own
        window judges, the step is not anomalous): this runs for every step on the
        control thread, holding the GIL a launch-bound training thread needs."""
        decisions: list[CaptureDecision] = []
        detect, counts, windows = self.detect, self.counts, self._windows
        warmup, min_steps, configured = detect.warmup_steps, detect.min_steps, detect.multiplier
        min_slowdown = detect.min_slowdown_ms
        every = self.capture.reference_every_steps
        all_steps, seen = self._all_steps, self._seen
        isfinite = math.isfinite
        for sample in samples:
            finite = [t for t in sample.times_ms if isfinite(t)]  # sample.step_ms
            step_ms = max(finite) if finite else math.nan
            if sample.step < warmup:
                if finite:  # observe_warmup
                    all_steps.append(step_ms)
                continue
            if not finite:
                continue
            disturbed = sample.disturbed
            if disturbed:
                counts.disturbed += 1
            condition = (sample.traced, sample.after_flush)
            main = self._main
            window = windows[condition]
            fence = 0.0
            if condition == main and len(window) >= min_steps:  # _baseline's common case
                median: float | None = window.median()
                fence = self._fence(window)
            else:
                median = self._baseline(condition)
                if median is not None:
                    fence = self.fence_for(window, median)
            judged_by, multiplier = "condition", configured
            if median is None:
                median, judged_by = self._fallback(sample)
                multiplier = wider_multiplier(multiplier, sample.after_flush)
            if median is not None and median > 0:
                counts.judged += 1
                # floor_threshold, inline: every step of every round passes here
                threshold = max(multiplier * median, fence, median + min_slowdown)
                if judged_by != "condition":
                    counts.judged_fallback += 1
                elif condition == main:
                    self.median_ms, self.threshold_ms = median, threshold
                judged = max(0.0, step_ms - min(sample.self_ms, SELF_DISCOUNT_CAP * median))
                if judged > threshold:
                    self._keep_judgment(sample, judged, median, threshold, judged_by)
                    decisions.extend(self._on_anomaly(sample, judged, median, threshold))
                elif judged_by == "condition" and every > 0 and sample.traced:
                    # (_maybe_reference takes none otherwise: not called for nothing)
                    decisions.extend(self._maybe_reference(sample, judged, median, threshold))
            if not disturbed:
                window.append(step_ms)
                seen[condition] += 1
                if condition != main and self._grows_main(condition):
                    self._main = condition
            all_steps.append(step_ms)
        return decisions

    def fence_for(self, window: RollingWindow, median: float) -> float:
        """The spread fence for a step whose condition has `window` and baseline `median`:
        the window's own once it holds `min_steps`; before that (a rarer condition: traced
        windows, after-flush steps) the main condition's, scaled to `median` (jitter is a
        share of the step); 0 while neither holds enough steps."""
        min_steps = self.detect.min_steps
        if len(window) >= min_steps:
            return self._fence(window)
        main = self._windows[self._main]
        if len(main) < min_steps:
            return 0.0
        return self._fence(main) / main.median() * median

    def _fence(self, window: RollingWindow) -> float:
        """The window's spread fence: its median plus `spread_sigmas` robust standard
        deviations (0 when off or the window is empty)."""
        sigmas = self.detect.spread_sigmas
        if not sigmas or not len(window):
            return 0.0
        return window.median() + sigmas * ROBUST_SIGMA * window.spread()

    def observe_warmup(self, sample: StepSample) -> None:
        """Keep a warm-up step's time for the widest fallback baseline (never judged)."""
        step_ms = sample.step_ms
        if math.isfinite(step_ms):
            self._all_steps.append(step_ms)

    def _keep_judgment(
        self, sample: StepSample, judged: float, median: float, threshold: float, by: str
    ) -> None:
        if len(self._judged) >= self._max_judged_kept:  # nobody takes them: keep the newest
            del self._judged[0]
        self._judged.append(
            AnomalyJudgment(
                sample.step, judged, median, threshold, sample.traced, by, sample.slowest_rank
            )
        )

    def _on_anomaly(
        self, sample: StepSample, judged: float, median: float, threshold: float
    ) -> list[CaptureDecision]:
        self.counts.anomalous += 1
        ratio = judged / median
        episode = self.episodes[-1] if self.episodes else None
        gap_ok = episode is not None and (
            sample.step - episode.last_step - 1 <= self.detect.merge_gap_steps
        )
        if episode is None or not gap_ok:
            episode = Episode(len(self.episodes), sample.step, sample.step)
            self.episodes.append(episode)
            if len(self.episodes) > self._max_episodes_kept:
                del self.episodes[0]  # the counts stay; only the oldest details go
        else:
            episode.steps += 1
            episode.last_step = sample.step
        if ratio > episode.max_ratio:
            episode.max_ratio, episode.worst_step = ratio, sample.step
        if not sample.traced:
            self.counts.anomalous_untraced += 1
            return []
        if episode.captured_step is not None and not self._escalates(ratio, episode):
            return []
        return self._admit(sample, judged, median, threshold, ratio, episode)

    @staticmethod
    def _escalates(ratio: float, episode: Episode) -> bool:
        """Whether a step inside an episode that already has a capture is captured too:
        it has `ESCALATION` times the slowdown (ratio - 1) of the episode's last capture."""
        return ratio - 1 >= ESCALATION * (episode.captured_ratio - 1)

    def _admit(
        self,
        sample: StepSample,
        judged: float,
        median: float,
        threshold: float,
        ratio: float,
        episode: Episode,
    ) -> list[CaptureDecision]:
        last = self._last_capture_step
        if last is not None and sample.step - last < self.capture.min_gap_steps:
            self.counts.skipped_min_gap += 1
            return []
        replaces: int | None = None
        if len(self._kept) >= self.capture.max_captures:
            if not self._kept:
                self.counts.skipped_budget += 1
                return []
            weakest = min(self._kept, key=lambda s: (self._kept[s], s))
            if self._kept[weakest] >= ratio:
                self.counts.skipped_budget += 1
                return []
            del self._kept[weakest]
            replaces = weakest
            self.counts.replaced += 1
        self._kept[sample.step] = ratio
        self._last_capture_step = sample.step
        episode.captured_step, episode.captured_ratio = sample.step, ratio
        self.counts.captured += 1
        decision = _decision(sample, "anomaly", judged, median, threshold, replaces)
        return [dataclasses.replace(decision, episode=episode.index)]

    def _maybe_reference(
        self, sample: StepSample, judged: float, median: float, threshold: float
    ) -> list[CaptureDecision]:
        every = self.capture.reference_every_steps
        if every <= 0 or not sample.traced:
            return []
        due = self._last_reference_at is None or sample.step - self._last_reference_at >= every
        if not due or sample.disturbed or judged > REFERENCE_MAX_RATIO * median:
            return []
        if judged < REFERENCE_MIN_RATIO * median:
            # too fast to be typical; but when the steps alternate between two speeds the
            # median lies between them and no step is "typical": after enough such steps
            # a fast one is taken, if it is not absurdly fast (a near-empty step)
            self._fast_while_due += 1
            if (
                self._fast_while_due < max(every, REFERENCE_FAST_PATIENCE)
                or judged < REFERENCE_FLOOR_RATIO * median
            ):
                return []
        self._fast_while_due = 0
        previous = self._reference_step
        self._reference_step = self._last_reference_at = sample.step
        self.counts.references += 1
        return [_decision(sample, "reference", judged, median, threshold, previous)]

    def episode_summaries(self) -> list[dict[str, float | int | None]]:
        """One JSON-ready dict per kept episode (steps, worst ratio, captured step)."""
        return [
            {
                "episode": e.index,
                "first_step": e.first_step,
                "last_step": e.last_step,
                "anomalous_steps": e.steps,
                "max_ratio": round(e.max_ratio, 4),
                "worst_step": e.worst_step,
                "captured_step": e.captured_step,
            }
            for e in self.episodes
        ]


def _decision(
    sample: StepSample,
    kind: CaptureKind,
    judged: float,
    median: float,
    threshold: float,
    replaces: int | None,
) -> CaptureDecision:
    return CaptureDecision(
        step=sample.step,
        kind=kind,
        step_ms=judged,
        median_ms=median,
        threshold_ms=threshold,
        slowest_rank=sample.slowest_rank,
        replaces=replaces,
    )
