"""The verdict's vocabulary: a rank's time breakdown, its evidence, the verdict, arrivals.

Frozen values only, plus `arrival_order` (who came last to the matched collectives);
`distanom.analysis.verdict_rules` reasons over them and `distanom.analysis.verdict`
decides. No I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from distanom.analysis.collectives import MatchedCollective
from distanom.analysis.text import culprit_words, ranks_word

__all__ = [
    "CAUSES",
    "PARTS",
    "PART_OF",
    "Arrival",
    "Breakdown",
    "Cause",
    "Part",
    "RankEvidence",
    "Verdict",
    "arrival_order",
    "median",
]

Cause = Literal["compute", "host_stall", "memcpy", "communication", "global", "unknown"]
CAUSES: tuple[Cause, ...] = (
    "compute",
    "host_stall",
    "memcpy",
    "communication",
    "global",
    "unknown",
)


@dataclass(frozen=True)
class Breakdown:
    """One rank's step split as the timeline splits it (ms)."""

    computation_ms: float
    exposed_comm_ms: float
    exposed_memcpy_ms: float
    idle_ms: float
    total_ms: float
    outside_ms: float = 0.0
    """Part of the rank's step window outside the timeline's span (known on CPU-only
    traces, from the step annotation: a stall before the first op); counted as idle."""

    @property
    def own_ms(self) -> float:
        """Everything but waiting in communication."""
        return self.computation_ms + self.exposed_memcpy_ms + self.idle_ms + self.outside_ms

    @property
    def stalled_ms(self) -> float:
        """Idle time, inside the span or outside it."""
        return self.idle_ms + self.outside_ms

    @property
    def step_ms(self) -> float:
        """The rank's whole step window: the timeline's span plus the time outside it."""
        return self.total_ms + self.outside_ms

    @classmethod
    def from_rows(cls, rows: Mapping[str, float], outside_ms: float = 0.0) -> Breakdown:
        """From timeline rows in ms (`computation_time`, `exposed_comm_time`, ...)."""
        return cls(
            computation_ms=float(rows["computation_time"]),
            exposed_comm_ms=float(rows["exposed_comm_time"]),
            exposed_memcpy_ms=float(rows["exposed_memcpy_time"]),
            idle_ms=float(rows["idle_time"]),
            total_ms=float(rows["total_time"]),
            outside_ms=max(0.0, outside_ms),
        )


@dataclass(frozen=True)
class RankEvidence:
    """One rank's evidence for the verdict: its host and its step's breakdown."""

    rank: int
    host: str | None
    breakdown: Breakdown


@dataclass(frozen=True)
class Verdict:
    """Which rank (or node) made a step slow, the cause, a sentence of evidence, details."""

    culprit_rank: int | None
    culprit_node: str | None
    cause: Cause
    evidence: str
    details: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The verdict as the report's JSON holds it."""
        return {
            "culprit_rank": self.culprit_rank,
            "culprit_node": self.culprit_node,
            "cause": self.cause,
            "evidence": self.evidence,
            "details": self.details,
        }

    def sentence(self) -> str:
        """One line for people: who, why, and the numbers."""
        if self.culprit_node is None:
            return f"{culprit_words(self.culprit_rank, self.cause)}: {self.evidence}"
        ranks = self.details.get("culprit_ranks") or [self.culprit_rank]
        who = f"node {self.culprit_node} ({ranks_word(ranks)})"
        return f"{who} — {self.cause.replace('_', ' ')}: {self.evidence}"


@dataclass(frozen=True)
class Arrival:
    """Who arrived last at the matched collective where the others waited longest."""

    collective: str
    latest_rank: int
    wait_ms: float
    """How long the first rank to arrive waited for the last."""
    waits_ms: Mapping[int, float]
    clock: str
    """"shared host clock" (start times compared) or "end-aligned" (durations)."""
    matched: int


def arrival_order(
    collectives: Sequence[MatchedCollective], hosts: Mapping[int, str | None]
) -> Arrival | None:
    """The matched collective with the longest wait for its last rank, or None."""
    best: Arrival | None = None
    for coll in collectives:
        ranks = coll.ranks
        if len(ranks) < 2:
            continue
        shared = len({hosts.get(r) for r in ranks}) == 1 and hosts.get(ranks[0]) is not None
        if shared:
            latest = max(ranks, key=lambda r: coll.start_us[r])
            waits = {r: (coll.start_us[latest] - coll.start_us[r]) / 1000 for r in ranks}
            clock = "shared host clock"
        else:
            duration = {r: coll.end_us[r] - coll.start_us[r] for r in ranks}
            latest = min(ranks, key=lambda r: duration[r])
            waits = {r: (duration[r] - duration[latest]) / 1000 for r in ranks}
            clock = "end-aligned"
        wait = max(waits.values())
        if best is None or wait > best.wait_ms:
            best = Arrival(coll.label(), latest, wait, waits, clock, len(collectives))
    return best


class Part(NamedTuple):
    """A part of a rank's own time that can name the cause."""

    cause: Cause
    label: str
    """What it is called in evidence."""
    read: Callable[[Breakdown], float]


PARTS = (
    Part("compute", "computation", lambda b: b.computation_ms),
    Part("host_stall", "idle", lambda b: b.stalled_ms),
    Part("memcpy", "exposed memcpy", lambda b: b.exposed_memcpy_ms),
)
PART_OF = {part.cause: part for part in PARTS}


def median(values: Iterable[float]) -> float:
    """The median of `values` as a float."""
    return float(statistics.median(list(values)))
