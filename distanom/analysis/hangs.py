"""The hang verdict: which rank the others wait for, read from every rank's hang record.

Reads `hangs/hang_<N>/rank<R>.json` (`records.hangs`); used by the report (`build`),
`distanom status` (`live`) and rank 0's hang watch, which logs the verdict. The rules, in
order (the first that names a rank decides):

1. Flight Recorder: in a process group where some rank waits in collective #S, the rank
   whose last entered collective is below S never entered it (the most behind first);
2. a rank of the job that wrote no record: its process is gone or stuck outside Python;
3. the rank whose last completed step is behind the others';
4. the one rank whose training thread is in the script's own code while every other
   rank's waits inside torch (a collective, the autograd engine).

Otherwise no rank stands out. No torch here; the Flight Recorder analyzer torch ships
lives in torch.distributed, which the report side does not import, and reads full dumps
rather than the summaries a hang record keeps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distanom.errors import RunDirError
from distanom.records.hangs import (
    Collective,
    HangRecord,
    hang_numbers,
    hang_ranks,
    read_hang_record,
)
from distanom.rundir import RunDir

__all__ = [
    "Hang",
    "HangRank",
    "hang_lines",
    "judge_hang",
    "read_hang",
    "read_hangs",
    "waits_in_torch",
]

# A training thread with a frame in one of these waits on other ranks (rule 4).
_TORCH_WAITS = ("/torch/distributed/", "/torch/nn/parallel/", "/torch/autograd/")
# Frames from these paths are libraries, not the script (the culprit's frame named).
_LIBRARY_PATHS = ("/lib/python3", "site-packages", "dist-packages", "<frozen", "/distanom/")
STACK_FRAMES_SHOWN = 12  # frames of a stack the text report and status print
MISSING_LISTED = 32  # ranks without a record listed one by one; the rest are counted


@dataclass(frozen=True)
class HangRank:
    """One rank's part of a hang: its training thread's stack, where it is among the
    collectives, its last completed step (None: it wrote no record)."""

    stack: list[str]
    """The training thread's frames as `file:line in function: code`, innermost last."""
    collective: dict[str, Any] | None
    """The collective it waits in, or its latest one: group, op, seq, completed."""
    last_step: int | None
    reason: str | None
    """What its watch saw (None: no record)."""

    def as_json(self) -> dict[str, Any]:
        """The rank as the report's `hangs[].ranks` holds it."""
        return {"stack": self.stack, "collective": self.collective, "last_step": self.last_step}


@dataclass(frozen=True)
class Hang:
    """One hang of the job and its verdict."""

    number: int
    step: int | None
    """The step in progress when the job hung (the culprit's, else the earliest)."""
    detected_at: float | None
    """When the first rank detected it (s since the epoch)."""
    culprit_rank: int | None
    cause: str
    ranks: dict[int, HangRank]
    unlisted: int = 0
    """Ranks past the first MISSING_LISTED without a record: counted, not listed."""

    def summary(self) -> str:
        """The verdict in one line."""
        where = f"step {self.step}" if self.step is not None else "an unknown step"
        if self.culprit_rank is None:
            return f"hung at {where}: {self.cause}"
        return f"hung at {where}: culprit rank {self.culprit_rank}: {self.cause}"

    def as_json(self) -> dict[str, Any]:
        """The hang as the report's `hangs` list holds it."""
        return {
            "step": self.step,
            "detected_at": self.detected_at,
            "culprit_rank": self.culprit_rank,
            "cause": self.cause,
            "ranks": {str(rank): entry.as_json() for rank, entry in sorted(self.ranks.items())},
            "ranks_unlisted": self.unlisted,
        }


def read_hang(run: RunDir, number: int) -> tuple[list[HangRecord], list[str]]:
    """The records of hang `number` and the problems met reading them."""
    records, problems = [], []
    for path in hang_ranks(run, number).values():
        try:
            records.append(read_hang_record(path))
        except RunDirError as err:
            problems.append(str(err))
    return records, problems


