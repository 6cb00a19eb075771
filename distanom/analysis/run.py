"""Read a run directory back: run facts, step times, and every capture with its ranks.

The index is folded into the current state (a file written, then perhaps dropped when a
more severe capture replaced it); every path read from it is resolved inside the run
directory. Damage (a corrupt index line, a missing trace, a rank that never wrote its
file, a trace on disk the index does not name, a field of run.json or status.json of
the wrong type) is collected as `problems` next to what could be read, never raised, so
a report of a damaged run still shows everything that survived. Once the job is gone,
the temporary files its killed writers left are removed (`RunDir.clean_orphans`). No
torch here.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from distanom.analysis.copies import missing_nodes, node_of_ranks, open_copies
from distanom.analysis.phases import PhaseTable
from distanom.analysis.run_checks import RUN_FIELDS, STATUS_FIELDS, checked
from distanom.detect import StepSample
from distanom.errors import RunDirError
from distanom.records.index import IndexRecord, read_index
from distanom.records.nodes import NodeInfo
from distanom.records.requests import accepted_ranks
from distanom.records.run_info import (
    hosts_of,
    load_run_info,
    node_ranks_of,
    world_size_of,
    world_size_problem,
)
from distanom.records.status import job_alive, load_status
from distanom.records.steps import StepColumns, read_step_columns
from distanom.rundir import RunDir, capture_steps_on_disk

ORPHAN_AGE_S = 60.0  # a live writer's temporary file is seconds old
MAX_LISTED = 1_000_000  # directory entries looked at
_RANK_TRACE = re.compile(r"^rank(\d+)\.trace\.json\.gz$")
_RANK_STEPS = re.compile(r"^rank(\d+)\.csv$")

__all__ = [
    "CaptureInfo",
    "RankCapture",
    "RunData",
    "StepSeries",
    "load_run",
    "load_steps",
]


@dataclass
class RankCapture:
    """One rank's trace file of a captured step, as the index left it."""

    rank: int
    trace: str  # relative to the run directory
    host: str | None
    kinds: set[str]
    bytes: int
    tracer: str | None
    tracer_stats: dict[str, Any]
    cost_ms: dict[str, float] = field(default_factory=dict)  # the capture worker's time
    copy: int = 0  # which of `RunData.copies` holds the file (its node's copy of the run)


@dataclass
class CaptureInfo:
    """One captured step: why, its timing at the decision, and every rank's file."""

    step: int
    kinds: set[str]
    step_ms: float | None
    median_ms: float | None
    threshold_ms: float | None
    slowest_rank: int | None
    request: str | None
    ranks: dict[int, RankCapture] = field(default_factory=dict)
    expected_ranks: list[int] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        """The step's time over the median, None when either is unknown."""
        if self.step_ms is None or not self.median_ms:
            return None
        return self.step_ms / self.median_ms

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks expected to hold a file of this step that hold none."""
        return [rank for rank in self.expected_ranks if rank not in self.ranks]


@dataclass
class StepSeries:
    """Every rank's step times, aligned by step (NaN where a rank has none): one float64
    array per rank, so a long run costs 8 bytes a cell."""

    steps: list[int]
    per_rank: dict[int, np.ndarray]  # lists are taken too, and stored as arrays
    traced: list[bool]  # on every rank
    after_flush: list[bool] = field(default_factory=list)  # on any rank
    self_ms: list[float] = field(default_factory=list)  # the longest on any rank
    # Python garbage collection per rank and step: (ms, highest generation or -1)
    gc: dict[int, dict[int, tuple[float, int]]] = field(default_factory=dict)
    skipped: frozenset[int] = frozenset()  # steps whose optimizer step was skipped, any rank
    phases: dict[int, PhaseTable] = field(default_factory=dict)  # per rank, where recorded

    def __post_init__(self) -> None:
        self.per_rank = {
            rank: np.asarray(values, dtype=np.float64) for rank, values in self.per_rank.items()
        }

    def samples(self) -> Iterator[StepSample]:
        """The steps as the detector saw them (same fields the consensus gathers), made a
        block of steps at a time."""
        columns = list(self.per_rank.values())
        for first in range(0, len(self.steps), SAMPLE_BLOCK):
            last = min(first + SAMPLE_BLOCK, len(self.steps))
            block = np.column_stack([v[first:last] for v in columns]).tolist() if columns else []
            for position in range(first, last):
                own = self.self_ms[position] if self.self_ms else 0.0
                yield StepSample(
                    self.steps[position],
                    tuple(block[position - first]) if block else (),
                    self.traced[position],
                    after_flush=bool(self.after_flush and self.after_flush[position]),
                    disturbed=own > 0,
                    self_ms=own,
                )

    def step_ms(self) -> list[float]:
        """Each step's time on its slowest rank (NaN where no rank has one)."""
        out = np.full(len(self.steps), np.nan)
        for values in self.per_rank.values():
            out = np.fmax(out, values)
        return list(out.tolist())

    def median_ms(self) -> float | None:
        """The median of `step_ms`, None without any finite step."""
        finite = [v for v in self.step_ms() if math.isfinite(v)]
        return statistics.median(finite) if finite else None


