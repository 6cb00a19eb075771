"""Read a run directory back: run facts, step times, and every capture with its ranks.

The index is folded into the current state (a file written, then perhaps dropped when a
more severe capture replaced it); every path read from it is resolved inside the run
directory. Damage (a corrupt index line, a missing trace, a rank that never wrote its
file) is collected as `problems` next to what could be read, never raised, so a report
of a damaged run still shows everything that survived. No torch here.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from distanom.detect import StepSample
from distanom.errors import RunDirError
from distanom.rundir import RunDir, capture_steps_on_disk, read_json

MAX_STEP_ROWS = 10_000_000  # a steps file is one short line per step


@dataclass
class RankCapture:
    rank: int
    trace: str  # relative to the run directory
    host: str | None
    kinds: set[str]
    bytes: int
    tracer: str | None
    tracer_stats: dict[str, Any]
    cost_ms: dict[str, float] = field(default_factory=dict)  # the capture worker's time


@dataclass
class CaptureInfo:
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
        if self.step_ms is None or not self.median_ms:
            return None
        return self.step_ms / self.median_ms

    @property
    def missing_ranks(self) -> list[int]:
        return [rank for rank in self.expected_ranks if rank not in self.ranks]


@dataclass
class StepSeries:
    """Every rank's step times, aligned by step (NaN where a rank has none)."""

    steps: list[int]
    per_rank: dict[int, list[float]]
    traced: list[bool]  # on every rank
    after_flush: list[bool] = field(default_factory=list)  # on any rank
    self_ms: list[float] = field(default_factory=list)  # the longest on any rank
    # Python garbage collection per rank and step: (ms, highest generation or -1)
    gc: dict[int, dict[int, tuple[float, int]]] = field(default_factory=dict)

    def samples(self) -> list[StepSample]:
        """The steps as the detector saw them (same fields the consensus gathers)."""
        out = []
        for position, step in enumerate(self.steps):
            own = self.self_ms[position] if self.self_ms else 0.0
            out.append(
                StepSample(
                    step,
                    tuple(values[position] for values in self.per_rank.values()),
                    self.traced[position],
                    after_flush=bool(self.after_flush and self.after_flush[position]),
                    disturbed=own > 0,
                    self_ms=own,
                )
            )
        return out

    def step_ms(self) -> list[float]:
        out = []
        for position in range(len(self.steps)):
            values = [v[position] for v in self.per_rank.values() if math.isfinite(v[position])]
            out.append(max(values) if values else math.nan)
        return out

    def median_ms(self) -> float | None:
        finite = [v for v in self.step_ms() if math.isfinite(v)]
        return statistics.median(finite) if finite else None


@dataclass
class RunData:
    run: RunDir
    info: dict[str, Any]
    status: dict[str, Any] | None
    captures: list[CaptureInfo]
    problems: list[str]

    @property
    def world_size(self) -> int:
        size = self.info.get("world_size")
        return size if isinstance(size, int) and size > 0 else 1

    @property
    def hosts(self) -> list[str]:
        hosts = self.info.get("hosts")
        return [str(h) for h in hosts] if isinstance(hosts, list) else []


def load_run(path: str) -> RunData:
    run = RunDir.open(path)
    problems: list[str] = []
    try:
        info = read_json(run.run_json)
        if not isinstance(info, dict):
            raise RunDirError(f"{run.run_json}: not a JSON object")
    except RunDirError as err:
        problems.append(str(err))
        info = {}
    status: dict[str, Any] | None
    try:
        loaded = read_json(run.status_json) if run.status_json.exists() else None
        status = loaded if isinstance(loaded, dict) else None
    except RunDirError as err:
        problems.append(str(err))
        status = None
    data = RunData(run, info, status, [], problems)
    data.captures = _fold_index(data)
    return data


def _fold_index(data: RunData) -> list[CaptureInfo]:
    run = data.run
    records, index_problems = run.read_index()
    for problem in index_problems:
        data.problems.append(f"{run.index_path.name} line {problem.line}: {problem.reason}")
    captures: dict[int, CaptureInfo] = {}
    for record in records:
        step, rank = record["step"], record["rank"]
        if record["event"] == "dropped":
            info = captures.get(step)
            held = info.ranks.get(rank) if info else None
            if info is not None and held is not None:
                held.kinds.discard(str(record.get("kind")))
                if not held.kinds:
                    del info.ranks[rank]
            continue
        try:
            trace = run.relative(run.inside(str(record.get("trace", ""))))
        except RunDirError as err:
            data.problems.append(str(err))
            continue
        info = captures.setdefault(
            step,
            CaptureInfo(
                step=step,
                kinds=set(),
                step_ms=_number(record.get("step_ms")),
                median_ms=_number(record.get("median_ms")),
                threshold_ms=_number(record.get("threshold_ms")),
                slowest_rank=_int(record.get("slowest_rank")),
                request=_text(record.get("request")),
            ),
        )
        kind = str(record.get("kind", "anomaly"))
        if info.step_ms is None and _number(record.get("step_ms")) is not None:
            info.step_ms = _number(record.get("step_ms"))
        held = info.ranks.get(rank)
        if held is None:
            stats = record.get("tracer_stats")
            info.ranks[rank] = RankCapture(
                rank=rank,
                trace=trace,
                host=_text(record.get("host")),
                kinds={kind},
                bytes=_int(record.get("bytes")) or 0,
                tracer=_text(record.get("tracer")),
                tracer_stats=stats if isinstance(stats, dict) else {},
                cost_ms=_costs(record.get("cost_ms")),
            )
        else:
            held.kinds.add(kind)
    for info in captures.values():
        info.kinds = set().union(*(held.kinds for held in info.ranks.values()))
        for held in list(info.ranks.values()):
            if not (run.path / held.trace).is_file():
                data.problems.append(f"step {info.step} rank {held.rank}: trace file missing")
    kept = [info for info in captures.values() if info.ranks]
    for info in kept:
        info.expected_ranks = _expected_ranks(data, info, records)
    on_disk = set(capture_steps_on_disk(run)) - {info.step for info in kept}
    for step in sorted(on_disk):
        if any(run.capture_dir(step).glob("rank*.trace.json.gz")):
            data.problems.append(f"step {step}: trace files on disk but not in the index")
    return sorted(kept, key=lambda info: info.step)


