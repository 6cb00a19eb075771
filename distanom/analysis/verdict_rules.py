"""The rules of the cross-rank verdict (see `distanom.analysis.verdict` for the method).

Owns the thresholds and one function per rule: the step's slowdown over its baseline,
the stand-out ranks, the cause of a culprit's extra time, and the verdicts of extra
work, of a stand-out culprit, of a late arrival and of "everyone". Each rule takes the
evidence by rank and returns a `Verdict` (or None when it does not apply). No I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distanom.analysis.evidence import (
    PART_OF,
    PARTS,
    Arrival,
    Breakdown,
    Cause,
    Part,
    RankEvidence,
    Verdict,
    median,
)
from distanom.analysis.text import change as _change
from distanom.analysis.text import ms as _ms
from distanom.analysis.text import ranks_word as _ranks_word
from distanom.analysis.text import span as _span

# A culprit's extra own time must be at least this share of the step. An anomaly at the
# detector's default 1.5 x median adds a third of the step; the spread of own time
# between healthy ranks stays well below it (numbers in docs/report.md).
STANDOUT_FRACTION = 0.25
# ...and at least this many ms: below 50 µs differences are launch jitter.
MIN_STANDOUT_MS = 0.05
# The others must have waited for at least half the culprit's extra time. Extra work
# that nobody waited for (overlapped, or on an unsynchronised rank) did not slow the step.
WAIT_SHARE = 0.5
# At most half of the ranks can be culprits; when more are slow, the fast ones are the
# exception and the slowdown is global (or has no single cause).
MAX_CULPRIT_SHARE = 0.5
# One part of the time (compute / idle / memcpy) names the cause when it holds at least
# half of the culprit's extra time; a spread-out excess is left "unknown".
CAUSE_SHARE = 0.5
# A step at least 20 % over its baseline has a slowdown worth explaining; a healthy
# step (e.g. a requested capture) gets "unknown", whatever its ranks look like.
SLOWDOWN_FRACTION = 0.2
# A part that is not the cause is still named ("also") when it holds this share of the
# extra time: a step can have two problems (e.g. a host stall while an extra kernel runs).
ALSO_SHARE = 0.25
# "Everyone" verdicts: every rank's growth must reach half the slowdown, so one rank's
# outlier cannot make the whole job "global".
GLOBAL_SHARE = 0.5


@dataclass(frozen=True)
class _Baseline:
    slowdown_ms: float
    baseline_ms: float
    what: str


def slowdown(
    current: Mapping[int, RankEvidence],
    reference: Mapping[int, RankEvidence],
    reference_step: int | None,
    step_ms: float | None,
    expected_ms: float | None,
) -> _Baseline | None:
    """The step's slowdown over its baseline (the detector's median, else the reference
    step), or None."""
    if step_ms is not None and expected_ms:
        return _Baseline(
            step_ms - expected_ms, expected_ms, "the detector's rolling median at this step"
        )
    common = [r for r in current if r in reference]
    if common:
        now = median(current[r].breakdown.step_ms for r in common)
        before = median(reference[r].breakdown.step_ms for r in common)
        what = f"reference step {reference_step}" if reference_step is not None else "reference"
        return _Baseline(now - before, before, what)
    return None


@dataclass(frozen=True)
class _Standout:
    culprits: list[int]
    others: list[int]
    worst: int
    excess_ms: float
    waited_ms: float


def standout(
    current: Mapping[int, RankEvidence],
    reference: Mapping[int, RankEvidence],
    step: float,
    notes: dict[str, Any],
) -> _Standout | None:
    """The ranks whose own time stands out while the others waited for them, or None (why in
    `notes`)."""
    own = {r: e.breakdown.own_ms for r, e in current.items()}
    comm = {r: e.breakdown.exposed_comm_ms for r, e in current.items()}
    comm_growth: dict[int, float] | None = None
    if all(r in reference for r in current):
        # Compare what changed since the reference: a rank whose host always launches
        # later (it idles while the others wait for it every step) is not this step's
        # culprit (docs/report.md, "always-late rank").
        for r in own:
            own[r] -= reference[r].breakdown.own_ms
        comm_growth = {r: comm[r] - reference[r].breakdown.exposed_comm_ms for r in comm}
        notes["standout_basis"] = "growth over the reference step"
    order = sorted(own, key=lambda r: (own[r], r))
    gap_at = max(range(len(order) - 1), key=lambda i: own[order[i + 1]] - own[order[i]])
    base = median(own[r] for r in order[: gap_at + 1])
    threshold = max(MIN_STANDOUT_MS, STANDOUT_FRACTION * step)
    culprits = sorted(r for r in own if own[r] - base >= threshold)
    if not culprits:
        notes["standout"] = (
            f"largest extra own time {_ms(max(own.values()) - base)} ms < {_ms(threshold)} ms"
        )
        return None
    if len(culprits) > MAX_CULPRIT_SHARE * len(own):
        notes["standout"] = f"{len(culprits)} of {len(own)} ranks slow: more than half"
        return None
    others = [r for r in own if r not in culprits]
    worst = max(culprits, key=lambda r: (own[r], -r))
    excess = own[worst] - median(own[r] for r in others)
    waited = median(comm[r] for r in others) - comm[worst]
    if comm_growth is not None:
        # others that always wait for this rank already waited in the reference: what
        # they wait now counts, and so does what they wait more
        waited = max(waited, median(comm_growth[r] for r in others) - comm_growth[worst])
    if waited < WAIT_SHARE * excess:
        notes["standout"] = (
            f"{_ranks_word(culprits)} had {_ms(excess)} ms extra own time but the others "
            f"waited only {_ms(waited)} ms more"
        )
        return None
    return _Standout(culprits, others, worst, excess, waited)


def _cause_of(
    rank: int,
    others: Sequence[int],
    current: Mapping[int, RankEvidence],
    reference: Mapping[int, RankEvidence],
    extra_ms: float,
) -> tuple[Cause | None, Part, dict[str, float]]:
    """The part of `rank`'s time that grew most over the others (and its reference).

    With a reference, only the extra time that is new counts: a rank that always
    computes more (uneven shards) and now also stalls is a host stall, not compute.
    """
    mine = current[rank].breakdown
    before = reference[rank].breakdown if rank in reference else None
    if before is not None:
        extra_ms = min(extra_ms, mine.own_ms - before.own_ms)
    growth: dict[str, float] = {}
    for part in PARTS:
        over_others = part.read(mine) - median(part.read(current[o].breakdown) for o in others)
        if before is not None:
            over_others = min(over_others, part.read(mine) - part.read(before))
        growth[part.cause] = round(over_others, 4)
    best = max(PARTS, key=lambda part: growth[part.cause])  # first of equals on ties
    if extra_ms <= 0 or growth[best.cause] < CAUSE_SHARE * extra_ms:
        return None, best, growth
    return best.cause, best, growth


def _also(
    growth: Mapping[Cause, float] | Mapping[str, float], cause: str, extra_ms: float
) -> list[Cause]:
    """The other parts that grew by at least ALSO_SHARE of the extra time, largest first."""
    if extra_ms <= 0:
        return []
    others = [p.cause for p in PARTS if p.cause != cause]
    big = [c for c in others if growth.get(c, 0.0) >= ALSO_SHARE * extra_ms]
    return sorted(big, key=lambda c: -growth[c])


def _node_of(culprits: Sequence[int], hosts: Mapping[int, str | None]) -> str | None:
    """The host whose ranks are exactly the culprits, if there is one."""
    names = {hosts.get(r) for r in culprits}
    if len(names) != 1:
        return None
    host = next(iter(names))
    if host is None:
        return None
    on_host = {r for r, h in hosts.items() if h == host}
    return host if on_host == set(culprits) else None


def _outside_note(outside: Sequence[float]) -> str:
    """Idle time outside the ops' span is not in the timeline's idle row: the verdict
    says how much of its idle that is, so its number matches the report's table."""
    if max(outside) < 0.005:
        return ""
    whose = "its" if len(outside) == 1 else "their"
    return f" (incl. {_span(outside)} outside {whose} ops)"


