"""The cross-rank verdict: which rank made a captured step slow, and why.

Owns: one pure function, `decide`, from per-rank evidence of one captured step (each
rank's time breakdown and host, optionally the same for the healthy reference step, the
collectives matched across ranks, the step time and the detector's median) to a
`Verdict` (culprit rank, culprit node, cause, a sentence of evidence with numbers, and
details for machines). No I/O; `distanom.analysis.crossrank` gathers the evidence from
the run directory and the report shows the result.

The method. In synchronous training a slow rank makes every rank slow, because the
others wait for it in the next collective; step times cannot tell them apart, the
breakdown can. A rank's *own time* is everything but exposed communication
(computation + exposed memcpy + idle, plus on CPU-only traces the part of its step
window outside the timeline's span). The culprit is the rank with the most extra own
time and the least waiting; its victims show the same amount as exposed communication.

1. No slowdown (step below `SLOWDOWN_FRACTION` over its baseline): cause "unknown".
2. Extra work, with a reference for every rank: when every rank's computation (or
   exposed memcpy) grew by `GLOBAL_SHARE` of the slowdown, the cause is "global" with
   no culprit, however the waiting moved between ranks (which rank's host comes last
   to a collective is jitter between evenly matched hosts). When only some ranks' did
   (at most `MAX_CULPRIT_SHARE`, the others' grew by less than half that), those ranks
   and that part replace the verdict of steps 3-5 if it names another rank (or none)
   and their step windows grew by `GLOBAL_SHARE` of the slowdown more than its.
3. Stand-out: split the ranks' own times at their largest gap; ranks whose own time
   exceeds the lower group's median by `STANDOUT_FRACTION` of the step are culprits,
   provided they are at most `MAX_CULPRIT_SHARE` of the ranks and the others waited
   (their exposed communication exceeds the worst culprit's by `WAIT_SHARE` of its extra
   time). With a reference for every rank, own time and waiting are what grew since the
   reference (waiting: also as measured), so a rank that is always last is not the
   culprit of every slow step. Among several culprits, the one that arrived last at
   the slowest matched collective (else the one with most own time) is named; when the
   culprits are exactly the ranks of one host, that host is `culprit_node`. Cause: the part of the
   culprit's time (computation → "compute", idle → "host_stall", exposed memcpy →
   "memcpy") that exceeds both the others' median and the culprit's own reference by
   at least `CAUSE_SHARE` of its extra time; none → "unknown".
4. Late arrival: no stand-out, but at a matched collective one rank started
   `STANDOUT_FRACTION` of the step after the first and waited least: it is the culprit;
   without extra own time its delay came from its host ("host_stall").
5. Everyone: every rank's exposed communication grew by `GLOBAL_SHARE` of the slowdown
   over the reference → "communication" (the collective itself is slow); every rank's
   own time did → "global". Both with no culprit.

A host stall gets its likely why from outside the trace (`note_python_gc`): when the
culprit's Python garbage collection during the step (from its step file) took at least
`GC_NOTE_MS` and `GC_SHARE` of the slowdown, the evidence says so.

Arrival times compare clocks: ranks on one host share one, so their start times are
compared directly; across hosts the starts are aligned by the collective's end (all
ranks leave together), i.e. a rank's wait is its duration minus the shortest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from distanom.analysis.collectives import MatchedCollective
from distanom.analysis.evidence import (
    CAUSES,
    Arrival,
    Breakdown,
    Cause,
    RankEvidence,
    Verdict,
    arrival_order,
    median,
)
from distanom.analysis.text import ms as _ms
from distanom.analysis.text import rank_list
from distanom.analysis.verdict_rules import (
    SLOWDOWN_FRACTION,
    culprit_verdict,
    everyone_verdict,
    extra_work_verdict,
    late_arrival_verdict,
    prefer_extra_work,
    slowdown,
    standout,
)

__all__ = [
    "CAUSES",
    "Arrival",
    "Breakdown",
    "Cause",
    "RankEvidence",
    "Verdict",
    "arrival_order",
    "decide",
    "note_python_gc",
    "rank_list",
]

# A collection shorter than this is not worth naming: young ones take tens of µs each.
GC_NOTE_MS = 1.0
# a culprit named for a step under this many times the median is flagged as weak evidence
WEAK_RATIO = 2.0
# ... unless its named part grew over the reference step by this share of the slowdown
REFERENCE_SHARE = 0.5
# ... nor one that explains less than this share of a host stall's slowdown.
GC_SHARE = 0.25


def decide(
    ranks: Iterable[RankEvidence],
    *,
    reference: Iterable[RankEvidence] = (),
    reference_step: int | None = None,
    collectives: Sequence[MatchedCollective] = (),
    step_ms: float | None = None,
    expected_ms: float | None = None,
) -> Verdict:
    """The verdict on one captured step (see the module docstring for the method).

    `ranks`: the step's evidence per rank; `reference`: the same for the healthy
    reference step (`reference_step` names it in the evidence); `collectives`: matched
    across the step's ranks (trace clocks, µs); `step_ms` / `expected_ms`: the step's
    time and the detector's median when known. A named culprit of a step under
    `WEAK_RATIO` x the median says its evidence is weak.
    """
    found = _decide(
        ranks,
        reference=reference,
        reference_step=reference_step,
        collectives=collectives,
        step_ms=step_ms,
        expected_ms=expected_ms,
    )
    return with_strength(found, step_ms, expected_ms, has_reference=reference_step is not None)


def with_strength(
    verdict: Verdict,
    step_ms: float | None,
    expected_ms: float | None,
    *,
    has_reference: bool = False,
) -> Verdict:
    """`verdict`, with a note that its evidence is weak when it names a culprit of a
    step only a little over the median (ordinary jitter can look the same), unless the
    part it names grew over a healthy reference step by at least half the slowdown: a
    change against the reference is evidence whatever the step's size."""
    if verdict.culprit_rank is None or step_ms is None or not expected_ms:
        return verdict
    ratio = step_ms / expected_ms
    grown = has_reference and _grown_over_reference(verdict, step_ms - expected_ms)
    if ratio >= WEAK_RATIO or grown:
        return verdict
    details = {**verdict.details, "weak_evidence": True}
    note = (
        f"; weak evidence: the step was only {ratio:.2f}x the median, "
        "within the jitter of a busy machine"
    )
    return dataclasses.replace(verdict, evidence=verdict.evidence + note, details=details)


