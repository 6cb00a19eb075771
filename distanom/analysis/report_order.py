"""How the report orders and trims what it shows: captures most severe first, a
capture's culprit ranks, and the op changes that matter beside a step's time.

Reads the report model (`distanom.analysis.model.Capture`) and kernel-diff change
dicts; pure functions, used by the HTML page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from distanom.analysis.model import Capture

__all__ = ["by_severity", "is_culprit", "trimmed"]


def by_severity(captures: Sequence[Capture]) -> list[Capture]:
    """Captures most severe first: anomalies before other kinds, then by x rolling median."""

    def severity(capture: Capture) -> tuple[bool, float, int]:
        ratio = capture.ratio if isinstance(capture.ratio, (int, float)) else 0.0
        ratio = ratio if math.isfinite(ratio) else 0.0
        return ("anomaly" not in capture.kinds, -ratio, capture.step)

    return sorted(captures, key=severity)


def is_culprit(capture: Capture, rank: int) -> bool:
    """Whether the verdict names `rank` among the capture's culprits."""
    verdict = capture.verdict
    if verdict.culprit_rank is None:
        return False
    return rank in (verdict.details.get("culprit_ranks") or [verdict.culprit_rank])


def trimmed(
    changes: list[Any], step_ms: float | None, top: int, min_share: float
) -> tuple[list[Any], int, float]:
    """The changes that matter, largest first: at most `top`, none under `min_share` of
    the step; and how many were left out and their sum (µs)."""

    def size(change: Any) -> float:
        value = change.get("added_us")
        return abs(float(value)) if isinstance(value, (int, float)) else 0.0

    ordered = sorted(changes, key=size, reverse=True)
    floor = min_share * step_ms * 1000 if step_ms else 0.0
    shown = [c for c in ordered if size(c) >= floor][:top]
    rest = ordered[len(shown) :]
    return shown, len(rest), sum(float(c.get("added_us") or 0) for c in rest)
