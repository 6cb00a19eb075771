"""Build the report's model (`model.Report`) from a loaded run, reading each trace once.

Reads: `RunData` (run.json, status.json, the folded index), the step files
(`run.load_steps`), each rank's table CSVs when cached, and each rank's trace document,
parsed once and handed to the tables, the cross-rank facts and the merged trace. Writes
nothing: the files the report leaves in the run directory are written by
`distanom.analysis.outputs`. Damage becomes `Report.problems`, in the order a reader
meets it: the run's, then each capture's tables, then the cross-rank analyses.
"""

from __future__ import annotations

import math
import os
import stat
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from distanom.analysis import crossrank
from distanom.analysis.anomalies import Anomaly, CapturedAnomaly, TraceVerdict, anomalies_of
from distanom.analysis.collectives import MatchResult, match_collectives
from distanom.analysis.crossrank import RankFacts
from distanom.analysis.engine import tables_of
from distanom.analysis.hangs import read_hangs
from distanom.analysis.kernel_diff import pick_reference
from distanom.analysis.lost_time import lost_time
from distanom.analysis.merge import MERGED_NAME
from distanom.analysis.model import (
    Capture,
    CaptureCost,
    CaptureState,
    GcPause,
    MergedTrace,
    RankEntry,
    Report,
    RunFacts,
    StepStats,
    StepTimes,
)
from distanom.analysis.phases import straggler_phase
from distanom.analysis.run import CaptureInfo, RunData, StepSeries, load_steps
from distanom.analysis.tables_io import cached_tables
from distanom.analysis.trace_io import read_trace_document, trace_from_document
from distanom.analysis.verdict import note_python_gc
from distanom.config import CaptureConfig, DetectConfig, config_from_mapping
from distanom.detect import Detector
from distanom.errors import DistanomError
from distanom.records.anomalies import read_anomalies, read_stragglers
from distanom.rundir import json_number

__all__ = ["COST_PARTS", "build_report", "capture_cost", "rolling_threshold"]

COST_PARTS = ("locate_ms", "build_ms", "encode_ms", "write_ms")

# Tracer stats of a served step that mean records of it may be missing from its trace.
_INCOMPLETE_IF = {
    "held_buffers_at_serve": "a CUPTI buffer was not handed back in time",
    "zero_timestamp_dropped": "records without timestamps were dropped",
}


def build_report(data: RunData, *, engine: str = "auto", step_times: bool = False) -> Report:
    """The report of a loaded run (`step_times`: also every step's threshold, for charts)."""
    series = load_steps(data)
    run_problems = list(data.problems)
    read = [_read_capture(data, info, engine) for info in data.captures]
    problems = run_problems + [p for capture in read for p in capture.table_problems]
    captures = _cross_rank(data, read, series, problems)
    status = data.status or {}
    config = data.info.get("config") if isinstance(data.info.get("config"), dict) else {}
    detect = (config or {}).get("detect", {})
    counters = status.get("captures") or {}
    hangs, hang_problems = read_hangs(data.copies, data.world_size)
    problems.extend(hang_problems)
    stragglers = read_stragglers(data.run)
    anomalies = _anomalies(data, captures, problems, series)
    return Report(
        facts=RunFacts(
            run_id=data.run.run_id,
            run_dir=str(data.run.path),
            world_size=data.world_size,
            hosts=data.hosts,
            state=_state(status),
            started_at=data.info.get("started_at"),
            torch=data.info.get("torch"),
            argv=data.info.get("argv"),
            node_of=data.node_of,
            node_hosts=_node_hosts(data),
            copies=[str(copy.path) for copy in data.copies] if len(data.copies) > 1 else [],
        ),
        steps=StepStats(
            count=len(series.steps),
            last=series.steps[-1] if series.steps else None,
            median_ms=json_number(series.median_ms()),
            threshold_ms=status.get("threshold_ms"),
            multiplier=detect.get("multiplier"),
            detector_median_ms=status.get("median_ms"),
            optimizer_skipped=len(series.skipped),
        ),
        step_times=_step_times(series, detect if isinstance(detect, dict) else {})
        if step_times
        else None,
        tracer=status.get("tracer") or {},
        detector=status.get("detector") or {},
        agent_cost=status.get("agent_cost") or {},
        episodes=status.get("episodes") or [],
        capture_state=CaptureState(
            written=counters.get("written"),
            skipped_disk=counters.get("skipped_disk"),
            missed=counters.get("missed"),
            capture_off=status.get("capture_off"),
            consensus_error=status.get("consensus_error"),
        ),
        captures=captures,
        capture_cost=capture_cost(data),
        problems=problems,
        detect_config=detect if isinstance(detect, dict) else {},
        hangs=hangs,
        anomalies=anomalies,
        lost_time=lost_time(anomalies, _run_ms(series)),
        stragglers=_with_phases(_list_of_dicts(stragglers.get("stragglers")), series),
        earlier_stragglers=_with_phases(_list_of_dicts(stragglers.get("earlier")), series),
        drift=_dict_or_none(stragglers.get("drift")),
    )


