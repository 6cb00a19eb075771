"""anomalies.jsonl and stragglers.json: what rank 0 judged slow, with every rank's evidence.

- `anomalies.jsonl`: one line per step the detector judged anomalous, traced or not,
  appended by rank 0's control thread once every rank's evidence for the step has come
  in (or stopped waiting for it): the step's time, the median and threshold it was
  judged by, `judged_by` (which baseline: docs/evidence.md), and per rank the step's
  duration and its `StepEvidence`. Read by `distanom report` (`read_anomalies`).
- `stragglers.json`: rank 0's latest straggler scores and drift (`distanom.stragglers`),
  rewritten with the status file and at the end of the run.

`StepEvidence` is the O(1) per-rank, per-step summary the consensus round carries.
Lines that do not parse are skipped (a torn last line of a killed job). No torch here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distanom.errors import RunDirError
from distanom.rundir import FILE_MODE, RunDir, read_json, write_live_json
from distanom.safe_io import open_append_at, open_dir, open_regular, parse_json

ANOMALIES_FILE = "anomalies.jsonl"
STRAGGLERS_FILE = "stragglers.json"
FORMAT_VERSION = 1
MAX_LINES_READ = 100_000  # a report reads at most this many anomaly lines
MAX_RANKS = 131072  # per-rank entries read of a line without the run's world size
MAX_LINE_BYTES = 1 << 20
MAX_SKIP_BYTES = 4 * MAX_LINE_BYTES  # a damaged line past this ends the read
MAX_ANOMALIES_BYTES = 256 << 20  # read of anomalies.jsonl at most (100,000 lines of ~2.6 kB)
MAX_STRAGGLERS_BYTES = 4 << 20  # a line holds one step's evidence for every rank


@dataclass(frozen=True)
class StepEvidence:
    """One rank's evidence for one step (NaN where not known)."""

    arrive_ms: float = math.nan  # enqueue of the step's last collective, after the step began
    collectives: int = -1  # collectives the rank enqueued in the step (-1: not recorded)
    cpu_ms: float = math.nan  # the training thread's CPU time during the step
    gc_ms: float = math.nan  # Python garbage collection during the step
    host_ms: float = math.nan  # the step's host wall time, from boundary to boundary

    FIELDS = 5  # floats per step in a consensus row (`as_fields`)

    @classmethod
    def of_values(
        cls, arrive_ms: float, collectives: int, cpu_ms: float, gc_ms: float, host_ms: float
    ) -> StepEvidence:
        """The same evidence as the constructor, made without the frozen dataclass's
        `object.__setattr__` per field: the control thread makes one per step."""
        evidence = object.__new__(cls)
        fields = evidence.__dict__
        fields["arrive_ms"] = arrive_ms
        fields["collectives"] = collectives
        fields["cpu_ms"] = cpu_ms
        fields["gc_ms"] = gc_ms
        fields["host_ms"] = host_ms
        return evidence

    def as_fields(self) -> list[float]:
        """The evidence as the floats a consensus row carries (`from_fields` reads them)."""
        return [self.arrive_ms, float(self.collectives), self.cpu_ms, self.gc_ms, self.host_ms]

    @classmethod
    def from_fields(cls, values: Any) -> StepEvidence:
        """Read back `as_fields` (any sequence of `FIELDS` floats)."""
        arrive, collectives, cpu, gc_ms, host = (float(v) for v in values)
        count = int(collectives) if math.isfinite(collectives) else -1
        return cls(arrive, count, cpu, gc_ms, host)

    def to_json(self) -> dict[str, float | int | None]:
        """JSON-ready (NaN as null)."""
        return {
            "arrive_ms": _num(self.arrive_ms),
            "collectives": self.collectives,
            "cpu_ms": _num(self.cpu_ms),
            "gc_ms": _num(self.gc_ms),
            "host_ms": _num(self.host_ms),
        }

    @classmethod
    def from_json(cls, data: Any) -> StepEvidence:
        """Read back what `to_json` wrote (missing or bad fields as unknown)."""
        if not isinstance(data, dict):
            return cls()
        return cls(
            _float(data.get("arrive_ms")),
            int(_float(data.get("collectives"), -1.0)),
            _float(data.get("cpu_ms")),
            _float(data.get("gc_ms")),
            _float(data.get("host_ms")),
        )


