"""Many runs read for `distanom hosts`: which rank each run blamed, on which host.

`scan_runs(folders)` finds the runs under the folders given (a folder of runs, or a run
itself), groups the copies of one run that several nodes wrote under their own run
directories (same run id), and reads from each run, through `distanom.records`:

- run.json: the host of each rank; a rank's local rank is its place among the ranks of
  its host, in rank order (torchrun numbers a node's ranks contiguously);
- anomalies.jsonl: each judged step's evidence verdict (`analysis.anomalies.judge`, the
  report's rules 2-3), or the trace verdict the report left in the capture's
  summary.json when it names a cause (the report's rule 1). Traces are never parsed: a
  scan of thousands of runs must take seconds;
- stragglers.json: the ranks named stragglers, now or earlier in the run;
- hangs/: each hang's culprit (`analysis.hangs.judge_hang`), over every copy's records.

Each becomes an `Implication` (kind, rank, host, local rank, cause, step) that
`distanom.analysis.hosts` tallies. Every read is bounded (runs per folder, lines and
bytes per journal, stragglers and hangs per run) and never follows a link to a run, a
file or a folder; a run that cannot be read is a problem line, never an exception.
No torch here.
"""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distanom.analysis.anomalies import AnomalyVerdict, judge
from distanom.analysis.hangs import judge_hang
from distanom.errors import RunDirError
from distanom.records.anomalies import (
    ANOMALIES_FILE,
    MAX_STRAGGLERS_BYTES,
    STRAGGLERS_FILE,
    read_anomalies,
)
from distanom.records.hangs import HANGS_DIR, HangRecord, hang_dirs, read_hang_record
from distanom.records.run_info import hosts_of, world_size_of
from distanom.rundir import MAX_JSON_BYTES, RUN_JSON, RunDir, read_json

__all__ = ["KINDS", "Implication", "RunImplications", "Scan", "scan_runs"]

KINDS = ("culprit", "straggler", "hang")
MAX_ENTRIES_PER_FOLDER = 100_000  # directory entries looked at in one folder of runs
MAX_RUNS = 100_000  # runs read in one scan
MAX_ANOMALY_LINES = 4096  # per run
MAX_ANOMALY_BYTES = 64 << 20  # per run
MAX_SUMMARIES = 64  # summary.json files read per run (traced anomalies)
MAX_SUMMARY_BYTES = 4 << 20
MAX_STRAGGLERS = 64  # current + earlier entries per run
MAX_HANGS = 16  # hang folders per run
# what makes a folder a run (or one node's copy of a run): any file rank 0 or a hang writes
_RUN_MARKERS = (RUN_JSON, ANOMALIES_FILE, STRAGGLERS_FILE, HANGS_DIR)


@dataclass(frozen=True)
class Implication:
    """One time a run pointed at a rank: the culprit of a slow step, a straggler, or the
    rank a hang waited for."""

    kind: str  # one of KINDS
    rank: int | None  # None: a trace verdict that named a node, not a rank
    host: str
    local_rank: int | None
    cause: str
    step: int | None


@dataclass
class RunImplications:
    """What one run (all its copies) says about its ranks and hosts."""

    run_id: str
    paths: list[Path]
    hosts: list[str] = field(default_factory=list)  # per rank
    found: list[Implication] = field(default_factory=list)


@dataclass
class Scan:
    """Every run found under the folders, and what could not be read (one line each)."""

    folders: list[str]
    runs: list[RunImplications]
    problems: list[str]


def scan_runs(folders: Sequence[str | Path]) -> Scan:
    """Read every run under `folders` (see the module docstring)."""
    problems: list[str] = []
    copies: dict[str, list[Path]] = {}
    for folder in folders:
        for path in _run_folders(Path(folder), problems):
            copies.setdefault(path.name, []).append(path)
    runs = []
    for run_id, paths in itertools.islice(sorted(copies.items()), MAX_RUNS):
        runs.append(_read_run(run_id, paths, problems))
    if len(copies) > MAX_RUNS:
        problems.append(f"{len(copies) - MAX_RUNS} runs beyond the first {MAX_RUNS} not read")
    return Scan([str(f) for f in folders], runs, problems)


def _run_folders(folder: Path, problems: list[str]) -> Iterable[Path]:
    """`folder` itself when it is a run, else its sub-folders that are runs (links and
    anything not a folder skipped; at most MAX_ENTRIES_PER_FOLDER entries looked at)."""
    if not folder.is_dir():
        problems.append(f"{folder}: no such folder")
        return []
    if _is_run(folder):
        return [folder]
    found = []
    try:
        with os.scandir(folder) as entries:
            for entry in itertools.islice(entries, MAX_ENTRIES_PER_FOLDER):
                if entry.is_dir(follow_symlinks=False) and _is_run(Path(entry.path)):
                    found.append(Path(entry.path))
    except OSError as err:
        problems.append(f"{folder}: cannot list: {err.strerror}")
    if not found:
        problems.append(f"{folder}: no distanom runs in it")
    return found


def _is_run(path: Path) -> bool:
    for name in _RUN_MARKERS:
        try:
            os.lstat(path / name)
            return True
        except OSError:
            continue
    return False


def _read_run(run_id: str, paths: list[Path], problems: list[str]) -> RunImplications:
    out = RunImplications(run_id, paths)
    info = _first_run_info(paths, problems)
    out.hosts = hosts_of(info) if info is not None else []
    if not out.hosts:
        problems.append(f"{_names(paths)}: no hosts in run.json: the run is left out")
        return out
    world = world_size_of(info) if info is not None else 1
    gpus = _local_ranks(out.hosts)
    place = _Placer(run_id, out.hosts, gpus, problems)
    for path in paths:
        run = RunDir(path)
        out.found += _verdicts(run, place)
        out.found += _stragglers(run, place, problems)
    out.found += _hangs(paths, max(world, len(out.hosts)), place, problems)
    return out