SAMPLE_BLOCK = 4096  # steps turned into samples at a time (ranks x block floats)


@dataclass
class RunData:
    """A run read back: run.json (`info`, {} when unreadable), status.json (None when
    absent), every kept capture, and a line for each piece of damage found. A run given
    as several copies (one per node, no shared filesystem) has them all in `copies`,
    `run` (the one holding run.json) first; `step_files` says which copy holds each
    rank's steps file."""

    run: RunDir
    info: dict[str, Any]  # a `records.run_info.RunInfo`
    status: dict[str, Any] | None  # a `records.status.Status`
    captures: list[CaptureInfo]
    problems: list[str]
    copies: tuple[RunDir, ...] = ()
    nodes: dict[int, NodeInfo] = field(default_factory=dict)  # the node files, by node
    step_files: dict[int, int] = field(default_factory=dict)  # rank -> index in copies

    def __post_init__(self) -> None:
        if not self.copies:
            self.copies = (self.run,)

    @property
    def world_size(self) -> int:
        """The run's world size: run.json's, else the node files' (node 0's copy not
        given), else 1."""
        if "world_size" not in self.info and self.nodes:
            return max(node.world_size for node in self.nodes.values())
        return world_size_of(self.info)

    @property
    def node_of(self) -> dict[int, int]:
        """The node of each rank whose node is known (run.json, else the node files)."""
        return node_of_ranks(self.world_size, node_ranks_of(self.info), self.nodes)

    @property
    def hosts(self) -> list[str]:
        """The host of each rank, [] when run.json does not say."""
        return hosts_of(self.info)


def load_run(path: str | Path | Sequence[str | Path]) -> RunData:
    """Open a run directory (or a base with `latest`), or every node's copy of one run,
    and read everything but the traces and step files' rows; damage becomes `problems`,
    a missing directory raises RunDirError, copies of different runs DistanomError."""
    opened = open_copies([path] if isinstance(path, (str, Path)) else path)
    run = opened.primary
    problems: list[str] = list(opened.problems)
    info: dict[str, Any]
    try:
        info = checked(cast(dict[str, Any], load_run_info(run)), RUN_FIELDS, run.run_json, problems)
    except RunDirError as err:
        problems.append(str(err))
        info = {}
    size_problem = world_size_problem(info)
    if size_problem is not None:
        problems.append(f"{run.run_json}: {size_problem}")
    status: dict[str, Any] | None
    try:
        loaded = load_status(run)
        status = cast(dict[str, Any], loaded) if loaded is not None else None
        if status is not None:
            status = checked(status, STATUS_FIELDS, run.status_json, problems)
    except RunDirError as err:
        problems.append(str(err))
        status = None
    if not job_alive(status):  # the job is gone: what its killed writers left goes
        for copy in opened.copies:
            removed = copy.clean_orphans(ORPHAN_AGE_S)
            if removed:
                shown = ", ".join(removed[:5]) + (", ..." if len(removed) > 5 else "")
                where = "" if len(opened.copies) == 1 else f" in {copy.path}"
                problems.append(
                    f"removed {len(removed)} temporary file(s) of a killed writer{where}: {shown}"
                )
    data = RunData(run, info, status, [], problems, opened.copies, opened.nodes)
    data.step_files = _step_files(data)
    data.problems += missing_nodes(data.world_size, set(data.step_files), data.node_of, data.nodes)
    data.captures = _fold_index(data)
    return data