@dataclass(frozen=True)
class AnomalyRecord:
    """One judged anomalous step as rank 0 wrote it."""

    step: int
    step_ms: float  # as judged (own capture work discounted)
    median_ms: float
    threshold_ms: float
    traced: bool
    judged_by: str  # the baseline: "condition", "all_conditions", "all_steps", "ranks"
    slowest_rank: int
    durations_ms: tuple[float, ...]  # per rank
    evidence: tuple[StepEvidence, ...]  # per rank
    arrive_median_ms: tuple[float, ...] = ()  # per rank, over recent steps
    cpu_median_ms: tuple[float, ...] = ()  # per rank, over recent steps

    @property
    def ratio(self) -> float:
        """The step's time over the median (NaN without one)."""
        return self.step_ms / self.median_ms if self.median_ms > 0 else math.nan

    def to_json(self) -> dict[str, Any]:
        """The line's body."""
        return {
            "v": FORMAT_VERSION,
            "step": self.step,
            "step_ms": _num(self.step_ms),
            "median_ms": _num(self.median_ms),
            "threshold_ms": _num(self.threshold_ms),
            "traced": self.traced,
            "judged_by": self.judged_by,
            "slowest_rank": self.slowest_rank,
            "durations_ms": [_num(v) for v in self.durations_ms],
            "evidence": [e.to_json() for e in self.evidence],
            "arrive_median_ms": [_num(v) for v in self.arrive_median_ms],
            "cpu_median_ms": [_num(v) for v in self.cpu_median_ms],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], world_size: int | None = None) -> AnomalyRecord:
        """Read one line back (raises KeyError/TypeError/ValueError on a malformed one).
        A step must be an integer in 0..2**53; per-rank lists are read for at most
        `world_size` ranks (the run's, from run.json; else `MAX_RANKS`), so a line cannot
        make the reader build more than the world holds."""
        step = data["step"]
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**53:
            raise ValueError(f"step {str(step)[:40]!r} is not a step number")
        ranks = min(world_size or MAX_RANKS, MAX_RANKS)
        slowest = data.get("slowest_rank", -1)
        return cls(
            step=step,
            step_ms=_float(data.get("step_ms")),
            median_ms=_float(data.get("median_ms")),
            threshold_ms=_float(data.get("threshold_ms")),
            traced=bool(data.get("traced", False)),
            judged_by=str(data.get("judged_by", "condition"))[:64].replace("\n", " "),
            slowest_rank=slowest if isinstance(slowest, int) and 0 <= slowest < ranks else -1,
            durations_ms=tuple(_float(v) for v in _first(data.get("durations_ms"), ranks)),
            evidence=tuple(StepEvidence.from_json(e) for e in _first(data.get("evidence"), ranks)),
            arrive_median_ms=tuple(_float(v) for v in _first(data.get("arrive_median_ms"), ranks)),
            cpu_median_ms=tuple(_float(v) for v in _first(data.get("cpu_median_ms"), ranks)),
        )


def _first(values: Any, count: int) -> list[Any]:
    """The first `count` items of a JSON list ([] for anything else)."""
    return values[:count] if isinstance(values, list) else []


def anomalies_path(run: RunDir) -> Path:
    """Where rank 0 appends judged anomalies."""
    return run.path / ANOMALIES_FILE


def stragglers_path(run: RunDir) -> Path:
    """Where rank 0 keeps its latest straggler scores."""
    return run.path / STRAGGLERS_FILE


class AnomalyWriter:
    """Appends anomaly lines (rank 0's control thread only); one open file, line-buffered."""

    def __init__(self, run: RunDir) -> None:
        # never through a link or into a FIFO someone planted in the shared run directory
        with open_dir(run.path) as folder:
            fd = open_append_at(folder, ANOMALIES_FILE, FILE_MODE)
        self._file = os.fdopen(fd, "a", encoding="utf-8", buffering=1)

    def write(self, record: AnomalyRecord) -> None:
        """Append one line."""
        self._file.write(json.dumps(record.to_json(), allow_nan=False) + "\n")

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def read_anomalies(
    run: RunDir,
    *,
    max_lines: int = MAX_LINES_READ,
    max_bytes: int | None = None,
    follow: bool = True,
    world_size: int | None = None,
) -> list[AnomalyRecord]:
    """Every readable anomaly line of the run, in step order ([] without the file): the
    first `max_lines` lines, and no more than `max_bytes` read (None: no budget beyond
    the lines'); a link is not read when `follow` is False."""
    path = anomalies_path(run)
    if not path.is_file():
        return []
    records: dict[int, AnomalyRecord] = {}
    try:
        handle = os.fdopen(open_regular(path, follow=follow), "rb")
    except OSError:
        return []
    budget = MAX_ANOMALIES_BYTES if max_bytes is None else max_bytes
    with handle:
        for _ in range(max_lines):
            line = handle.readline(MAX_LINE_BYTES + 1)
            budget -= len(line)
            if not line or budget < 0:
                break
            if len(line) > MAX_LINE_BYTES:
                # damage: a line this long is none rank 0 writes, and past a few of its
                # chunks the rest of the file is not trusted (a sparse file with no line
                # break would otherwise be read for its whole apparent size)
                skipped = len(line)
                while line and not line.endswith(b"\n") and skipped <= MAX_SKIP_BYTES:
                    line = handle.readline(MAX_LINE_BYTES + 1)
                    skipped += len(line)
                budget -= skipped
                if skipped > MAX_SKIP_BYTES:
                    break
                continue
            try:
                record = AnomalyRecord.from_json(parse_json(line), world_size)
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
                continue
            records[record.step] = record
    return [records[s] for s in sorted(records)]