def read_hangs(runs: RunDir | Sequence[RunDir], world_size: int) -> tuple[list[Hang], list[str]]:
    """Every hang of the run with its verdict, in order, and the problems met; a run in
    several copies (one per node) has each hang's records from all of them."""
    copies = [runs] if isinstance(runs, RunDir) else list(runs)
    by_number: dict[int, dict[int, HangRecord]] = {}
    problems: list[str] = []
    for run in copies:
        for number in hang_numbers(run):
            records, found = read_hang(run, number)
            problems.extend(found)
            held = by_number.setdefault(number, {})
            for record in records:
                held.setdefault(record.rank, record)
    hangs = [
        judge_hang(number, [held[rank] for rank in sorted(held)], world_size)
        for number, held in sorted(by_number.items())
        if held
    ]
    return hangs, problems


def judge_hang(number: int, records: list[HangRecord], world_size: int) -> Hang:
    """The verdict of one hang from the records its ranks wrote (see the module rules)."""
    # the run's world size (run.json, or the live job's), never the largest a record
    # claims: a planted record must not list a million missing ranks; a record for a
    # rank outside the world is not the job's
    world = world_size
    by_rank = {r.rank: r for r in records if 0 <= r.rank < world}
    culprit, cause = _by_collectives(by_rank)
    # the first MISSING_LISTED ranks without a record (a world of 10^5 is not walked)
    missing = list(itertools.islice((r for r in range(world) if r not in by_rank), MISSING_LISTED))
    if culprit is None and missing:
        culprit = missing[0]
        cause = (
            f"rank {culprit} wrote no hang record while "
            f"{_ranks(sorted(by_rank))} did: its process is gone or stuck outside Python"
        )
    if culprit is None:
        culprit, cause = _by_steps(by_rank)
    if culprit is None:
        culprit, cause = _by_stacks(by_rank)
    ranks = {rank: _rank(record) for rank, record in sorted(by_rank.items())}
    for rank in missing:
        ranks[rank] = HangRank([], None, None, None)
    if culprit is None:
        cause = "every rank stopped; no rank stands out (no Flight Recorder entries to compare)"
    elif culprit in by_rank:
        top = _top_frame(by_rank[culprit])
        if top:
            cause = f"{cause}; its training thread is at {top}"
    culprit_record = by_rank.get(culprit) if culprit is not None else None
    if culprit_record is not None:
        step: int | None = culprit_record.last_step + 1
    else:
        step = min((r.last_step + 1 for r in records), default=None)
    return Hang(
        number=number,
        step=step,
        detected_at=min((r.detected_at for r in records), default=None),
        culprit_rank=culprit,
        cause=cause or "",
        ranks=ranks,
        unlisted=world - len(by_rank) - len(missing),
    )


def waits_in_torch(record: HangRecord) -> bool:
    """Whether the rank's training thread waits inside torch (collective, autograd)."""
    stack = record.training_thread()
    if stack is None:
        return False
    return any(any(part in frame.file for part in _TORCH_WAITS) for frame in stack.frames)


def _by_collectives(by_rank: dict[int, HangRecord]) -> tuple[int | None, str | None]:
    groups = sorted({g.group for r in by_rank.values() for g in r.flight_recorder or []})
    for group in groups:
        entered: dict[int, int] = {}
        waiting: dict[int, Collective] = {}
        for rank, record in by_rank.items():
            for summary in record.flight_recorder or []:
                if summary.group == group:
                    entered[rank] = summary.last_enqueued
                    if summary.in_flight:
                        waiting[rank] = summary.in_flight[-1]
        if not waiting:
            continue
        target = max(waiting.values(), key=lambda c: c.seq)
        behind = sorted((seq, rank) for rank, seq in entered.items() if seq < target.seq)
        if behind:
            rank = behind[0][1]
            waiters = sorted(r for r, c in waiting.items() if c.seq == target.seq)
            return rank, (
                f"rank {rank} never entered {target.op} #{target.seq} on {group} "
                f"(its last was #{behind[0][0]}), which {_ranks(waiters)} "
                f"{'waits' if len(waiters) == 1 else 'wait'} in"
            )
    return None, None


