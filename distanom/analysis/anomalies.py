"""A verdict for every anomalous step, traced or not, from the evidence each rank sent.

Reads the anomaly records rank 0 wrote (`records.anomalies`) and, for steps that were
captured, the trace-based verdict the report computed; returns one `Anomaly` per step.
Pure (no torch, no files). Rules, in order (slowdown = step time - median):

1. A captured step keeps its trace verdict (`source: "trace"`); the evidence verdict
   goes into its details. When the trace explains nothing (`unknown`: e.g. the step
   was traced from its middle, right after tracing was switched on) and the evidence
   names a cause, the evidence verdict stands, the trace's in its details.
2. Collective arrival (`source: "arrival"`): each rank's arrival at the step's last
   collective against its own recent median. The rank whose arrival grew most is the
   culprit when that growth is at least `CULPRIT_SHARE` of the slowdown. Its cause is
   the host signal that explains the lateness: a GC pause of at least `GC_SHARE` of the
   slowdown (`python_gc`); training-thread CPU time that grew by at least
   `CPU_SHARE` of the lateness (`host_busy`: the thread was computing); otherwise
   `host_stall` (late, off the CPU: sleeping, I/O, a lock, waiting on the device).
   No rank late, but one rank's step longer than every other's by `CULPRIT_SHARE` of
   the slowdown: its time went after the collective (arrivals are timed from each
   rank's own step start), so it is the culprit with the same causes, unless the step
   before was anomalous and another rank's step ended that much late there: this rank
   waited inside the collective for that one, the culprit, with its late step's cause.
   No rank late and none apart: `slow_collective` (the time went inside the collective
   or after it, on every rank alike). Several ranks late by about as much
   (grown by at least `TOGETHER_SHARE` of the latest one's growth, and by at least
   `CULPRIT_SHARE` of the slowdown): no culprit, the time went before the collective on
   each of them; the cause is the strongest host signal among them (GC, then busy,
   then stall).
3. Without arrival (no collectives recorded): the rank with the longest duration, if it
   leads the next by `CULPRIT_SHARE` of the slowdown (`source: "durations"`); otherwise
   `unknown`. Its cause: `gpu_work` when its step took longer on its GPU clock than on
   its host by at least `DEVICE_SHARE` of the slowdown (the host was not held up: the
   device's work grew; with the host clock the two are the same time and this never
   holds); else the same host causes.

A captured anomaly with no record (a run from before anomalies.jsonl existed) is listed
from its capture, `judged_by: "unrecorded"`.

The phase of each verdict, and the more specific cause it may give (`with_phase`):
`analysis.phases`. The anomalies per class: `analysis.anomaly_classes`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from distanom.analysis.phases import PHASE_CAUSES, PhaseTable, find_phase
from distanom.analysis.text import culprit_words
from distanom.records.anomalies import AnomalyRecord, StepEvidence

CULPRIT_SHARE = 0.5
GC_SHARE = 0.25
CPU_SHARE = 0.5
DEVICE_SHARE = 0.5
# ranks whose lateness is at least this share of the latest one's are late together
TOGETHER_SHARE = 0.8
# which host cause names ranks late together: the most specific signal first
CAUSE_STRENGTH = {"python_gc": 0, "host_busy": 1, "host_stall": 2}


@dataclass(frozen=True)
class AnomalyVerdict:
    """Who made an anomalous step slow, why, and the sentence that says so."""

    culprit_rank: int | None
    cause: str
    evidence: str
    source: str  # "trace", "arrival", "durations" or "none"
    details: dict[str, Any] = field(default_factory=dict)
    phase: str | None = None  # data, forward, backward, optimizer; None: not known
    # the culprit's phases_ms / median_phases_ms (and gpu_ and fetch_ ones) at the step
    phase_facts: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "culprit_rank": self.culprit_rank,
            "cause": self.cause,
            "phase": self.phase,
            "evidence": self.evidence,
            "source": self.source,
            "details": self.details,
            **self.phase_facts,
        }


@dataclass(frozen=True)
class Anomaly:
    """One step the detector judged anomalous, with its verdict."""

    step: int
    step_ms: float
    median_ms: float
    ratio: float
    traced: bool
    judged_by: str
    verdict: AnomalyVerdict

    def as_json(self) -> dict[str, Any]:
        """The report's JSON entry."""
        return {
            "step": self.step,
            "step_ms": _round(self.step_ms),
            "median_ms": _round(self.median_ms),
            "ratio": _round(self.ratio),
            "traced": self.traced,
            "judged_by": self.judged_by,
            "verdict": self.verdict.as_json(),
        }