def _baseline_word(base: _Baseline | None, reference_step: int | None, with_reference: bool) -> str:
    """What a slowdown was measured against, for a sentence."""
    if with_reference:
        return (
            f"in reference step {reference_step}"
            if reference_step is not None
            else "in the reference"
        )
    return base.what if base is not None else "usual"


def _reference_note(
    rank: int,
    part: Callable[[Breakdown], float],
    reference: Mapping[int, RankEvidence],
    reference_step: int | None,
) -> str:
    if rank not in reference:
        return ""
    where = f"reference step {reference_step}" if reference_step is not None else "reference"
    return f", {_ms(part(reference[rank].breakdown))} ms in {where}"


def culprit_verdict(
    found: _Standout,
    current: Mapping[int, RankEvidence],
    reference: Mapping[int, RankEvidence],
    reference_step: int | None,
    arrival: Arrival | None,
    details: dict[str, Any],
) -> Verdict:
    """The verdict naming stand-out culprits, their cause and the others' waiting."""
    hosts = {r: e.host for r, e in current.items()}
    culprit = found.worst
    if arrival is not None and arrival.latest_rank in found.culprits:
        culprit = arrival.latest_rank
    node = _node_of(found.culprits, hosts)
    cause, part, growth = _cause_of(culprit, found.others, current, reference, found.excess_ms)
    read, label = part.read, part.label
    if cause is None:  # no part grew: name the rank's own time, never a part that did not
        read, label = (lambda b: b.own_ms), "own time"
    values = [read(current[r].breakdown) for r in found.culprits]
    others_part = median(read(current[o].breakdown) for o in found.others)
    who = _ranks_word(found.culprits) + (f" (all of node {node})" if node else "")
    text = f"{who}: {label} {_span(values)}"
    if cause == "host_stall":
        text += _outside_note([current[r].breakdown.outside_ms for r in found.culprits])
    text += f" vs {_ms(others_part)} ms median of the others"
    if len(values) == 1:
        text += _reference_note(culprit, read, reference, reference_step)
    if cause is None:
        text += f" (extra own time {_ms(found.excess_ms)} ms spread over several parts)"
    also = _also(growth, part.cause, found.excess_ms)
    if also:
        text += "; " + ", ".join(f"{PART_OF[c].label} also +{_ms(growth[c])} ms" for c in also)
        details["also"] = also
    comm = [current[o].breakdown.exposed_comm_ms for o in found.others]
    text += f"; {_ranks_word(found.others)}: exposed comm {_span(comm)}"
    if arrival is not None:
        agrees = arrival.latest_rank in found.culprits
        details["arrival_agrees"] = agrees
        if agrees and arrival.wait_ms >= MIN_STANDOUT_MS:
            text += (
                f"; rank {arrival.latest_rank} arrived last at {arrival.collective}, "
                f"{_ms(arrival.wait_ms)} ms after the first"
            )
    details.update(
        culprit_ranks=found.culprits,
        extra_own_ms=round(found.excess_ms, 4),
        others_waited_ms=round(found.waited_ms, 4),
        growth_ms=growth,
    )
    if culprit in current and current[culprit].host is not None:
        details["culprit_host"] = current[culprit].host
    return Verdict(culprit, node, cause or "unknown", text, details)