def write_stragglers(run: RunDir, body: dict[str, Any], *, final: bool = True) -> None:
    """Rewrite stragglers.json atomically (a live file: fsynced when `final`)."""
    write_live_json(stragglers_path(run), {"v": FORMAT_VERSION, **body}, final=final)


MAX_STRAGGLER_ENTRIES = 64  # entries kept of each list (the scorer writes at most 16 earlier)
# the fields each entry may hold, as (kind, key): what a reader keeps of a (possibly
# planted) file; anything else, and any entry whose kept fields are not all valid, goes
_STRAGGLER_FIELDS = (("int", "rank"), ("num", "score"), ("int", "since_step"))
_EVIDENCE_FIELDS = (
    ("int", "late_steps"), ("int", "window_steps"), ("num", "mean_late_ms"),
    ("num", "run_score"), ("int", "run_late_steps"),
)  # fmt: skip
_EARLIER_FIELDS = (("int", "rank"), ("int", "since_step"), ("int", "until_step"),
                   ("num", "peak_score"))  # fmt: skip
_DRIFT_FIELDS = (("num", "ratio"), ("num", "first_ms"), ("num", "last_ms"),
                 ("int", "window_steps"), ("int", "from_step"))  # fmt: skip


def read_stragglers(run: RunDir) -> dict[str, Any]:
    """stragglers.json's body ({} without a readable file), checked field by field:
    finite numbers, integers within a step's range, at most `MAX_STRAGGLER_ENTRIES` of
    each list; an entry whose identifying fields are missing or damaged is dropped, a
    damaged detail is left out."""
    path = stragglers_path(run)
    if not path.is_file():
        return {}
    try:
        data = read_json(path, MAX_STRAGGLERS_BYTES)
    except RunDirError:
        return {}
    if not isinstance(data, dict):
        return {}
    stragglers = []
    for entry in _entries(data.get("stragglers")):
        kept = _checked(entry, _STRAGGLER_FIELDS, required=3)
        if kept is not None:
            evidence = _checked(entry.get("evidence"), _EVIDENCE_FIELDS, required=0)
            stragglers.append({**kept, "evidence": evidence or {}})
    earlier = []
    for entry in _entries(data.get("earlier")):
        kept = _checked(entry, _EARLIER_FIELDS, required=2)
        if kept is not None:
            earlier.append(kept)
    scored = data.get("scored_steps")
    return {
        "stragglers": stragglers,
        "drift": _checked(data.get("drift"), _DRIFT_FIELDS, required=1),
        "earlier": earlier,
        "scored_steps": scored if _valid("int", scored) else None,
    }


def _entries(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        return []
    return [entry for entry in value[:MAX_STRAGGLER_ENTRIES] if isinstance(entry, dict)]


def _valid(kind: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind == "int":
        return isinstance(value, int) and 0 <= value < 2**53
    return math.isfinite(value) and abs(value) < 1e15


def _checked(
    entry: Any, fields: tuple[tuple[str, str], ...], *, required: int
) -> dict[str, Any] | None:
    """The entry's fields that `fields` names and that are valid; None when it is not
    an object or one of the first `required` fields is missing or damaged."""
    if not isinstance(entry, dict):
        return None
    kept = {}
    for position, (kind, key) in enumerate(fields):
        value = entry.get(key)
        if _valid(kind, value):
            kept[key] = value
        elif position < required:
            return None
    return kept


def _num(value: float, digits: int = 3) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


def _float(value: Any, default: float = math.nan) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return default
    return out if math.isfinite(out) else default