def _node_hosts(data: RunData) -> dict[int, str]:
    """Each known node's host: its node file's, else run.json's host of its first rank."""
    hosts = {number: node.host for number, node in data.nodes.items()}
    for rank, node in data.node_of.items():
        if node not in hosts and rank < len(data.hosts):
            hosts[node] = data.hosts[rank]
    return dict(sorted(hosts.items()))


def _run_ms(series: StepSeries) -> float | None:
    """The run's step time: each step's slowest rank, summed (None without steps)."""
    times = [t for t in series.step_ms() if math.isfinite(t)]
    return sum(times) if times else None


def _with_phases(entries: list[dict[str, Any]], series: StepSeries) -> list[dict[str, Any]]:
    """Straggler entries with the phase their rank was slow in (`phase`, None when not
    known), over the steps it was a straggler (to the last step, for a current one)."""
    last = series.steps[-1] if series.steps else 0
    out = []
    for entry in entries:
        rank, since, until = entry.get("rank"), entry.get("since_step"), entry.get("until_step")
        phase = None
        if isinstance(rank, int) and isinstance(since, int):
            end = until if isinstance(until, int) else last
            phase = straggler_phase(series.phases, rank, since, end)
        out.append({**entry, "phase": phase})
    return out


def _anomalies(
    data: RunData, captures: list[Capture], problems: list[str], series: StepSeries
) -> list[Anomaly]:
    """Every recorded anomalous step, a captured one with its trace verdict."""
    traced = {
        c.step: TraceVerdict(
            c.verdict.culprit_rank,
            str(c.verdict.cause),
            c.verdict.evidence,
            _explained_ms(c.verdict.details, c.verdict.culprit_rank),
        )
        for c in captures
    }
    captured = [
        CapturedAnomaly(c.step, _nan_if_none(c.step_ms), _nan_if_none(c.median_ms))
        for c in captures
        if "anomaly" in c.kinds
    ]
    try:
        records = read_anomalies(data.run, world_size=data.world_size)
        return anomalies_of(records, traced, captured, series.phases)
    except OSError as err:
        problems.append(f"anomalies.jsonl: not readable ({err.strerror})")
        return []