def late_arrival_verdict(
    arrival: Arrival,
    current: Mapping[int, RankEvidence],
    reference: Mapping[int, RankEvidence],
    step: float,
    details: dict[str, Any],
) -> Verdict | None:
    """The verdict naming the rank that arrived last at a collective, or None."""
    if arrival.wait_ms < max(MIN_STANDOUT_MS, STANDOUT_FRACTION * step):
        return None
    late = arrival.latest_rank
    comm = {r: e.breakdown.exposed_comm_ms for r, e in current.items()}
    if late not in comm:
        return None
    others = [r for r in current if r != late]
    nested = ""
    if comm[late] > min(comm.values()):
        # the late starter must also be the one that waited least, unless its own stall
        # accounts for its lateness: a collective nested in an enclosing host op (an
        # optimizer step that runs the backward in a closure) reads as computation there
        stall = current[late].breakdown.stalled_ms
        own_delay = stall - median(current[o].breakdown.stalled_ms for o in others)
        if own_delay < CAUSE_SHARE * arrival.wait_ms:
            return None
        nested = (
            f"; its idle {_ms(stall)} ms explains it (the others waited inside their own "
            "ops, so their wait reads as computation)"
        )
    cause, _, growth = _cause_of(late, others, current, reference, arrival.wait_ms)
    text = (
        f"rank {late} arrived last at {arrival.collective}, {_ms(arrival.wait_ms)} ms after "
        f"the first ({arrival.clock}); exposed comm {_ms(comm[late])} ms vs "
        f"{_span([comm[o] for o in others])} on {_ranks_word(others)}{nested}"
    )
    if cause is None:
        cause = "host_stall"
        text += "; no extra work on its timeline: the delay was on its host"
    details.update(culprit_ranks=[late], growth_ms=growth)
    return Verdict(late, None, cause, text, details)


