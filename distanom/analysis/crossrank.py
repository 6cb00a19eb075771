"""Cross-rank analysis of a run's captures: verdict, kernel diff and merged trace.

Owns: reading each rank's trace of a capture once for what the cross-rank analyses need
(`RankFacts`: its collectives, its op table, its step window, its time base), choosing
each capture's reference step, and putting these keys into the report's capture dicts:

- `verdict`: `distanom.analysis.verdict.decide` over the ranks' breakdowns (from the
  report's per-rank tables), the reference step's, and the matched collectives;
- `kernel_diff`: every rank's ops against the same rank in the reference step;
- `merged_trace`: `captures/step_<N>/merged.trace.json.gz` (relative to the run
  directory), written atomically and only when older than one of the rank traces;
- `unreadable_ranks`: the ranks whose trace could not be read;

and `outside_ms` into a rank's entry when its step window is known (CPU-only traces):
the part of the window outside its ops' span, which the verdict counts as idle.

Reads: the run directory (`RunData`) and the capture dicts built by the report, which
hold each rank's `gpu_timeline` / `host_timeline`. Damage (an unreadable trace, a
read-only run directory) goes to `RunData.problems`; the rest of the analysis goes on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distanom.analysis.collectives import (
    CollectiveCall,
    MatchResult,
    collective_calls,
    match_collectives,
)
from distanom.analysis.engine import tables_from_trace
from distanom.analysis.kernel_diff import (
    OpKey,
    OpKind,
    OpStats,
    diff_ops,
    op_table,
    pick_reference,
    reference_steps,
)
from distanom.analysis.merge import MERGED_NAME, MergeWriter, estimate_offsets
from distanom.analysis.run import RunData
from distanom.analysis.tables_io import BREAKDOWN_ROWS
from distanom.analysis.trace_io import read_trace_document, trace_from_document
from distanom.analysis.verdict import Breakdown, RankEvidence, Verdict, decide, note_python_gc
from distanom.errors import DistanomError
from distanom.rundir import write_bytes_atomic

__all__ = [
    "RankFacts",
    "add_cross_rank",
    "breakdown",
    "evidence_from_document",
    "outside_ms",
    "rank_facts",
    "verdict_line",
    "verdict_of_documents",
]

_STEP_SPAN = re.compile(r"distanom step (\d+)")


def breakdown(entry: Mapping[str, Any]) -> dict[str, float] | None:
    """A rank's computation / exposed comm / exposed memcpy / idle / total in ms."""
    timeline = entry.get("gpu_timeline") or entry.get("host_timeline")
    if not timeline:
        return None
    return {row: float(timeline[row]["time_ms"]) for row in BREAKDOWN_ROWS}


def outside_ms(entry: Mapping[str, Any]) -> float | None:
    """A rank's step time outside its ops' span (ms), when its step window is known."""
    value = entry.get("outside_ms")
    return float(value) if isinstance(value, (int, float)) else None


@dataclass(frozen=True)
class RankFacts:
    """What the cross-rank analyses need from one rank's trace of one step."""

    rank: int
    calls: list[CollectiveCall]
    ops_kind: OpKind
    ops: dict[OpKey, OpStats]
    window_ms: float | None
    """Duration of the `distanom step N` span: the rank's step on the host."""
    base_time_ns: int | None


def rank_facts(rank: int, document: Mapping[str, Any]) -> RankFacts:
    """The facts of one parsed trace document."""
    events = [e for e in document.get("traceEvents") or [] if isinstance(e, dict)]
    _, calls = collective_calls(events)
    ops_kind, ops = op_table(events)
    window = None
    for event in events:
        if event.get("cat") == "user_annotation" and _STEP_SPAN.fullmatch(str(event.get("name"))):
            dur = event.get("dur")
            if isinstance(dur, (int, float)) and not isinstance(dur, bool):
                window = float(dur) / 1000
            break
    base = document.get("baseTimeNanoseconds")
    return RankFacts(
        rank,
        calls,
        ops_kind,
        ops,
        window,
        base if isinstance(base, int) and not isinstance(base, bool) else None,
    )