MAX_COST_MS = 86_400_000.0


def _costs(value: Any) -> dict[str, float]:
    """An index line's cost_ms, numbers only (a damaged or older line gives none)."""
    if not isinstance(value, dict):
        return {}
    costs = {str(k): _number(v) for k, v in value.items()}
    # a real cost is a few ms: anything negative or beyond a day is damage, not data
    return {k: v for k, v in costs.items() if v is not None and 0 <= v < MAX_COST_MS}


def _expected_ranks(data: RunData, info: CaptureInfo, records: list[dict[str, Any]]) -> list[int]:
    if info.request is not None:
        # a requested capture covers only the ranks asked for: those that wrote, or
        # more if the response file names them
        response = _request_ranks(data, info.request)
        if response is not None:
            return response
        return sorted(info.ranks)
    return list(range(data.world_size))


def _request_ranks(data: RunData, number: str) -> list[int] | None:
    folder = data.run.requests_dir
    if not folder.is_dir():
        return None
    for path in folder.glob("*.response.json"):
        try:
            body = read_json(path)
        except RunDirError:
            continue
        if isinstance(body, dict) and body.get("request") == number:
            ranks = body.get("ranks")
            if ranks == "all":
                return list(range(data.world_size))
            if isinstance(ranks, list) and all(isinstance(r, int) for r in ranks):
                return sorted(ranks)
    return None


def load_steps(data: RunData) -> StepSeries:
    """Every rank's steps/rank<R>.csv, aligned by step; damaged rows become problems."""
    per_rank_rows: dict[int, dict[int, tuple[float, bool, bool, float]]] = {}
    collections: dict[int, dict[int, tuple[float, int]]] = {}
    for rank in range(data.world_size):
        path = data.run.steps_csv(rank)
        if not path.exists():
            continue
        rows: dict[int, tuple[float, bool, bool, float]] = {}
        pauses: dict[int, tuple[float, int]] = {}
        bad = 0
        with open(path, encoding="ascii", errors="replace", newline="") as handle:
            for number, row in enumerate(csv.reader(handle)):
                if number == 0 or number > MAX_STEP_ROWS:
                    continue
                try:
                    after = len(row) > 3 and row[3].strip() == "1"
                    spent = float(row[4]) if len(row) > 4 else 0.0
                    step = int(row[0])
                    rows[step] = (float(row[1]), row[2].strip() == "1", after, spent)
                except (ValueError, IndexError):
                    bad += 1
                    continue
                pause = _gc_pause(row)
                if pause is None:
                    pauses.pop(step, None)  # a repeated row replaces the whole step
                else:
                    pauses[step] = pause
        if bad:
            data.problems.append(f"{data.run.relative(path)}: {bad} unreadable row(s) skipped")
        per_rank_rows[rank] = rows
        collections[rank] = pauses
    steps = sorted(set().union(*(rows.keys() for rows in per_rank_rows.values())))
    missing = (math.nan, True, False, 0.0)
    per_rank = {
        rank: [rows.get(step, missing)[0] for step in steps] for rank, rows in per_rank_rows.items()
    }
    every = list(per_rank_rows.values())
    traced = [all(rows.get(step, missing)[1] for rows in every) for step in steps]
    flushed = [any(rows.get(step, missing)[2] for rows in every) for step in steps]
    own = [max((rows.get(step, missing)[3] for rows in every), default=0.0) for step in steps]
    return StepSeries(steps, per_rank, traced, flushed, own, collections)


def _gc_pause(row: list[str]) -> tuple[float, int] | None:
    """A step row's garbage collection (ms, generation), None for none or unreadable
    (runs written before these columns existed have none)."""
    try:
        spent, generation = float(row[5]), int(row[6])
    except (ValueError, IndexError):
        return None
    return (spent, generation) if math.isfinite(spent) and spent > 0 else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)  # an integer too large for a float raises
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
