"""hangs/hang_<N>/rank<R>.json: what one rank saw when it judged the job hung.

Written by the rank's hang watch (`distanom.hang`), one file per rank per hang, where N
counts the hangs this rank detected (1, 2, ... : a job that recovers and hangs again
gets a second folder). Read by the hang verdict (`distanom.analysis.hangs`) and so by
`distanom report` and `distanom status`. A record holds the Python stacks of the rank's
threads (innermost frame last, bounded), its Flight Recorder summary per process group
(in-flight and latest collectives with their sequence ids), its last completed step and
when and why it was written. Version 1; a reader refuses other versions with a one-line
error. No torch here.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from distanom.errors import RunDirError
from distanom.records.run_info import MAX_WORLD_SIZE
from distanom.rundir import RunDir, read_json

__all__ = [
    "CAUSE_NO_STEP",
    "CAUSE_ROUND_TIMEOUT",
    "HANGS_DIR",
    "RECORD_VERSION",
    "Collective",
    "Frame",
    "GroupCollectives",
    "HangRecord",
    "ThreadStack",
    "hang_dirs",
    "hang_numbers",
    "hang_ranks",
    "read_hang_record",
    "record_path",
    "write_hang_record",
]

RECORD_VERSION = 1
HANGS_DIR = "hangs"
CAUSE_NO_STEP = "no_step"  # no step ended for the limit
CAUSE_ROUND_TIMEOUT = "round_timeout"  # a consensus round timed out or lost a peer
# bounds on what a reader takes from a (shared, possibly hostile) run directory: a record
# is a few kB; folders beyond these counts are left unread
MAX_RECORD_BYTES = 4 << 20
MAX_ENTRIES = 1 << 17
MAX_HANGS = 64  # the latest hang folders read
MAX_THREADS = 256
MAX_GROUPS = 256
MAX_FRAMES = 256  # per thread
MAX_COLLECTIVES = 1024  # per group and list
MAX_SIZES = 64  # per collective
MAX_INT = 2**63  # integers a record may hold, either sign
MAX_TEXT = 4096  # characters kept of a one-line field
_HANG_FOLDER = re.compile(r"^hang_([0-9]{1,9})$")
_RANK_FILE = re.compile(r"^rank([0-9]{1,7})\.json$")


@dataclass(frozen=True)
class Frame:
    """One Python frame: where it is and the line it runs."""

    file: str
    line: int
    function: str
    code: str

    def text(self) -> str:
        """The frame as one line: `file:line in function: code`."""
        where = f"{self.file}:{self.line} in {self.function}"
        return f"{where}: {self.code}" if self.code else where


@dataclass(frozen=True)
class ThreadStack:
    """A thread's stack, innermost frame last; `training` marks the training thread."""

    ident: int
    name: str
    training: bool
    frames: list[Frame]
    truncated: bool = False
    """Outer frames were left out (more than hang.max_frames)."""


@dataclass(frozen=True)
class Collective:
    """One Flight Recorder entry: a collective of a process group."""

    seq: int
    """The group's collective sequence id (the n-th collective this rank entered on it)."""
    op: str
    state: str
    completed: bool
    created_ns: int
    """Wall clock (ns since the epoch) at which the rank enqueued it."""
    sizes: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class GroupCollectives:
    """One process group's collectives as this rank's Flight Recorder saw them."""

    group: str
    last_enqueued: int
    last_completed: int
    in_flight: list[Collective]
    recent: list[Collective]
    """The latest entries, oldest first (bounded by hang.max_collectives)."""


@dataclass(frozen=True)
class HangRecord:
    """What one rank saw when it judged the job hung."""

    rank: int
    world_size: int
    host: str
    pid: int
    number: int
    """This rank's count of hangs, from 1: the folder hang_<number>."""
    detected_at: float
    """Wall clock (s since the epoch)."""
    cause: str
    """CAUSE_NO_STEP or CAUSE_ROUND_TIMEOUT."""
    reason: str
    """One line: what the watch saw."""
    last_step: int
    """The last step this rank completed, -1 for none."""
    silent_s: float
    """Seconds since the last step ended (or since the watch started)."""
    after_s: float
    """The limit the watch judged by."""
    threads: list[ThreadStack]
    flight_recorder: list[GroupCollectives] | None
    """None: no Flight Recorder entries (not enabled, or unavailable in this torch)."""
    flight_recorder_note: str | None = None
    """Why there are no entries, when there are none."""

    def training_thread(self) -> ThreadStack | None:
        """The training thread's stack (else the main thread's), None when neither was seen."""
        for stack in self.threads:
            if stack.training:
                return stack
        return next((s for s in self.threads if s.name == "MainThread"), None)

    def as_json(self) -> dict[str, Any]:
        """The record as written to disk."""
        return {"version": RECORD_VERSION, **asdict(self)}


def record_path(run: RunDir, number: int, rank: int) -> Path:
    """Where rank `rank` writes its record of its `number`-th hang."""
    return run.path / HANGS_DIR / f"hang_{number}" / f"rank{rank}.json"


def write_hang_record(run: RunDir, record: HangRecord) -> Path:
    """Write `record` atomically, making hangs/ and its folder without following a link
    planted there (UnsafePathError); returns its path."""
    path = record_path(run, record.number, record.rank)
    data = (json.dumps(record.as_json(), indent=1, allow_nan=False) + "\n").encode()
    run.write_capture_file(path, data)
    return path