class _Facts:
    """Facts per (step, rank), each trace read at most once per report."""

    def __init__(self, data: RunData) -> None:
        self.data = data
        self._cache: dict[int, dict[int, RankFacts]] = {}

    def of(self, capture: Mapping[str, Any]) -> dict[int, RankFacts]:
        step = int(capture["step"])
        if step not in self._cache:
            facts: dict[int, RankFacts] = {}
            for key, entry in capture["ranks"].items():
                try:
                    document = read_trace_document(self.data.run.path / entry["trace"])
                    facts[int(key)] = rank_facts(int(key), document)
                except DistanomError as err:
                    if breakdown(entry) is not None:  # else the tables reported it already
                        self.data.problems.append(f"step {step} rank {key}: {err}")
            self._cache[step] = facts
        return self._cache[step]


def _outside(rows: Mapping[str, float], kind: str, facts: RankFacts | None) -> float | None:
    if kind == "cpu" and facts is not None and facts.window_ms is not None:
        # host spans only cover the ops: a stall before the first op is outside them
        return max(0.0, facts.window_ms - rows["total_time"])
    return None


def _rank_evidence(
    rank: int, host: str | None, rows: Mapping[str, float], kind: str, facts: RankFacts | None
) -> RankEvidence:
    outside = _outside(rows, kind, facts)
    return RankEvidence(rank, host, Breakdown.from_rows(rows, outside or 0.0))


def _evidence(capture: Mapping[str, Any], facts: Mapping[int, RankFacts]) -> list[RankEvidence]:
    out = []
    for key, entry in capture["ranks"].items():
        rows = breakdown(entry)
        if rows is not None:
            kind = str(entry.get("timeline_kind", "gpu"))
            out.append(_rank_evidence(int(key), entry.get("host"), rows, kind, facts.get(int(key))))
    return out


def evidence_from_document(
    rank: int, host: str | None, document: Mapping[str, Any]
) -> tuple[RankEvidence, RankFacts]:
    """One rank's evidence and facts straight from its parsed trace (built-in tables)."""
    facts = rank_facts(rank, document)
    tables = tables_from_trace(trace_from_document(document, f"rank {rank}"))
    rows = {row: tables.timeline.ms(row) for row in BREAKDOWN_ROWS}
    return _rank_evidence(rank, host, rows, tables.kind, facts), facts


def verdict_of_documents(
    documents: Mapping[int, Mapping[str, Any]],
    hosts: Mapping[int, str | None],
    *,
    reference: Mapping[int, Mapping[str, Any]] | None = None,
    reference_step: int | None = None,
    step_ms: float | None = None,
    expected_ms: float | None = None,
) -> Verdict:
    """The verdict on one step given every rank's parsed trace (and the reference's),
    as the report reaches it from a run directory."""
    pairs = {r: evidence_from_document(r, hosts.get(r), d) for r, d in documents.items()}
    ref_pairs = {
        r: evidence_from_document(r, hosts.get(r), d) for r, d in (reference or {}).items()
    }
    match = match_collectives({r: facts.calls for r, (_, facts) in pairs.items()})
    return decide(
        [e for e, _ in pairs.values()],
        reference=[e for e, _ in ref_pairs.values()],
        reference_step=reference_step,
        collectives=match.matched,
        step_ms=step_ms,
        expected_ms=expected_ms,
    )


def _kernel_diff(
    capture: Mapping[str, Any],
    facts: Mapping[int, RankFacts],
    reference_step: int | None,
    ref_facts: Mapping[int, RankFacts],
    evidence: Sequence[RankEvidence],
    ref_evidence: Sequence[RankEvidence],
) -> dict[str, Any]:
    if reference_step is None:
        note = (
            "this is the reference step"
            if "reference" in capture["kinds"]
            else "no reference step captured in this run"
        )
        return {"reference_step": None, "note": note, "ranks": {}}
    stalled = {e.rank: e.breakdown.stalled_ms for e in evidence}
    ref_stalled = {e.rank: e.breakdown.stalled_ms for e in ref_evidence}
    ranks: dict[str, Any] = {}
    for rank in sorted(set(facts) & set(ref_facts)):
        mine, theirs = facts[rank], ref_facts[rank]
        if mine.ops_kind != theirs.ops_kind:
            continue  # kernels cannot be diffed against CPU ops
        idle = (
            stalled[rank] - ref_stalled[rank] if rank in stalled and rank in ref_stalled else None
        )
        ranks[str(rank)] = diff_ops(rank, mine.ops_kind, mine.ops, theirs.ops, idle).as_json()
    return {"reference_step": reference_step, "ranks": ranks}