@dataclass(frozen=True)
class TraceVerdict:
    """What the report's trace-based verdict of a captured step says."""

    culprit_rank: int | None
    cause: str
    evidence: str
    # how much of the step the trace found on its culprit (its own extra time, or the
    # wait it caused at a collective), ms; NaN: not said
    explained_ms: float = math.nan


@dataclass(frozen=True)
class CapturedAnomaly:
    """A step captured as an anomaly, as the capture index tells it."""

    step: int
    step_ms: float
    median_ms: float


def anomalies_of(
    records: Sequence[AnomalyRecord],
    traced: Mapping[int, TraceVerdict] | None = None,
    captured: Sequence[CapturedAnomaly] = (),
    phases: Mapping[int, PhaseTable] | None = None,
) -> list[Anomaly]:
    """Every recorded (or captured) anomalous step with its verdict, in step order;
    `phases`: each rank's step phases (`analysis.phases`), which name the phase of a
    verdict and where they explain the slowdown, a more specific cause."""
    traced = traced or {}
    phases = phases or {}
    out = []
    recorded = {record.step for record in records}
    for capture in captured:
        trace = traced.get(capture.step)
        if capture.step in recorded or trace is None:
            continue
        ratio = capture.step_ms / capture.median_ms if capture.median_ms > 0 else math.nan
        verdict = AnomalyVerdict(trace.culprit_rank, trace.cause, trace.evidence, "trace")
        out.append(
            Anomaly(
                capture.step, capture.step_ms, capture.median_ms, ratio, True, "unrecorded", verdict
            )
        )
    by_step = {record.step: record for record in records}
    for record in records:
        verdict = with_phase(judge(record, by_step.get(record.step - 1)), record, phases)
        trace = traced.get(record.step)
        if trace is not None and (
            (trace.cause == "unknown" and verdict.cause != "unknown")
            or _more_specific(verdict, trace)
            or _outweighs(verdict, trace, record)
        ):
            trace_json = {
                "culprit_rank": trace.culprit_rank,
                "cause": trace.cause,
                "evidence": trace.evidence,
            }
            details = {**verdict.details, "trace_verdict": trace_json}
            verdict = replace(verdict, details=details)
        elif trace is not None:
            kept: dict[str, Any] = {"evidence_verdict": verdict.as_json()}
            if trace.culprit_rank == verdict.culprit_rank:  # a knock-on stays linked
                for key in ("knock_on_of", "waited_for_step"):
                    if key in verdict.details:
                        kept[key] = verdict.details[key]
            traced_verdict = AnomalyVerdict(
                trace.culprit_rank, trace.cause, trace.evidence, "trace", kept
            )
            verdict = with_phase(traced_verdict, record, phases, words=False)
        out.append(
            Anomaly(
                record.step,
                record.step_ms,
                record.median_ms,
                record.ratio,
                record.traced or trace is not None,
                record.judged_by,
                verdict,
            )
        )
    return sorted(out, key=lambda a: a.step)


def evidence_notes(anomalies: Sequence[Anomaly]) -> dict[int, str]:
    """Per captured step, what its section says of the step's evidence verdict, below
    the trace's: that it stands, where the trace named no cause (rule 1: the anomalies
    list shows it); or that it points elsewhere, where it blames another rank (or one
    rank where the trace blames none, or none where it blames one): the trace's stands,
    and the reader sees both rather than one hidden in --json. Another cause for the same
    rank is not said: the trace, which sees the ops, names it more closely."""
    notes = {}
    for anomaly in anomalies:
        verdict = anomaly.verdict
        if "trace_verdict" in verdict.details:
            notes[anomaly.step] = (
                "the trace names no cause; the step's evidence does (as in the anomalies "
                f"list): {culprit_words(verdict.culprit_rank, verdict.cause)}"
            )
            continue
        other = verdict.details.get("evidence_verdict")
        if not isinstance(other, dict) or other.get("cause") in (None, "unknown"):
            continue
        rank, cause = other.get("culprit_rank"), str(other.get("cause"))
        if rank != verdict.culprit_rank:
            notes[anomaly.step] = (
                "the step's evidence (arrival, host signals) points elsewhere: "
                f"{culprit_words(rank, cause)}; the trace's verdict stands"
            )
    return notes