def _fold_index(data: RunData) -> list[CaptureInfo]:
    records: list[tuple[int, IndexRecord]] = []
    for copy, run in enumerate(data.copies):
        read, index_problems = read_index(run)
        where = run.index_path.name if copy == 0 else str(run.index_path)
        for problem in index_problems:
            data.problems.append(f"{where} line {problem.line}: {problem.reason}")
        records += [(copy, record) for record in read]
    captures = _fold_records(data, records)
    kept = [info for info in captures.values() if info.ranks]
    for info in kept:
        info.expected_ranks = _expected_ranks(data, info)
    for run in data.copies:
        on_disk = set(capture_steps_on_disk(run)) - {info.step for info in kept}
        for step in sorted(on_disk):
            if any(run.capture_dir(step).glob("rank*.trace.json.gz")):
                data.problems.append(f"step {step}: trace files on disk but not in the index")
        for info in kept:  # a rank killed between writing its trace and indexing it
            for rank in _ranks_on_disk(run, info.step):
                if rank not in info.ranks:
                    data.problems.append(
                        f"step {info.step} rank {rank}: trace file on disk but not in the index"
                    )
    return sorted(kept, key=lambda info: info.step)


def _fold_records(data: RunData, records: list[tuple[int, IndexRecord]]) -> dict[int, CaptureInfo]:
    """The index lines of every copy folded into each step's capture (a file written,
    then perhaps dropped)."""
    captures: dict[int, CaptureInfo] = {}
    for copy, record in records:
        run = data.copies[copy]
        step, rank = record.step, record.rank
        if record.event == "dropped":
            info = captures.get(step)
            held = info.ranks.get(rank) if info else None
            if info is not None and held is not None:
                held.kinds.discard(str(record.raw.get("kind")))
                if not held.kinds:
                    del info.ranks[rank]
            continue
        try:
            trace = run.relative(run.inside(record.trace))
        except RunDirError as err:
            data.problems.append(str(err))
            continue
        info = captures.setdefault(
            step,
            CaptureInfo(
                step=step,
                kinds=set(),
                step_ms=record.step_ms,
                median_ms=record.median_ms,
                threshold_ms=record.threshold_ms,
                slowest_rank=record.slowest_rank,
                request=record.request,
            ),
        )
        kind = record.kind
        if info.step_ms is None and record.step_ms is not None:
            info.step_ms = record.step_ms
        held = info.ranks.get(rank)
        if held is None:
            info.ranks[rank] = RankCapture(
                rank=rank,
                trace=trace,
                host=record.host,
                kinds={kind},
                bytes=record.bytes,
                tracer=record.tracer,
                tracer_stats=record.tracer_stats,
                cost_ms=record.cost_ms,
                copy=copy,
            )
        else:
            held.kinds.add(kind)
    for info in captures.values():
        info.kinds = set().union(*(held.kinds for held in info.ranks.values()))
        for held in list(info.ranks.values()):
            if not (data.copies[held.copy].path / held.trace).is_file():
                data.problems.append(f"step {info.step} rank {held.rank}: trace file missing")
    return captures


def _ranks_on_disk(run: RunDir, step: int) -> list[int]:
    """Ranks with a trace file in captures/step_<step> (at most MAX_LISTED looked at)."""
    ranks = []
    for path in itertools.islice(run.capture_dir(step).glob("rank*.trace.json.gz"), MAX_LISTED):
        match = _RANK_TRACE.match(path.name)
        if match and len(match.group(1)) < 9:
            ranks.append(int(match.group(1)))
    return sorted(ranks)


def _expected_ranks(data: RunData, info: CaptureInfo) -> list[int]:
    if info.request is not None:
        # a requested capture covers only the ranks asked for: those that wrote, or
        # more if the response file names them
        response = accepted_ranks(data.run, info.request, data.world_size)
        if response is not None:
            return response
        return sorted(info.ranks)
    return list(range(data.world_size))


def _step_files(data: RunData) -> dict[int, int]:
    """Ranks of the world with a steps file and the copy holding it (the first given
    that has one), found by listing steps/ (never by probing each rank of a world size
    read from a file)."""
    ranks: dict[int, int] = {}
    for copy, run in enumerate(data.copies):
        folder = run.path / "steps"
        if not folder.is_dir():
            continue
        for path in itertools.islice(folder.iterdir(), MAX_LISTED):
            match = _RANK_STEPS.match(path.name)
            if match and len(match.group(1)) < 9 and int(match.group(1)) < data.world_size:
                ranks.setdefault(int(match.group(1)), copy)
    return dict(sorted(ranks.items()))


# steps x ranks the report aligns at most (8 bytes a cell): step files that disagree
# (disjoint steps on every rank, as a planted set can) must not make the report build
# ranks x all their steps
MAX_ALIGNED_CELLS = 6_000_000