def _names(paths: list[Path]) -> str:
    return ", ".join(str(p) for p in paths)


def _first_run_info(paths: list[Path], problems: list[str]) -> dict[str, Any] | None:
    """run.json from the first copy that has one (rank 0's node writes it)."""
    for path in paths:
        if not os.path.lexists(path / RUN_JSON):
            continue
        try:
            info = read_json(path / RUN_JSON, MAX_JSON_BYTES, follow=False)
        except (RunDirError, OSError) as err:
            problems.append(str(err))
            continue
        if isinstance(info, dict):
            return info
        problems.append(f"{path / RUN_JSON}: not a JSON object")
    return None


def _local_ranks(hosts: list[str]) -> list[int]:
    seen: dict[str, int] = {}
    local = []
    for host in hosts:
        local.append(seen.get(host, 0))
        seen[host] = local[-1] + 1
    return local


class _Placer:
    """Turns a rank named by a run file into an `Implication` (host, local rank), with
    one problem line per run for ranks outside run.json's hosts."""

    def __init__(
        self, run_id: str, hosts: list[str], local: list[int], problems: list[str]
    ) -> None:
        self.run_id, self.hosts, self.local, self.problems = run_id, hosts, local, problems
        self.warned = False

    def __call__(self, kind: str, rank: Any, cause: str, step: int | None) -> Implication | None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < len(self.hosts):
            if not self.warned:
                shown = repr(rank)[:40]
                self.problems.append(
                    f"{self.run_id}: rank {shown} is not one of run.json's "
                    f"{len(self.hosts)} ranks: left out"
                )
                self.warned = True
            return None
        return Implication(kind, rank, self.hosts[rank], self.local[rank], cause, step)


def _verdicts(run: RunDir, place: _Placer) -> list[Implication]:
    records = read_anomalies(
        run, max_lines=MAX_ANOMALY_LINES, max_bytes=MAX_ANOMALY_BYTES, follow=False
    )
    by_step = {record.step: record for record in records}
    summaries = 0
    out = []
    for record in records:
        trace = None
        if record.traced and summaries < MAX_SUMMARIES:
            summaries += 1
            trace = _trace_verdict(run, record.step)
        if trace is not None and trace.get("cause") not in (None, "unknown"):
            node = trace.get("culprit_node")
            rank = trace.get("culprit_rank")
            cause = str(trace["cause"])[:64]
            if rank is None and isinstance(node, str) and node in place.hosts:
                out.append(Implication("culprit", None, node, None, cause, record.step))
                continue
            found = place("culprit", rank, cause, record.step) if rank is not None else None
        else:
            verdict: AnomalyVerdict = judge(record, by_step.get(record.step - 1))
            found = None
            if verdict.culprit_rank is not None:
                found = place("culprit", verdict.culprit_rank, verdict.cause, record.step)
        if found is not None:
            out.append(found)
    return out


def _trace_verdict(run: RunDir, step: int) -> dict[str, Any] | None:
    """The verdict an earlier `distanom report` wrote into the capture's summary.json
    (None when there is none, or it is damaged: the evidence verdict stands)."""
    folder = run.capture_dir(step)
    try:
        if not stat.S_ISDIR(os.lstat(folder.parent).st_mode):
            return None
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return None
        body = read_json(run.summary_json(step), MAX_SUMMARY_BYTES, follow=False)
    except (OSError, RunDirError):
        return None
    verdict = body.get("verdict") if isinstance(body, dict) else None
    return verdict if isinstance(verdict, dict) else None


def _stragglers(run: RunDir, place: _Placer, problems: list[str]) -> list[Implication]:
    path = run.path / STRAGGLERS_FILE
    if not os.path.lexists(path):
        return []
    try:
        body = read_json(path, MAX_STRAGGLERS_BYTES, follow=False)
    except (RunDirError, OSError) as err:
        problems.append(str(err))
        return []
    if not isinstance(body, dict):
        problems.append(f"{path}: not a JSON object")
        return []
    entries = [
        entry
        for key in ("stragglers", "earlier")
        if isinstance(body.get(key), list)
        for entry in body[key]
        if isinstance(entry, dict)
    ]
    out = []
    for entry in entries[:MAX_STRAGGLERS]:
        since = entry.get("since_step")
        step = since if isinstance(since, int) and not isinstance(since, bool) else None
        found = place("straggler", entry.get("rank"), "straggler", step)
        if found is not None:
            out.append(found)
    return out


def _hangs(paths: list[Path], world: int, place: _Placer, problems: list[str]) -> list[Implication]:
    """Each hang's culprit, judged over the records every copy of the run holds (each
    node's copy has its own ranks' records)."""
    records_of: dict[int, dict[int, Path]] = {}
    for path in paths:
        for number, ranks in hang_dirs(RunDir(path)).items():
            records_of.setdefault(number, {}).update(ranks)
    out = []
    for number in sorted(records_of)[:MAX_HANGS]:
        records: list[HangRecord] = []
        for record_path in records_of[number].values():
            try:
                records.append(read_hang_record(record_path))
            except RunDirError as err:
                problems.append(str(err))
        if not records:
            continue
        hang = judge_hang(number, records, world)
        if hang.culprit_rank is not None:
            found = place("hang", hang.culprit_rank, "hang", hang.step)
            if found is not None:
                out.append(found)
    return out
