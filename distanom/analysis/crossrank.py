"""Cross-rank analysis of one capture: facts per rank, verdict, kernel diff, merged trace.

Owns: what the cross-rank analyses need from one rank's parsed trace document
(`RankFacts`: its collectives, its op table, its step window, its time base), the
evidence the verdict reasons over (each rank's breakdown from its table, with the time
outside its ops on CPU-only traces), the kernel diff against the reference step, and
the merged trace's bytes. Pure: documents and tables come in parsed by
`distanom.analysis.build`, nothing is read or written here.
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
from distanom.analysis.evidence import Breakdown, RankEvidence, Verdict
from distanom.analysis.kernel_diff import OpKey, OpKind, OpStats, diff_ops, op_table
from distanom.analysis.merge import MergeWriter, estimate_offsets
from distanom.analysis.model import BREAKDOWN_ROWS, KernelDiff, RankEntry
from distanom.analysis.trace_io import trace_from_document
from distanom.analysis.verdict import decide

__all__ = [
    "RankFacts",
    "evidence",
    "evidence_from_document",
    "kernel_diff",
    "merged_content",
    "outside_ms",
    "rank_facts",
    "verdict",
    "verdict_of_documents",
]

_STEP_SPAN = re.compile(r"distanom step (\d+)")


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


def outside_ms(
    rows: Mapping[str, float], kind: str | None, facts: RankFacts | None
) -> float | None:
    """A CPU-only rank's step window outside its ops' span (ms), when the window is known."""
    if kind == "cpu" and facts is not None and facts.window_ms is not None:
        # host spans only cover the ops: a stall before the first op is outside them
        return max(0.0, facts.window_ms - rows["total_time"])
    return None


def _rank_evidence(
    rank: int, host: str | None, rows: Mapping[str, float], kind: str, facts: RankFacts | None
) -> RankEvidence:
    outside = outside_ms(rows, kind, facts)
    return RankEvidence(rank, host, Breakdown.from_rows(rows, outside or 0.0))


def evidence(ranks: Mapping[int, RankEntry], facts: Mapping[int, RankFacts]) -> list[RankEvidence]:
    """The verdict's evidence of every rank with a table, in rank order."""
    out = []
    for rank, entry in ranks.items():
        rows = entry.breakdown()
        if rows is not None:
            kind = entry.timeline_kind or "gpu"
            out.append(_rank_evidence(rank, entry.host, rows, kind, facts.get(rank)))
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


def verdict(
    found: Sequence[RankEvidence],
    ref_found: Sequence[RankEvidence],
    reference_step: int | None,
    match: MatchResult,
    step_ms: float | None,
    expected_ms: float | None,
) -> Verdict:
    """The verdict on one capture from its evidence, the reference's and its collectives."""
    return decide(
        found,
        reference=ref_found,
        reference_step=reference_step,
        collectives=match.matched,
        step_ms=step_ms,
        expected_ms=expected_ms,
    )


def kernel_diff(
    is_reference: bool,
    facts: Mapping[int, RankFacts],
    reference_step: int | None,
    ref_facts: Mapping[int, RankFacts],
    found: Sequence[RankEvidence],
    ref_found: Sequence[RankEvidence],
) -> KernelDiff:
    """Every rank's ops against the same rank of the reference step (same op kind only)."""
    if reference_step is None:
        note = (
            "this is the reference step"
            if is_reference
            else "no reference step captured in this run"
        )
        return KernelDiff(None, {}, note)
    stalled = {e.rank: e.breakdown.stalled_ms for e in found}
    ref_stalled = {e.rank: e.breakdown.stalled_ms for e in ref_found}
    ranks = {}
    for rank in sorted(set(facts) & set(ref_facts)):
        mine, theirs = facts[rank], ref_facts[rank]
        if mine.ops_kind != theirs.ops_kind:
            continue  # kernels cannot be diffed against CPU ops
        idle = (
            stalled[rank] - ref_stalled[rank] if rank in stalled and rank in ref_stalled else None
        )
        ranks[rank] = diff_ops(rank, mine.ops_kind, mine.ops, theirs.ops, idle)
    return KernelDiff(reference_step, ranks)


def merged_content(
    step: int,
    events: Mapping[int, Sequence[Any]],
    hosts: Mapping[int, str | None],
    facts: Mapping[int, RankFacts],
    match: MatchResult,
) -> bytes:
    """The merged trace of one capture (gzipped), every rank of `facts` on one clock."""
    alignment = estimate_offsets(
        list(facts), hosts, {r: f.base_time_ns for r, f in facts.items()}, match.matched
    )
    writer = MergeWriter()
    for rank in facts:
        writer.add_rank(rank, hosts[rank], events[rank], alignment.offsets_us[rank])
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
    return writer.finish(metadata)