def extra_work_verdict(
    current: Mapping[int, RankEvidence],
    reference: Mapping[int, RankEvidence],
    reference_step: int | None,
    base: _Baseline,
    details: dict[str, Any],
) -> Verdict | None:
    """Extra work (computation or memcpy over the reference) that explains the slowdown.

    On every rank: a global slowdown. On a few ranks only (at most `MAX_CULPRIT_SHARE`),
    the others clearly without it: those ranks are the culprits. Kernel time is the
    part of a breakdown that does not move between ranks; idle and exposed comm do
    (docs/report.md, "waiting moves between ranks").
    """
    if base.slowdown_ms <= 0 or not all(r in reference for r in current):
        return None
    where = f"reference step {reference_step}" if reference_step is not None else "reference"
    enough = GLOBAL_SHARE * base.slowdown_ms
    for part in (p for p in PARTS if p.cause != "host_stall"):
        grown = {
            r: part.read(e.breakdown) - part.read(reference[r].breakdown)
            for r, e in current.items()
        }
        if min(grown.values()) >= enough:
            details["global_part"] = part.cause
            details["growth_ms"] = {part.cause: round(median(grown.values()), 4)}
            text = (
                f"all {len(current)} ranks: {part.label} {_change(list(grown.values()), where)}"
                f" against a slowdown of {_ms(base.slowdown_ms)} ms: every rank slowed together"
            )
            return Verdict(None, None, "global", text, details)
        culprits = sorted(r for r, g in grown.items() if g >= enough)
        others = [r for r in grown if r not in culprits]
        if (
            culprits
            and len(culprits) <= MAX_CULPRIT_SHARE * len(grown)
            and max(grown[r] for r in others) < enough / 2
        ):
            worst = max(culprits, key=lambda r: (grown[r], -r))
            node = _node_of(culprits, {r: e.host for r, e in current.items()})
            who = _ranks_word(culprits) + (f" (all of node {node})" if node else "")
            text = (
                f"{who}: {part.label} {_change([grown[r] for r in culprits], where)} vs "
                f"{_span([grown[r] for r in others])} on {_ranks_word(others)}, against a "
                f"slowdown of {_ms(base.slowdown_ms)} ms"
            )
            details.update(
                culprit_ranks=culprits,
                growth_ms={part.cause: round(grown[worst], 4)},
                work_part=part.cause,
            )
            return Verdict(worst, node, part.cause, text, details)
    return None


