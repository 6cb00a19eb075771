"""index.jsonl: one JSON line per capture file a rank wrote or dropped, appended by every
rank's capture worker (under the run directory's lock) and folded by the report.

A `written` line names the trace file and what the capture was about; a `dropped` line
says a capture of that step and kind was replaced (its file is gone unless the step is
still kept for another kind). Lines are written with sorted keys. A reader keeps every
line that is JSON with a valid step, rank and event and reports the others as
`IndexProblem`s; each other field is checked where it is read (`IndexRecord`'s
accessors), so one damaged field never hides the rest of a line.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from distanom.rundir import RunDir
from distanom.safe_io import open_regular, parse_json

MAX_INDEX_LINE = 64 * 1024  # a longer line is damage, not data
MAX_INDEX_LINES = 1_000_000  # a line per captured file: far more is damage
MAX_STEP = 2**53
MAX_RANK = 2**24
MAX_COST_MS = 86_400_000.0  # a real cost is a few ms: beyond a day is damage


@dataclass(frozen=True)
class IndexWritten:
    """A rank wrote (or labelled once more) its trace file of a captured step."""

    step: int
    rank: int
    host: str
    kind: str
    trace: str  # relative to the run directory
    bytes: int  # 0 when an existing file only gained a label
    step_ms: float | None
    median_ms: float | None
    threshold_ms: float | None
    slowest_rank: int | None
    episode: int | None
    request: str | None
    tracer: str
    tracer_stats: Mapping[str, Any]
    time: float
    # where the capture worker's time went (ms), omitted when empty: finding the step in
    # the tracer, building its trace, json + gzip, writing the file
    cost_ms: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The line's JSON object."""
        body: dict[str, Any] = {
            "event": "written",
            "step": self.step,
            "rank": self.rank,
            "host": self.host,
            "kind": self.kind,
            "trace": self.trace,
            "bytes": self.bytes,
            "step_ms": self.step_ms,
            "median_ms": self.median_ms,
            "threshold_ms": self.threshold_ms,
            "slowest_rank": self.slowest_rank,
            "episode": self.episode,
            "request": self.request,
            "tracer": self.tracer,
            "tracer_stats": dict(self.tracer_stats),
        }
        if self.cost_ms:
            body["cost_ms"] = dict(self.cost_ms)
        body["time"] = self.time
        return body


@dataclass(frozen=True)
class IndexDropped:
    """A rank dropped its capture of a step for one kind (a newer capture replaced it)."""

    step: int
    rank: int
    kind: str
    replaced_by: int

    def to_json(self) -> dict[str, Any]:
        """The line's JSON object."""
        return {
            "event": "dropped",
            "step": self.step,
            "rank": self.rank,
            "kind": self.kind,
            "replaced_by": self.replaced_by,
        }


def append_record(run: RunDir, record: IndexWritten | IndexDropped) -> None:
    """Append one line to the run's index (locked, fsynced; see `RunDir.append_index`)."""
    run.append_index(record.to_json())


@dataclass(frozen=True)
class IndexProblem:
    """A damaged index line: its number (from 1) and what is wrong with it."""

    line: int
    reason: str


@dataclass(frozen=True)
class IndexRecord:
    """One valid line read back: step, rank and event checked, every other field checked
    by its accessor (a damaged field reads as absent)."""

    step: int
    rank: int
    event: str  # "written" or "dropped"
    raw: Mapping[str, Any]  # the whole line, unchecked

    @property
    def kind(self) -> str:
        """What the capture was for ("anomaly" when absent)."""
        return str(self.raw.get("kind", "anomaly"))

    @property
    def trace(self) -> str:
        """The trace path as written (relative; resolve with `RunDir.inside`)."""
        return str(self.raw.get("trace", ""))

    @property
    def host(self) -> str | None:
        """The rank's host name."""
        return _text(self.raw.get("host"))

    @property
    def bytes(self) -> int:
        """Size of the trace file (0 when absent or damaged)."""
        return _int(self.raw.get("bytes")) or 0

    @property
    def step_ms(self) -> float | None:
        """The step's time as the consensus saw it."""
        return _number(self.raw.get("step_ms"))

    @property
    def median_ms(self) -> float | None:
        """The detector's median at the decision."""
        return _number(self.raw.get("median_ms"))

    @property
    def threshold_ms(self) -> float | None:
        """The detector's threshold at the decision."""
        return _number(self.raw.get("threshold_ms"))

    @property
    def slowest_rank(self) -> int | None:
        """The slowest rank of the step."""
        return _int(self.raw.get("slowest_rank"))

    @property
    def request(self) -> str | None:
        """The on-demand request number that asked for the capture."""
        return _text(self.raw.get("request"))

    @property
    def tracer(self) -> str | None:
        """The tracer backend that recorded it."""
        return _text(self.raw.get("tracer"))

    @property
    def tracer_stats(self) -> dict[str, Any]:
        """The tracer's counters for the step ({} when damaged)."""
        stats = self.raw.get("tracer_stats")
        return stats if isinstance(stats, dict) else {}

    @property
    def cost_ms(self) -> dict[str, float]:
        """The capture worker's time, numbers in range only ({} for older lines)."""
        value = self.raw.get("cost_ms")
        if not isinstance(value, dict):
            return {}
        costs = {str(k): _number(v) for k, v in value.items()}
        return {k: v for k, v in costs.items() if v is not None and 0 <= v < MAX_COST_MS}


def read_index(run: RunDir) -> tuple[list[IndexRecord], list[IndexProblem]]:
    """Every readable index line in file order, and a problem for each damaged one."""
    records: list[IndexRecord] = []
    problems: list[IndexProblem] = []
    if not run.index_path.exists():
        return records, problems
    try:
        lines = list(_lines(run, problems))
    except OSError as err:  # a FIFO, a device or a directory in its place
        problems.append(IndexProblem(0, f"cannot be read ({err.strerror or err})"))
        return records, problems
    for number, raw in lines:
        if raw is None:
            problems.append(IndexProblem(number, "line too long"))
            continue
        if not raw.strip():
            continue
        try:
            body = parse_json(raw)
        except ValueError:
            problems.append(IndexProblem(number, "not JSON (truncated, corrupt or too deep)"))
            continue
        record = _valid(body)
        if record is None:
            problems.append(IndexProblem(number, "missing or invalid step/rank/event"))
            continue
        records.append(record)
    return records, problems


def _lines(run: RunDir, problems: list[IndexProblem]) -> Iterator[tuple[int, bytes | None]]:
    """(number, line) for each line, at most MAX_INDEX_LINES; a line over MAX_INDEX_LINE
    is skipped in chunks, never held whole, and given as None."""
    with os.fdopen(open_regular(run.index_path), "rb") as handle:
        number = 0
        while True:
            raw = handle.readline(MAX_INDEX_LINE + 1)
            if not raw:
                return
            number += 1
            if number > MAX_INDEX_LINES:
                problems.append(IndexProblem(number, f"more than {MAX_INDEX_LINES} lines"))
                return
            if len(raw) > MAX_INDEX_LINE:
                while raw and not raw.endswith(b"\n"):
                    raw = handle.readline(MAX_INDEX_LINE + 1)
                yield number, None
                continue
            yield number, raw


def _valid(body: Any) -> IndexRecord | None:
    if not isinstance(body, dict):
        return None
    step, rank, event = _int(body.get("step")), _int(body.get("rank")), body.get("event")
    if step is None or not 0 <= step < MAX_STEP or rank is None or not 0 <= rank < MAX_RANK:
        return None
    if event not in ("written", "dropped"):
        return None
    return IndexRecord(step, rank, event, body)


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