def _by_steps(by_rank: dict[int, HangRecord]) -> tuple[int | None, str | None]:
    if len(by_rank) < 2:
        return None, None
    steps = {rank: record.last_step for rank, record in by_rank.items()}
    low, high = min(steps.values()), max(steps.values())
    if low == high:
        return None, None
    rank = min(r for r, s in steps.items() if s == low)
    return rank, f"rank {rank} is behind: its last completed step is {low}, others reached {high}"


def _by_stacks(by_rank: dict[int, HangRecord]) -> tuple[int | None, str | None]:
    if len(by_rank) < 2:
        return None, None
    outside = [rank for rank, record in sorted(by_rank.items()) if not waits_in_torch(record)]
    if len(outside) != 1:
        return None, None
    rank = outside[0]
    others = sorted(r for r in by_rank if r != rank)
    return rank, (
        f"rank {rank}'s training thread is in the script's own code while "
        f"{_ranks(others)} {'waits' if len(others) == 1 else 'wait'} inside torch"
    )


def _rank(record: HangRecord) -> HangRank:
    stack = record.training_thread()
    frames = [frame.text() for frame in stack.frames] if stack is not None else []
    return HangRank(frames, _collective(record), record.last_step, record.reason)


def _collective(record: HangRecord) -> dict[str, Any] | None:
    """The collective the rank waits in (the latest in flight of any group), else the
    latest it entered."""
    groups = record.flight_recorder or []
    waiting = [(g.group, c) for g in groups for c in g.in_flight]
    latest = [(g.group, g.recent[-1]) for g in groups if g.recent]
    pool = waiting or latest
    if not pool:
        return None
    group, collective = max(pool, key=lambda gc: gc[1].created_ns)
    return {
        "group": group,
        "op": collective.op,
        "seq": collective.seq,
        "completed": collective.completed,
    }


def _top_frame(record: HangRecord) -> str | None:
    """The innermost frame of the script's own code (not the standard library nor an
    installed package), else the innermost frame."""
    stack = record.training_thread()
    if stack is None or not stack.frames:
        return None
    own = [f for f in stack.frames if not any(part in f.file for part in _LIBRARY_PATHS)]
    frame = (own or stack.frames)[-1]
    return f"{frame.file}:{frame.line} in {frame.function}"


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "no rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def hang_lines(hang: Hang, frames: int = STACK_FRAMES_SHOWN) -> list[str]:
    """The hang for people (report text, `distanom status`): the verdict, then each rank's
    collective and last step, and the culprit's stack (innermost `frames` frames)."""
    lines = [f"HANG {hang.number}: {hang.summary()}"]
    for rank, entry in sorted(hang.ranks.items()):
        if entry.last_step is None:
            lines.append(f"  rank {rank}: no hang record")
            continue
        where = _collective_text(entry.collective)
        lines.append(f"  rank {rank}: last step {entry.last_step}; {where}")
    if hang.unlisted:
        lines.append(f"  {hang.unlisted} more rank(s): no hang record")
    culprit = hang.ranks.get(hang.culprit_rank) if hang.culprit_rank is not None else None
    if culprit is not None and culprit.stack:
        lines.append(f"  rank {hang.culprit_rank}'s training thread (innermost last):")
        if len(culprit.stack) > frames:
            lines.append(f"    ... {len(culprit.stack) - frames} outer frame(s)")
        lines += [f"    {frame}" for frame in culprit.stack[-frames:]]
    return lines


def _collective_text(collective: dict[str, Any] | None) -> str:
    if collective is None:
        return "no Flight Recorder entries"
    state = "entered, finished" if collective["completed"] else "waits in it"
    return f"{collective['op']} #{collective['seq']} on {collective['group']} ({state})"