def _explained_ms(details: dict[str, Any], culprit: int | None) -> float:
    """How much of its step a trace verdict found on its culprit: its own extra time, or
    the wait it caused as the last to arrive at a collective; for a verdict on every
    rank (no culprit), the ranks' median growth; NaN where not said."""
    found = [details.get("extra_own_ms")]
    if culprit is None:
        found.append(details.get("slowdown_ms"))
    arrival = details.get("arrival")
    if isinstance(arrival, dict) and arrival.get("latest_rank") == culprit:
        found.append(arrival.get("wait_ms"))
    values = [float(v) for v in found if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return max(values) if values else float("nan")


def _nan_if_none(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _list_of_dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _dict_or_none(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def capture_cost(data: RunData) -> CaptureCost | None:
    """What writing a capture cost one rank's capture worker (median over every rank's
    written files): time the training thread shares the GIL with. None before any
    capture recorded it."""
    costs = [
        held.cost_ms
        for info in data.captures
        for held in info.ranks.values()
        if all(part in held.cost_ms for part in COST_PARTS)
    ]
    if not costs:
        return None
    totals = [sum(c[p] for p in COST_PARTS) for c in costs]
    return CaptureCost(
        files=len(costs),
        median_ms=round(statistics.median(totals), 3),
        max_ms=round(max(totals), 3),
        parts_median_ms={p: round(statistics.median(c[p] for c in costs), 3) for p in COST_PARTS},
    )


def run_detect_config(detect: Mapping[str, Any]) -> DetectConfig:
    """The `detect` section a run was judged with, from its run.json: a run recorded
    before the slowdown floor existed had none (0), not today's default."""
    section = dict(detect)
    if section and "min_slowdown_ms" not in section:
        section["min_slowdown_ms"] = 0.0
    return config_from_mapping({"detect": section}).detect


def rolling_threshold(series: StepSeries, detect: Mapping[str, Any]) -> list[float]:
    """The threshold each step was judged by: the run's own detector, replayed over the
    recorded steps (status.json keeps only the latest, so replay is the only source)."""
    detector = Detector(run_detect_config(detect), CaptureConfig())
    out = []
    for sample in series.samples():
        out.append(detector.threshold_before(sample))
        detector.observe(sample)
    return out


def _step_times(series: StepSeries, detect: Mapping[str, Any]) -> StepTimes:
    return StepTimes(list(series.steps), series.step_ms(), rolling_threshold(series, detect))


def _state(status: dict[str, Any]) -> str:
    from distanom.records.status import job_alive, stale_since

    if not status:
        return "unknown"
    if status.get("state") == "running" and not job_alive(status):
        return f"stopped ({stale_since(status)})"
    return str(status.get("state"))


@dataclass
class _Read:
    """One capture after its traces were read: entries, facts, and what they cost."""

    info: CaptureInfo
    ranks: dict[int, RankEntry]
    facts: dict[int, RankFacts]
    fact_problems: list[str]
    table_problems: list[str]
    match: MatchResult
    merged: tuple[str, Any, bytes | None] | None = None
    merge_problem: list[str] = field(default_factory=list)


def _read_capture(data: RunData, info: CaptureInfo, engine: str) -> _Read:
    """Every rank's trace of one capture parsed once: tables, facts and merged trace."""
    ranks: dict[int, RankEntry] = {}
    facts: dict[int, RankFacts] = {}
    events: dict[int, list[Any]] = {}
    table_problems: list[str] = []
    fact_problems: list[str] = []
    for rank, held in sorted(info.ranks.items()):
        run = data.copies[held.copy]
        path = run.path / held.trace
        entry = RankEntry(rank, held.trace, held.host, held.bytes, held.tracer, held.tracer_stats)
        if held.copy:
            entry = replace(entry, run_dir=str(run.path))
        document: dict[str, Any] | None = None
        error: DistanomError | None = None
        try:
            document = read_trace_document(path)
        except DistanomError as err:
            error = err
        if path.is_file():
            cached = cached_tables(run, info.step, rank)
            if cached is not None:
                entry = replace(entry, timeline=cached.timeline, timeline_kind=cached.kind)
            else:
                try:
                    if document is None:
                        raise error or DistanomError(f"{path}: unreadable")
                    trace = trace_from_document(document, os.fspath(path))
                    tables = tables_of(trace, path, engine)
                    entry = replace(
                        entry, timeline=tables.timeline, timeline_kind=tables.kind, computed=tables
                    )
                except DistanomError as err:
                    table_problems.append(f"step {info.step} rank {rank}: {err}")
        if document is not None:
            facts[rank] = crossrank.rank_facts(rank, document)
            events[rank] = document.get("traceEvents") or []
        elif entry.timeline is not None:  # else the tables reported it already
            fact_problems.append(f"step {info.step} rank {rank}: {error}")
        del document
        ranks[rank] = entry
    for rank, held in sorted(info.ranks.items()):
        gaps = [what for key, what in _INCOMPLETE_IF.items() if held.tracer_stats.get(key)]
        if gaps:
            table_problems.append(
                f"step {info.step} rank {rank}: trace may lack records ({'; '.join(gaps)})"
            )
    match = match_collectives({r: f.calls for r, f in facts.items()})
    read = _Read(info, ranks, facts, fact_problems, table_problems, match)
    read.merged = _merged(data, info, ranks, facts, events, match)
    return read


def _merged(
    data: RunData,
    info: CaptureInfo,
    ranks: Mapping[int, RankEntry],
    facts: Mapping[int, RankFacts],
    events: Mapping[int, list[Any]],
    match: MatchResult,
) -> tuple[str, Any, bytes | None] | None:
    """The merged trace's relative path, path and bytes (None: the one on disk is newer
    than every rank trace it holds, so an earlier report wrote it). One on disk is kept
    only as a regular file (never a link) owned by whoever owns the rank traces: a
    co-user's planted file, or a link to one outside the run, is written over."""
    if not facts:
        return None
    path = data.run.capture_dir(info.step) / MERGED_NAME
    traces = [Path(ranks[r].run_dir or data.run.path) / ranks[r].trace for r in facts]
    try:
        found, written = path.lstat(), [t.stat() for t in traces]
        ours = stat.S_ISREG(found.st_mode) and all(t.st_uid == found.st_uid for t in written)
        if ours and found.st_mtime >= max(t.st_mtime for t in written):
            return data.run.relative(path), path, None
    except OSError:
        pass
    hosts = {r: ranks[r].host for r in facts}
    content = crossrank.merged_content(info.step, events, hosts, facts, match)
    return data.run.relative(path), path, content


def _cross_rank(
    data: RunData, read: list[_Read], series: StepSeries, problems: list[str]
) -> list[Capture]:
    """Every capture's verdict, kernel diff and merged trace; appends the cross-rank
    problems to `problems` (a rank's unreadable trace the first time a capture needs it)."""
    by_step = {r.info.step: r for r in read}
    references = [r.info.step for r in read if "reference" in r.info.kinds]
    reported: set[int] = set()

    def facts_of(capture: _Read) -> dict[int, RankFacts]:
        if capture.info.step not in reported:
            reported.add(capture.info.step)
            problems.extend(capture.fact_problems)
        return capture.facts

    out = []
    for capture in read:
        info = capture.info
        mine = facts_of(capture)
        reference_step = pick_reference(info.step, references)
        reference = by_step.get(reference_step) if reference_step is not None else None
        ref_facts = facts_of(reference) if reference is not None else {}
        found = crossrank.evidence(capture.ranks, mine)
        ref_found = crossrank.evidence(reference.ranks, ref_facts) if reference else []
        pauses = {
            rank: GcPause(round(pause[0], 3), pause[1])
            for rank, by_rank in sorted(series.gc.items())
            if (pause := by_rank.get(info.step)) is not None
        }
        verdict = crossrank.verdict(
            found, ref_found, reference_step, capture.match, info.step_ms, info.median_ms
        )
        verdict = note_python_gc(
            verdict, {str(r): {"ms": p.ms, "generation": p.generation} for r, p in pauses.items()}
        )
        merged = None
        if capture.merged is not None:
            relative, path, content = capture.merged
            merged = MergedTrace(relative, path, content, len(problems))
        ranks = {
            rank: _with_outside(entry, mine.get(rank)) for rank, entry in capture.ranks.items()
        }
        out.append(
            Capture(
                step=info.step,
                kinds=sorted(info.kinds),
                step_ms=info.step_ms,
                median_ms=info.median_ms,
                threshold_ms=info.threshold_ms,
                ratio=json_number(info.ratio),
                slowest_rank=info.slowest_rank,
                request=info.request,
                ranks=ranks,
                missing_ranks=info.missing_ranks,
                python_gc=pauses,
                verdict=verdict,
                kernel_diff=crossrank.kernel_diff(
                    "reference" in info.kinds, mine, reference_step, ref_facts, found, ref_found
                ),
                merged=merged,
                unreadable_ranks=sorted(r for r in capture.ranks if r not in mine),
                optimizer_skipped=info.step in series.skipped,
            )
        )
    return out


def _with_outside(entry: RankEntry, facts: RankFacts | None) -> RankEntry:
    """The entry with its time outside the ops, shown beside the breakdown so the table
    tells the verdict's story."""
    rows = entry.breakdown()
    if rows is None:
        return entry
    outside = crossrank.outside_ms(rows, entry.timeline_kind or "gpu", facts)
    return entry if outside is None else replace(entry, outside_ms=round(outside, 4))