def everyone_verdict(
    current: Mapping[int, RankEvidence],
    reference: Mapping[int, RankEvidence],
    reference_step: int | None,
    base: _Baseline | None,
    details: dict[str, Any],
) -> Verdict:
    """The verdict when no rank stands out: communication, global, or unknown."""
    common = sorted(r for r in current if r in reference)
    with_reference = bool(common)
    if common:
        where = f"reference step {reference_step}" if reference_step is not None else "reference"

        def grown(part: Callable[[Breakdown], float]) -> dict[int, float]:
            return {r: part(current[r].breakdown) - part(reference[r].breakdown) for r in common}

        slowdown = median(grown(lambda b: b.step_ms).values())

        def amount(values: Sequence[float]) -> str:
            return _change(values, where)
    elif base is not None:
        common = sorted(current)

        def grown(part: Callable[[Breakdown], float]) -> dict[int, float]:
            return {r: part(current[r].breakdown) for r in common}

        slowdown = base.slowdown_ms

        def amount(values: Sequence[float]) -> str:
            return f"at {_span(values)}"
    else:
        return Verdict(
            None,
            None,
            "unknown",
            "no rank stands out, and there is no reference step or median to compare with",
            details,
        )
    details["slowdown_ms"] = round(slowdown, 4)
    if slowdown <= 0:
        than = _baseline_word(base, reference_step, with_reference)
        text = (
            f"no rank stands out, and the traced ranks took no longer than {than}: the "
            "step's extra time is not in the traces (see 'outside ops' in docs/glossary.md)"
        )
        return Verdict(None, None, "unknown", text, details)
    if (
        base is not None
        and with_reference
        and slowdown < GLOBAL_SHARE * base.slowdown_ms
        and median(current[r].breakdown.step_ms for r in common) - base.baseline_ms
        < GLOBAL_SHARE * base.slowdown_ms
    ):
        # the ranks' common growth, over the reference and over the median alike, is a
        # small part of the step's slowdown: the rest is one rank's time that nobody
        # waited for in this step (e.g. after its last collective), which the traces
        # cannot pin; "every rank slowed" would be wrong. (Over the median too: steps
        # that sped up since an old reference make growth over it look small.)
        text = (
            f"no rank stands out: the traced steps grew by a median of {_ms(slowdown)} ms "
            f"over {where}, a small part of the step's slowdown of "
            f"{_ms(base.slowdown_ms)} ms ({base.what})"
        )
        note = details.get("standout")
        if isinstance(note, str) and "waited only" in note:
            text += f"; {note}"
        return Verdict(None, None, "unknown", text, details)
    comm = grown(lambda b: b.exposed_comm_ms)
    own = grown(lambda b: b.own_ms)
    comm_all = min(comm.values()) >= GLOBAL_SHARE * slowdown
    own_all = min(own.values()) >= GLOBAL_SHARE * slowdown
    everyone = f"all {len(common)} ranks" if len(common) > 1 else _ranks_word(common)
    if comm_all and (not own_all or median(comm.values()) >= median(own.values())):
        text = (
            f"{everyone}: exposed comm {amount(list(comm.values()))}, own time "
            f"{amount(list(own.values()))}: the collective itself is slow"
        )
        details["growth_ms"] = {"exposed_comm": round(median(comm.values()), 4)}
        return Verdict(None, None, "communication", text, details)
    if own_all:
        parts = {part.cause: grown(part.read) for part in PARTS}
        cause = max(parts, key=lambda c: median(parts[c].values()))
        label = PART_OF[cause].label
        medians = {c: median(v.values()) for c, v in parts.items()}
        growth = f"{everyone}: {label} {amount(list(parts[cause].values()))}"
        # without a reference the parts are absolute times, not growth: nothing to add
        also = _also(medians, cause, slowdown) if with_reference else []
        growth += "".join(f", {PART_OF[c].label} {amount(list(parts[c].values()))}" for c in also)
        growth += f", exposed comm {amount(list(comm.values()))}"
        if also:
            details["also"] = also
        details["growth_ms"] = {c: round(v, 4) for c, v in medians.items()}
        details["global_part"] = cause
        if len(current) == 1:  # one rank: "everyone" is that rank, and the part is the cause
            return Verdict(common[0], None, cause, growth, details)
        return Verdict(None, None, "global", f"{growth}: every rank slowed together", details)
    text = (
        f"no rank stands out; own time {amount(list(own.values()))}, exposed comm "
        f"{amount(list(comm.values()))} against a slowdown of {_ms(slowdown)} ms"
    )
    return Verdict(None, None, "unknown", text, details)


def prefer_extra_work(
    verdict: Verdict,
    work: Verdict | None,
    current: Mapping[int, RankEvidence],
    reference: Mapping[int, RankEvidence],
    base: _Baseline | None,
) -> Verdict:
    """The verdict found from own time and waiting, unless extra kernel time on other
    ranks (`work`) says otherwise and their step windows grew while the named rank's did
    not: then the waiting only moved between ranks (it turned into the named rank's
    idle), and the extra kernel time says who and why."""
    if work is None or base is None:
        return verdict
    culprits = work.details.get("culprit_ranks", [])
    if verdict.culprit_rank in culprits:
        return verdict  # the same rank; its other grown parts are named as "also"

    def window_growth(ranks: Iterable[int]) -> float:
        return median(current[r].breakdown.step_ms - reference[r].breakdown.step_ms for r in ranks)

    named = (
        [verdict.culprit_rank]
        if verdict.culprit_rank is not None
        else [r for r in current if r not in culprits]
    )
    if window_growth(culprits) - window_growth(named) >= GLOBAL_SHARE * base.slowdown_ms:
        return work
    return verdict