def hang_dirs(run: RunDir) -> dict[int, dict[int, Path]]:
    """The latest `MAX_HANGS` hang folders' rank records: {hang number: {rank: path}}, in
    number order (a job hangs once or twice; planted folders beyond these are not read)."""
    return {number: hang_ranks(run, number) for number in hang_numbers(run)}


def hang_numbers(run: RunDir) -> list[int]:
    """The numbers of the latest `MAX_HANGS` hang folders (of the first MAX_ENTRIES
    entries of hangs/), ascending; [] when hangs/ is missing or a link."""
    base = run.path / HANGS_DIR
    numbers = []
    try:
        entries = itertools.islice(base.iterdir(), MAX_ENTRIES) if _real_dir(base) else ()
        for entry in entries:
            match = _HANG_FOLDER.match(entry.name)
            if match is not None:
                numbers.append(int(match.group(1)))
    except OSError:
        return []
    return sorted(numbers)[-MAX_HANGS:]


def hang_ranks(run: RunDir, number: int) -> dict[int, Path]:
    """One hang folder's rank records, {rank: path} in rank order ({} when the folder is
    missing or a link; files that are links are left out)."""
    folder = run.path / HANGS_DIR / f"hang_{number}"
    ranks: dict[int, Path] = {}
    try:
        if not _real_dir(folder):
            return {}
        for path in itertools.islice(folder.iterdir(), MAX_ENTRIES):
            rank_match = _RANK_FILE.match(path.name)
            if rank_match is not None and path.is_file() and not path.is_symlink():
                ranks[int(rank_match.group(1))] = path
    except OSError:
        return {}
    return dict(sorted(ranks.items()))


def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def read_hang_record(path: Path) -> HangRecord:
    """A hang record read back; RunDirError naming the file when damaged."""
    body = read_json(path, MAX_RECORD_BYTES)
    if not isinstance(body, dict):
        raise RunDirError(f"{path}: not a hang record (expected an object)")
    version = body.get("version")
    if version != RECORD_VERSION:
        raise RunDirError(f"{path}: hang record version {version!r} is not {RECORD_VERSION}")
    try:
        fr = body.get("flight_recorder")
        note = body.get("flight_recorder_note")
        return HangRecord(
            rank=_bounded(_int(body["rank"]), 0, MAX_WORLD_SIZE - 1, "rank"),
            world_size=_bounded(_int(body["world_size"]), 1, MAX_WORLD_SIZE, "world_size"),
            host=_line(body["host"]),
            pid=_int(body["pid"]),
            number=_int(body["number"]),
            detected_at=_float(body["detected_at"]),
            cause=_line(body["cause"]),
            reason=_line(body["reason"]),
            last_step=_int(body["last_step"]),
            silent_s=_float(body["silent_s"]),
            after_s=_float(body["after_s"]),
            threads=[_thread(t) for t in body["threads"][:MAX_THREADS]],
            flight_recorder=None if fr is None else [_group(g) for g in fr[:MAX_GROUPS]],
            flight_recorder_note=None if note is None else _line(note),
        )
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
        raise RunDirError(f"{path}: damaged hang record ({type(err).__name__}: {err})") from None


def _int(value: Any) -> int:
    """An integer field: a JSON integer within +-2**63 (not a bool, a float or text)."""
    if isinstance(value, bool) or not isinstance(value, int) or not -MAX_INT <= value < MAX_INT:
        raise ValueError(f"not an integer in range: {str(value)[:40]!r}")
    return value


def _float(value: Any) -> float:
    """A number field: finite (inf, nan and overflowing literals are damage)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"not a number: {str(value)[:40]!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"not a finite number: {number}")
    return number


def _line(value: Any) -> str:
    """A one-line text field: line breaks shown as escapes (they would forge lines in
    the report), at most `MAX_TEXT` characters."""
    text = str(value)[:MAX_TEXT]
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _bounded(value: int, low: int, high: int, what: str) -> int:
    if not low <= value <= high:
        raise ValueError(f"{what} {value} outside {low}..{high}")
    return value


def _thread(body: dict[str, Any]) -> ThreadStack:
    return ThreadStack(
        ident=_int(body["ident"]),
        name=_line(body["name"]),
        training=bool(body["training"]),
        frames=[
            Frame(_line(f["file"]), _int(f["line"]), _line(f["function"]), _line(f["code"]))
            for f in body["frames"][:MAX_FRAMES]
        ],
        truncated=bool(body.get("truncated", False)),
    )


def _collective(body: dict[str, Any]) -> Collective:
    return Collective(
        seq=_int(body["seq"]),
        op=_line(body["op"]),
        state=_line(body["state"]),
        completed=bool(body["completed"]),
        created_ns=_int(body["created_ns"]),
        sizes=list(body.get("sizes") or [])[:MAX_SIZES],
    )


def _group(body: dict[str, Any]) -> GroupCollectives:
    return GroupCollectives(
        group=_line(body["group"]),
        last_enqueued=_int(body["last_enqueued"]),
        last_completed=_int(body["last_completed"]),
        in_flight=[_collective(c) for c in body["in_flight"][:MAX_COLLECTIVES]],
        recent=[_collective(c) for c in body["recent"][:MAX_COLLECTIVES]],
    )