@dataclass(frozen=True)
class _RankSteps:
    """One rank's readable rows, a row per step (the later of a repeated one), by step."""

    steps: np.ndarray
    duration_ms: np.ndarray
    traced: np.ndarray
    after_flush: np.ndarray
    self_ms: np.ndarray


def _aligned_steps(data: RunData, per_rank: Mapping[int, _RankSteps]) -> np.ndarray:
    """The steps the series aligns: every step any rank has, unless that makes more than
    `MAX_ALIGNED_CELLS` cells; then the steps most ranks hold (the latest first among
    equals), with a problem line saying how many were left out."""
    every = [rows.steps for rows in per_rank.values()]
    union, held = np.unique(np.concatenate([np.empty(0, np.int64), *every]), return_counts=True)
    ranks = max(1, len(per_rank))
    keep = MAX_ALIGNED_CELLS // ranks
    if len(union) <= keep:
        return np.asarray(union)
    chosen = np.sort(union[np.lexsort((-union, -held))[:keep]])
    data.problems.append(
        f"steps/: {len(union) - len(chosen)} steps left out of the step series: "
        f"{len(union)} steps on {ranks} ranks is more than the report aligns "
        f"({MAX_ALIGNED_CELLS} cells); the steps most ranks hold are kept"
    )
    return chosen


def load_steps(data: RunData) -> StepSeries:
    """Every rank's steps/rank<R>.csv, aligned by step; damaged rows become problems."""
    per_rank_rows: dict[int, _RankSteps] = {}
    collections: dict[int, dict[int, tuple[float, int]]] = {}
    skipped: set[int] = set()
    phases: dict[int, PhaseTable] = {}
    for rank, copy in data.step_files.items():
        run = data.copies[copy]
        path = run.steps_csv(rank)
        try:
            read = read_step_columns(path)
        except OSError as err:
            data.problems.append(f"{_shown(data, run, path)}: cannot be read ({err.strerror})")
            continue
        if read.bad:
            data.problems.append(f"{_shown(data, run, path)}: {read.bad} unreadable row(s) skipped")
        skipped.update(read.step[read.skipped].tolist())
        per_rank_rows[rank], table, collections[rank] = _one_row_per_step(read)
        if table is not None:
            phases[rank] = table
    steps = _aligned_steps(data, per_rank_rows)
    per_rank: dict[int, np.ndarray] = {}
    traced = np.ones(len(steps), dtype=bool)  # a rank without the step does not veto
    flushed = np.zeros(len(steps), dtype=bool)
    own = np.zeros(len(steps))
    for rank, rows in per_rank_rows.items():
        per_rank[rank] = np.full(len(steps), np.nan)
        if not len(rows.steps):
            continue
        where = np.minimum(np.searchsorted(rows.steps, steps), len(rows.steps) - 1)
        present = rows.steps[where] == steps
        per_rank[rank][present] = rows.duration_ms[where[present]]
        traced &= ~present | rows.traced[where]
        flushed |= present & rows.after_flush[where]
        own = np.maximum(own, np.where(present, rows.self_ms[where], 0.0))
    return StepSeries(
        steps.tolist(), per_rank, traced.tolist(), flushed.tolist(), own.tolist(), collections,
        frozenset(skipped), phases,
    )  # fmt: skip


def _one_row_per_step(
    read: StepColumns,
) -> tuple[_RankSteps, PhaseTable | None, dict[int, tuple[float, int]]]:
    """A rank's rows by step, its phase table and its collections; of a repeated step the
    later row wins, whole (its collection too)."""
    reverse_first = np.unique(read.step[::-1], return_index=True)[1]
    last = len(read) - 1 - reverse_first  # ascending by step
    step = read.step[last]
    table = PhaseTable.of_columns(step, np.column_stack([read.phases[last], read.self_ms[last]]))
    collected = last[read.gc_ms[last] > 0]
    spent, generation = read.gc_ms[collected].tolist(), read.gc_generation[collected].tolist()
    pauses = dict(
        zip(read.step[collected].tolist(), zip(spent, generation, strict=True), strict=True)
    )
    rows = _RankSteps(
        step, read.duration_ms[last], read.traced[last], read.after_flush[last], read.self_ms[last]
    )
    return rows, table, pauses


def _shown(data: RunData, run: RunDir, path: Path) -> str:
    """A file of the run as a problem line names it: relative to its run directory,
    whole where the run came in several copies and this is not the first."""
    return run.relative(path) if run is data.run else str(path)
