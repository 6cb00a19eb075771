"""The report's anomalies per class (periodic, lasting slowdown, one-off: the trace
planner's rule, `distanom.run_periods.classify_steps`): episodes detected, traced (a step
of it traced) and explained (a step of it with a verdict that names a cause); and the
periods anomalies recur with (`recurring`, `distanom.run_periods.recurrences`). Pure:
reads the `Anomaly` list `analysis.anomalies` made, for the renderers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distanom.analysis.anomalies import Anomaly, AnomalyVerdict
from distanom.config import DetectConfig
from distanom.run_periods import (
    CLASS_LABELS,
    CLASSES,
    Recurrence,
    classify_steps,
    episodes_of,
    recurrences,
)


@dataclass(frozen=True)
class ClassCounts:
    """One anomaly class: its episodes detected, traced and explained, and their steps."""

    name: str  # "periodic", "lasting_slowdown" or "one_off"
    detected: int
    traced: int
    explained: int
    steps: int

    @property
    def label(self) -> str:
        """The class as a reader names it ("lasting slowdown")."""
        return CLASS_LABELS[self.name]

    def as_json(self) -> dict[str, Any]:
        """The report's JSON entry."""
        return {
            "class": self.name,
            "detected": self.detected,
            "traced": self.traced,
            "explained": self.explained,
            "steps": self.steps,
        }


def _merge_gap(detect_config: Mapping[str, Any] | None) -> int:
    """The run's `detect.merge_gap_steps` (the default when its run.json lacks it)."""
    gap = (detect_config or {}).get("merge_gap_steps")
    if not isinstance(gap, int) or isinstance(gap, bool) or gap < 0:
        return DetectConfig().merge_gap_steps
    return gap


def recurring(
    anomalies: Sequence[Anomaly], detect_config: Mapping[str, Any] | None = None
) -> list[Recurrence]:
    """The periods the recorded anomalies recur with (each came again where predicted)."""
    return recurrences(((a.step, a.ratio) for a in anomalies), _merge_gap(detect_config))


def recurrence_json(recurrence: Recurrence) -> dict[str, Any]:
    """The report's JSON entry of one recurrence."""
    return {
        "period_steps": round(recurrence.period, 1),
        "first_step": recurrence.starts[0],
        "last_step": recurrence.starts[-1],
        "occurrences": len(recurrence.starts),
    }


def recurrence_line(recurrence: Recurrence) -> str:
    """One recurrence as a reader gets it."""
    starts = recurrence.starts
    return (
        f"every ~{recurrence.period:.0f} steps: {len(starts)} times, "
        f"steps {starts[0]} to {starts[-1]}"
    )


def anomaly_classes(
    anomalies: Sequence[Anomaly],
    detect_config: Mapping[str, Any] | None = None,
    found: Sequence[Recurrence] | None = None,
) -> list[ClassCounts]:
    """Per class, in `CLASSES` order: episodes (anomalous steps at most the run's
    `detect.merge_gap_steps` apart) detected, with a traced step, with an explained step.
    `found`: the run's `recurring` periods, when the caller has them already."""
    gap = _merge_gap(detect_config)
    by_step = {a.step: a for a in anomalies}
    kinds = classify_steps(((a.step, a.ratio) for a in anomalies), gap, found=found)
    counts = {name: [0, 0, 0, 0] for name in CLASSES}
    for episode in episodes_of(by_step, gap):
        count = counts[kinds[episode[0]]]
        members = [by_step[step] for step in episode]
        count[0] += 1
        count[1] += any(a.traced for a in members)
        count[2] += any(_explained(a.verdict) for a in members)
        count[3] += len(members)
    return [ClassCounts(name, *counts[name]) for name in CLASSES]


def _explained(verdict: AnomalyVerdict) -> bool:
    return verdict.cause not in ("unknown", "None", "")