def _more_specific(verdict: AnomalyVerdict, trace: TraceVerdict) -> bool:
    """Whether the step's evidence names its cause more closely than its trace, for the
    same culprit (or one where the trace has none): a GC pause or a batch fetch over
    their share, an op that grew while its thread was off the CPU (`host_stall` over the
    trace's `compute`), device work the host waited for (`gpu_work` over a host cause)."""
    if verdict.culprit_rank is None or trace.culprit_rank not in (None, verdict.culprit_rank):
        return False
    if verdict.cause in ("python_gc", "data_loading"):
        return trace.cause != verdict.cause
    if verdict.cause == "host_stall":
        return trace.cause == "compute"
    if verdict.cause == "gpu_work":
        return trace.cause in ("host_stall", "host_busy")
    return False


def _outweighs(verdict: AnomalyVerdict, trace: TraceVerdict, record: AnomalyRecord) -> bool:
    """Whether the evidence's culprit stands over another rank the trace blames for a
    small part of the step: the evidence names its culprit only for `CULPRIT_SHARE` of
    the slowdown or more, and the trace's culprit accounts for less than that (e.g.
    arrived last at a collective by 10 ms of a 400 ms step, while another rank slept
    after the collective, where a trace shows only idle time)."""
    if verdict.culprit_rank is None or trace.culprit_rank == verdict.culprit_rank:
        return False
    slowdown = record.step_ms - record.median_ms if record.median_ms > 0 else record.step_ms
    return math.isfinite(trace.explained_ms) and trace.explained_ms < CULPRIT_SHARE * slowdown


def with_phase(
    verdict: AnomalyVerdict,
    record: AnomalyRecord,
    tables: Mapping[int, PhaseTable],
    *,
    words: bool = True,
) -> AnomalyVerdict:
    """The verdict with its culprit's phase (`analysis.phases.find_phase`) at the step
    (at the step it waited for, for a knock-on verdict), and the more specific cause
    the phases give; `words`: also say it in the evidence sentence."""
    rank = verdict.culprit_rank
    table = tables.get(rank) if rank is not None else None
    if table is None or (words and verdict.cause not in PHASE_CAUSES):
        return verdict
    waited = verdict.details.get("waited_for_step")
    step = waited if isinstance(waited, int) else record.step
    now, usual = table.row(step), table.usual(step)
    if now is None or usual is None:
        return verdict
    slowdown = record.step_ms - record.median_ms if record.median_ms > 0 else record.step_ms
    found = find_phase(verdict.cause, now, usual, max(slowdown, 1e-9))
    if found is None:
        return verdict
    evidence, details = verdict.evidence, verdict.details
    if words and found.cause:
        # the host signals' reading (the sentence's last clause) gives way to the phase's
        head = evidence if waited is not None else evidence.rsplit("; ", 1)[0]
        evidence = f"{head}; {found.words}"
        if found.cause != verdict.cause:
            details = {**details, "host_signals_cause": verdict.cause}
    elif words and found.words:
        evidence = f"{evidence}; {found.words}"
    return replace(
        verdict,
        cause=found.cause if words and found.cause else verdict.cause,
        evidence=evidence,
        details=details,
        phase=found.phase,
        phase_facts=found.facts,
    )


def judge(record: AnomalyRecord, previous: AnomalyRecord | None = None) -> AnomalyVerdict:
    """The evidence verdict of one anomalous step (rules 2 and 3 of the module docstring;
    `previous`: the record of the step before, when that step was anomalous too)."""
    slowdown = record.step_ms - record.median_ms if record.median_ms > 0 else record.step_ms
    slowdown = max(slowdown, 1e-9)
    evidence = list(record.evidence)
    arrivals = {r: e.arrive_ms for r, e in enumerate(evidence) if math.isfinite(e.arrive_ms)}
    if len(arrivals) >= 2:
        return _by_arrival(record, evidence, arrivals, slowdown, previous)
    return _by_durations(record, evidence, slowdown)