def _decide(
    ranks: Iterable[RankEvidence],
    *,
    reference: Iterable[RankEvidence] = (),
    reference_step: int | None = None,
    collectives: Sequence[MatchedCollective] = (),
    step_ms: float | None = None,
    expected_ms: float | None = None,
) -> Verdict:
    current = {e.rank: e for e in ranks}
    before = {e.rank: e for e in reference}
    details: dict[str, Any] = {}
    if not current:
        return Verdict(None, None, "unknown", "no rank's breakdown could be read", details)
    step = median(e.breakdown.step_ms for e in current.values())
    base = slowdown(current, before, reference_step, step_ms, expected_ms)
    if base is not None:
        details["baseline"] = base.what
        details["baseline_ms"] = round(base.baseline_ms, 4)
        if base.slowdown_ms < SLOWDOWN_FRACTION * base.baseline_ms:
            text = (
                f"not a slow step: {_ms(base.baseline_ms + base.slowdown_ms)} ms vs "
                f"{_ms(base.baseline_ms)} ms ({base.what})"
            )
            return Verdict(None, None, "unknown", text, details)
    hosts = {r: e.host for r, e in current.items()}
    arrival = arrival_order(collectives, hosts)
    if arrival is not None:
        details["arrival"] = {
            "collective": arrival.collective,
            "latest_rank": arrival.latest_rank,
            "wait_ms": round(arrival.wait_ms, 4),
            "clock": arrival.clock,
            "matched_collectives": arrival.matched,
        }
    work = None
    if base is not None and len(current) >= 2:
        work = extra_work_verdict(current, before, reference_step, base, dict(details))
        if work is not None and work.culprit_rank is None:
            return work  # the same extra work on every rank

    def agreeing(verdict: Verdict) -> Verdict:
        return prefer_extra_work(verdict, work, current, before, base)

    if len(current) >= 2:
        found = standout(current, before, step, details)
        if found is not None:
            return agreeing(
                culprit_verdict(found, current, before, reference_step, arrival, details)
            )
        if arrival is not None:
            late = late_arrival_verdict(arrival, current, before, step, details)
            if late is not None:
                return agreeing(late)
    return agreeing(everyone_verdict(current, before, reference_step, base, details))


def _grown_over_reference(verdict: Verdict, slowdown: float) -> bool:
    growth = verdict.details.get("growth_ms")
    if not isinstance(growth, dict) or slowdown <= 0:
        return False
    grown = growth.get(verdict.cause)
    return isinstance(grown, (int, float)) and grown >= REFERENCE_SHARE * slowdown


def note_python_gc(verdict: Verdict, pauses: Mapping[str, Mapping[str, Any]]) -> Verdict:
    """`verdict` with the culprit's Python garbage collection added to its evidence when
    the cause is a host stall and the collection could account for it (see the module
    docstring); `pauses` maps rank (as text) to {"ms", "generation"}."""
    if verdict.cause != "host_stall" or verdict.culprit_rank is None:
        return verdict
    pause = pauses.get(str(verdict.culprit_rank))
    if not pause:
        return verdict
    spent, generation = float(pause["ms"]), pause["generation"]
    slowdown = verdict.details.get("slowdown_ms")
    if spent < GC_NOTE_MS or (isinstance(slowdown, (int, float)) and spent < GC_SHARE * slowdown):
        return verdict
    evidence = (
        f"{verdict.evidence}; Python garbage collection ran {_ms(spent)} ms on rank "
        f"{verdict.culprit_rank} during the step (generation {generation})"
    )
    details = {**verdict.details, "python_gc_ms": round(spent, 3)}
    return dataclasses.replace(verdict, evidence=evidence, details=details)
