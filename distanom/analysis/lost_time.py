"""How much time a run lost to its slow steps, by culprit rank, cause and phase, largest
first: what the report says first (text, `lost_time` in JSON, HTML).

A slow step lost its time over the median it was judged against. Steps are grouped by
their verdict's culprit, cause and phase; a knock-on step (its verdict's
`knock_on_of`: the others waited for a rank whose step before ran long) is counted in
that step's group and episode, so one stall that slows two steps is one episode. The
share is of the run's step time (each step's slowest rank, summed). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distanom.analysis.anomalies import Anomaly
from distanom.analysis.text import culprit_words

SHOWN = 3  # groups named in the text line; all in the JSON


@dataclass(frozen=True)
class LostShare:
    """The time one culprit, cause and phase cost the run."""

    culprit_rank: int | None
    cause: str
    phase: str | None
    lost_ms: float
    steps: list[int]
    episodes: int

    def as_json(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "culprit_rank": self.culprit_rank,
            "cause": self.cause,
            "phase": self.phase,
            "lost_ms": round(self.lost_ms, 3),
            "steps": len(self.steps),
            "episodes": self.episodes,
            "first_steps": self.steps[:8],
        }

    def words(self) -> str:
        """`9.8 s rank 1 — data loading (data) in 3 steps`."""
        phase = f" ({self.phase})" if self.phase else ""
        count = f"{len(self.steps)} step" + ("s" if len(self.steps) != 1 else "")
        if self.episodes != len(self.steps):
            count += f", {self.episodes} episode" + ("s" if self.episodes != 1 else "")
        who = culprit_words(self.culprit_rank, self.cause)
        return f"{_seconds(self.lost_ms)} {who}{phase} in {count}"


@dataclass(frozen=True)
class LostTime:
    """The run's time lost to slow steps, and its groups, largest first."""

    lost_ms: float
    run_ms: float | None
    shares: list[LostShare]

    @property
    def pct(self) -> float | None:
        """The lost time as a percentage of the run's step time."""
        if self.run_ms is None or self.run_ms <= 0:
            return None
        return self.lost_ms / self.run_ms * 100

    def as_json(self) -> dict[str, Any]:
        """The report's `lost_time`."""
        pct = self.pct
        return {
            "lost_ms": round(self.lost_ms, 3),
            "run_ms": None if self.run_ms is None else round(self.run_ms, 3),
            "pct": None if pct is None else round(pct, 3),
            "by_culprit": [share.as_json() for share in self.shares],
        }

    def line(self) -> str:
        """The report's first line about slowness."""
        if not self.shares:
            return "lost: no time to slow steps"
        pct = self.pct
        of = f" ({pct:.1f}% of the run's step time)" if pct is not None else ""
        named = "; ".join(share.words() for share in self.shares[:SHOWN])
        more = f"; {len(self.shares) - SHOWN} more in --json" if len(self.shares) > SHOWN else ""
        return f"lost {_seconds(self.lost_ms)}{of} to slow steps: {named}{more}"


def lost_time(anomalies: Sequence[Anomaly], run_ms: float | None) -> LostTime:
    """Group the anomalies' lost time (step time over the median) by verdict."""
    # per group: (step, lost ms, the step it is a knock-on of, or None)
    groups: dict[tuple[int | None, str, str | None], list[tuple[int, float, Any]]] = {}
    for anomaly in anomalies:
        lost = anomaly.step_ms - anomaly.median_ms
        if not (math.isfinite(lost) and lost > 0):
            continue
        verdict = anomaly.verdict
        knock = verdict.details.get("knock_on_of")
        key = (verdict.culprit_rank, verdict.cause, verdict.phase)
        groups.setdefault(key, []).append((anomaly.step, lost, knock))
    shares = []
    for (rank, cause, phase), members in groups.items():
        steps = [step for step, _lost, _knock in members]
        in_group = set(steps)
        knock_ons = sum(1 for _step, _lost, knock in members if knock in in_group)
        shares.append(
            LostShare(
                rank,
                cause,
                phase,
                sum(lost for _s, lost, _k in members),
                steps,
                len(steps) - knock_ons,
            )
        )
    shares.sort(key=lambda share: -share.lost_ms)
    total = sum(share.lost_ms for share in shares)
    return LostTime(total, run_ms, shares)


def _seconds(ms: float) -> str:
    return f"{ms / 1e3:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"