def _by_arrival(
    record: AnomalyRecord,
    evidence: list[StepEvidence],
    arrivals: dict[int, float],
    slowdown: float,
    previous: AnomalyRecord | None,
) -> AnomalyVerdict:
    medians = record.arrive_median_ms
    first = min(arrivals.values())

    def growth(rank: int) -> float:
        usual = medians[rank] if rank < len(medians) else math.nan
        return arrivals[rank] - (usual if math.isfinite(usual) else first)

    grown = {rank: growth(rank) for rank in arrivals}
    culprit = max(grown, key=lambda r: (grown[r], -r))
    late_ms = arrivals[culprit] - first
    details: dict[str, Any] = {
        "arrive_ms": {str(r): _round(a) for r, a in sorted(arrivals.items())},
        "late_ms": _round(late_ms),
        "slowdown_ms": _round(slowdown),
    }
    if grown[culprit] < CULPRIT_SHARE * slowdown:
        spread = max(arrivals.values()) - first
        after = _after_collective(record, evidence, spread, slowdown, details, previous)
        if after is not None:
            return after
        return AnomalyVerdict(
            None,
            "slow_collective",
            f"every rank reached the step's last collective within {spread:.1f} ms of the "
            f"first; the {slowdown:.1f} ms went inside or after it on all ranks",
            "arrival",
            details,
        )
    # as late as the culprit, give or take a fifth: no one of them is the culprit
    floor = max(CULPRIT_SHARE * slowdown, TOGETHER_SHARE * grown[culprit])
    late = sorted(r for r in grown if grown[r] >= floor)
    if len(late) > 1:
        return _late_together(record, evidence, late, grown, slowdown, details)
    cause, why = _host_cause(record, evidence, culprit, grown[culprit], slowdown)
    text = (
        f"rank {culprit} reached the step's last collective {late_ms:.1f} ms after the first "
        f"rank ({grown[culprit]:.1f} ms later than usual; the step was {slowdown:.1f} ms "
        f"slow); {why}"
    )
    return AnomalyVerdict(culprit, cause, text, "arrival", details)


def _after_collective(
    record: AnomalyRecord,
    evidence: list[StepEvidence],
    spread: float,
    slowdown: float,
    details: dict[str, Any],
    previous: AnomalyRecord | None,
) -> AnomalyVerdict | None:
    """Every rank reached the last collective on time, yet one rank's step took longer
    than every other's by `CULPRIT_SHARE` of the slowdown: its time went after the
    collective (arrivals are measured from each rank's own step start). Either that rank
    worked or waited after it (e.g. between backward and the optimizer step): the culprit;
    or it waited inside it for a rank that began the step late, whose step before ended
    late by as much (`previous`): that rank is the culprit, with the cause of its late
    step. None when no one rank's step stands out (the collective itself was slow)."""
    excess = _excess(record)
    if len(excess) < 2:
        return None
    slowest = max(excess, key=lambda r: (excess[r], -r))
    lead = excess[slowest] - max(v for r, v in excess.items() if r != slowest)
    if lead < CULPRIT_SHARE * slowdown:
        return _knock_on(record, excess, slowdown, details, previous)
    details = {**details, "durations_ms": _durations_json(record)}
    before = _excess(previous) if previous is not None else {}
    starters = [
        r
        for r in before
        if r != slowest and before[r] - before.get(slowest, 0.0) >= CULPRIT_SHARE * lead
    ]
    if previous is not None and starters:
        starter = max(starters, key=lambda r: (before[r], -r))
        earlier = judge(previous)
        if earlier.culprit_rank == starter:
            cause, why = earlier.cause, f"step {previous.step}: {earlier.cause.replace('_', ' ')}"
        else:  # that step's verdict blames another rank: say so, do not borrow its cause
            who = culprit_words(earlier.culprit_rank, earlier.cause)
            cause, why = "host_stall", f"after that step's collective; step {previous.step}: {who}"
        return AnomalyVerdict(
            starter,
            cause,
            f"rank {slowest} took {lead:.1f} ms longer than the others after reaching the "
            f"step's last collective on time: it waited there for rank {starter}, whose "
            f"step {previous.step} ended {before[starter]:.1f} ms late "
            f"({why})",
            "arrival",
            {**details, "waited_for_step": previous.step, "knock_on_of": previous.step},
        )
    cause, why = _device_cause(record, evidence, slowest, slowdown) or _host_cause(
        record, evidence, slowest, lead, slowdown
    )
    return AnomalyVerdict(
        slowest,
        cause,
        f"every rank reached the step's last collective within {spread:.1f} ms of the "
        f"first; then rank {slowest}'s step took {lead:.1f} ms longer than the others' "
        f"(after the collective, e.g. between backward and the optimizer step); {why}",
        "arrival",
        details,
    )