def _merged_trace(
    data: RunData,
    capture: Mapping[str, Any],
    facts: Mapping[int, RankFacts],
    match: MatchResult,
) -> str | None:
    step = int(capture["step"])
    if not facts:
        return None
    path = data.run.capture_dir(step) / MERGED_NAME
    traces = [data.run.path / capture["ranks"][str(r)]["trace"] for r in facts]
    try:
        if path.exists() and path.stat().st_mtime >= max(t.stat().st_mtime for t in traces):
            return data.run.relative(path)  # up to date: written by an earlier report
    except OSError:
        pass
    hosts = {r: capture["ranks"][str(r)].get("host") for r in facts}
    alignment = estimate_offsets(
        list(facts), hosts, {r: f.base_time_ns for r, f in facts.items()}, match.matched
    )
    writer = MergeWriter()
    try:
        for rank, trace in zip(facts, traces, strict=True):
            events = read_trace_document(trace).get("traceEvents") or []
            writer.add_rank(rank, hosts[rank], events, alignment.offsets_us[rank])
    except DistanomError as err:
        data.problems.append(f"step {step}: merged trace not written: {err}")
        return None
    metadata = {
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": facts[alignment.reference_rank].base_time_ns,
        "distanom": {
            "merged": True,
            "step": step,
            "ranks": {str(r): v for r, v in sorted(writer.ranks.items())},
            "clock_alignment": alignment.as_json(),
            "unmatched_collectives": match.unmatched,
        },
    }
    try:
        write_bytes_atomic(path, writer.finish(metadata))
    except OSError as err:
        data.problems.append(f"step {step}: merged trace not written: {err.strerror or err}")
        return None
    return data.run.relative(path)


def _verdict(
    capture: Mapping[str, Any],
    evidence: Sequence[RankEvidence],
    ref_evidence: Sequence[RankEvidence],
    reference_step: int | None,
    match: MatchResult,
) -> Verdict:
    return decide(
        evidence,
        reference=ref_evidence,
        reference_step=reference_step,
        collectives=match.matched,
        step_ms=capture.get("step_ms"),
        expected_ms=capture.get("median_ms"),
    )


def add_cross_rank(data: RunData, captures: list[dict[str, Any]]) -> None:
    """Add `verdict`, `kernel_diff` and `merged_trace` to every capture dict."""
    facts = _Facts(data)
    by_step = {int(c["step"]): c for c in captures}
    references = reference_steps(captures)
    for capture in captures:
        step = int(capture["step"])
        mine = facts.of(capture)
        reference_step = pick_reference(step, references)
        reference = by_step.get(reference_step) if reference_step is not None else None
        ref_facts = facts.of(reference) if reference is not None else {}
        evidence = _evidence(capture, mine)
        ref_evidence = _evidence(reference, ref_facts) if reference is not None else []
        match = match_collectives({r: f.calls for r, f in mine.items()})
        verdict = _verdict(capture, evidence, ref_evidence, reference_step, match)
        verdict = note_python_gc(verdict, capture.get("python_gc") or {})
        capture["verdict"] = verdict.as_json()
        capture["kernel_diff"] = _kernel_diff(
            capture, mine, reference_step, ref_facts, evidence, ref_evidence
        )
        capture["merged_trace"] = _merged_trace(data, capture, mine, match)
        _mark_ranks(capture, mine)


def _mark_ranks(capture: dict[str, Any], facts: Mapping[int, RankFacts]) -> None:
    """What the report's tables show beside the breakdown, so they tell the verdict's
    story: each rank's time outside its ops, and which ranks' traces were unreadable."""
    capture["unreadable_ranks"] = sorted(
        int(key) for key in capture["ranks"] if int(key) not in facts
    )
    for key, entry in capture["ranks"].items():
        rows = breakdown(entry)
        if rows is None:
            continue
        outside = _outside(rows, str(entry.get("timeline_kind", "gpu")), facts.get(int(key)))
        if outside is not None:
            entry["outside_ms"] = round(outside, 4)


def verdict_line(capture: Mapping[str, Any]) -> str | None:
    """The capture's verdict as one line of text, or None when it has none."""
    body = capture.get("verdict")
    if not body:
        return None
    verdict = Verdict(
        body.get("culprit_rank"),
        body.get("culprit_node"),
        body.get("cause", "unknown"),
        str(body.get("evidence", "")),
        body.get("details") or {},
    )
    return verdict.sentence()