def _knock_on(
    record: AnomalyRecord,
    excess: dict[int, float],
    slowdown: float,
    details: dict[str, Any],
    previous: AnomalyRecord | None,
) -> AnomalyVerdict | None:
    """Every rank reached the last collective on time and no one rank's step stands out
    as longer, but the others' steps were long and one rank's was not: they waited in
    the collective for that rank, which began the step late because its step before
    (anomalous too) ended late; its verdict there names it. On any number of ranks (with
    two, `_after_collective`'s own rule sees it). None otherwise."""
    if previous is None:
        return None
    earlier = judge(previous)
    culprit = earlier.culprit_rank
    if culprit is None or culprit not in excess:
        return None
    others = [value for rank, value in excess.items() if rank != culprit]
    waited = min(others)
    if waited < CULPRIT_SHARE * slowdown or excess[culprit] > CULPRIT_SHARE * waited:
        return None
    who = "every other rank" if len(others) == len(record.durations_ms) - 1 else "the others"
    return AnomalyVerdict(
        culprit,
        earlier.cause,
        f"every rank reached the step's last collective on time, then {who} waited in it "
        f"at least {waited:.1f} ms for rank {culprit}, which began the step late: its "
        f"step {previous.step} ran long (step {previous.step}: "
        f"{earlier.cause.replace('_', ' ')})",
        "arrival",
        {
            **details,
            "durations_ms": _durations_json(record),
            "waited_for_step": previous.step,
            "knock_on_of": previous.step,
        },
    )


def _excess(record: AnomalyRecord) -> dict[int, float]:
    """Per rank with a known duration: its step time over the median."""
    return {
        rank: duration - record.median_ms
        for rank, duration in enumerate(record.durations_ms)
        if math.isfinite(duration)
    }


def _durations_json(record: AnomalyRecord) -> dict[str, float | None]:
    return {str(r): _round(t) for r, t in enumerate(record.durations_ms) if math.isfinite(t)}


def _late_together(
    record: AnomalyRecord,
    evidence: list[StepEvidence],
    late: list[int],
    grown: dict[int, float],
    slowdown: float,
    details: dict[str, Any],
) -> AnomalyVerdict:
    """Several ranks (maybe all) reached the last collective about equally later than
    usual: the time went before it on each of them, so no one rank is the culprit. The
    cause is the strongest host signal among them (a GC pause, then a busy host, over
    `host_stall`, which only says a rank was late and off the CPU), the lowest such rank
    named: ranks that waited on one rank's GC pause earlier in the step show only that."""
    causes = {rank: _host_cause(record, evidence, rank, grown[rank], slowdown) for rank in late}
    first = min(late, key=lambda rank: (CAUSE_STRENGTH.get(causes[rank][0], 9), rank))
    cause = causes[first][0]
    ranks = len(record.evidence)
    who = "every rank" if len(late) == ranks else "ranks " + _rank_list(late)
    least = min(grown[rank] for rank in late)
    text = (
        f"{who} reached the step's last collective at least {least:.1f} ms later than usual, "
        f"about equally (the step was {slowdown:.1f} ms slow): the time went before it on "
        f"each; on rank {first}, {causes[first][1]}"
    )
    return AnomalyVerdict(None, cause, text, "arrival", {**details, "late_ranks": late})


def _rank_list(ranks: list[int]) -> str:
    shown = ", ".join(str(rank) for rank in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _by_durations(
    record: AnomalyRecord, evidence: list[StepEvidence], slowdown: float
) -> AnomalyVerdict:
    times = sorted(
        ((t, r) for r, t in enumerate(record.durations_ms) if math.isfinite(t)), reverse=True
    )
    if not times:
        return AnomalyVerdict(None, "unknown", "no rank's evidence was recorded", "none")
    # with one rank timed there is no next rank: its lead is the step's slowdown
    lead = times[0][0] - times[1][0] if len(times) > 1 else slowdown
    than = "the next rank's" if len(times) > 1 else "the median"
    if len(times) == 1 and len(record.durations_ms) > 1:
        than += " (no other rank's time recorded)"
    culprit = times[0][1]
    details = {"durations_ms": {str(r): _round(t) for t, r in sorted(times, key=lambda x: x[1])}}
    if lead < CULPRIT_SHARE * slowdown:
        return AnomalyVerdict(
            None,
            "unknown",
            "no collective arrival was recorded and every rank's step was as slow",
            "none",
            details,
        )
    cause, why = _device_cause(record, evidence, culprit, slowdown) or _host_cause(
        record, evidence, culprit, lead, slowdown
    )
    text = f"rank {culprit}'s step took {lead:.1f} ms longer than {than}; {why}"
    return AnomalyVerdict(culprit, cause, text, "durations", details)


def _device_cause(
    record: AnomalyRecord, evidence: list[StepEvidence], rank: int, slowdown: float
) -> tuple[str, str] | None:
    """`gpu_work` when the rank's step outlasted its host's step by `DEVICE_SHARE` of
    the slowdown: the step's time (CUDA events) grew on the device while the training
    thread went on. Without a GPU clock, with the host just as late, or with a GC pause
    that explains it (with the host clock the two readings are a GC apart at most), None."""
    step_ms = record.durations_ms[rank] if rank < len(record.durations_ms) else math.nan
    mine = evidence[rank] if rank < len(evidence) else StepEvidence()
    host_ms = mine.host_ms
    if not (math.isfinite(step_ms) and math.isfinite(host_ms)) or host_ms <= 0:
        return None  # unknown, or a wall clock stepped back
    if math.isfinite(mine.gc_ms) and mine.gc_ms >= GC_SHARE * slowdown:
        return None
    if step_ms - host_ms < DEVICE_SHARE * slowdown:
        return None
    return "gpu_work", (
        f"its GPU took {step_ms:.1f} ms for the step while its host went through it in "
        f"{host_ms:.1f} ms: the device's work grew (a traced occurrence names the kernels)"
    )


def _host_cause(
    record: AnomalyRecord,
    evidence: list[StepEvidence],
    rank: int,
    late_ms: float,
    slowdown: float,
) -> tuple[str, str]:
    mine = evidence[rank] if rank < len(evidence) else StepEvidence()
    if math.isfinite(mine.gc_ms) and mine.gc_ms >= GC_SHARE * slowdown:
        return "python_gc", f"a Python GC pause of {mine.gc_ms:.1f} ms on rank {rank}"
    medians = record.cpu_median_ms
    usual = medians[rank] if rank < len(medians) else math.nan
    if math.isfinite(mine.cpu_ms) and math.isfinite(usual):
        grew = mine.cpu_ms - usual
        if grew >= CPU_SHARE * late_ms:
            return "host_busy", (
                f"its training thread used {grew:.1f} ms more CPU than usual (busy on the host)"
            )
        return "host_stall", (
            f"its training thread used {mine.cpu_ms:.1f} ms of CPU (usually {usual:.1f}): it "
            "was off the CPU (sleeping, I/O, a lock, or waiting on the device)"
        )
    if math.isfinite(mine.arrive_ms):  # late at the collective: the host, cause unseen
        return "host_stall", "its training thread's CPU time is unknown"
    return "unknown", "its training thread's CPU time is unknown"


def _round(value: float, digits: int = 3) -> float | None:
    return round(value, digits) if math.isfinite(value) else None
