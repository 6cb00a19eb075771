"""The run directory contract: where every file of a run lives, and how it is written.

```
<base>/<run-id>/
  run.json                         config snapshot, world, hosts, versions (rank 0)
  status.json                      live state of the job, rewritten by rank 0
  steps/rank<R>.csv                every step on rank R (append-only)
  captures/step_<N>/
      rank<R>.trace.json.gz        rank R's Kineto chrome trace of step N
      rank<R>.gpu_timeline.csv     TraceLens-compatible tables of that trace
      rank<R>.kernel_summary.csv   (rank<R>.cpu_timeline.csv for a CPU-only trace)
      summary.json                 all ranks side by side, verdict, kernel diff (report)
      merged.trace.json.gz         every rank in one Perfetto trace (report)
  index.jsonl                      one line per written or dropped capture file, any rank
  nodes/node<N>.json               node N's run id, host and ranks (its local rank 0)
  requests/<id>.json               on-demand capture requests (distanom capture)
  requests/<id>.response.json      the job's answer
<base>/latest -> <run-id>
```

Each rank writes only its own files; shared files (index.jsonl) are appended under a
lock file (mode 0600, waited for a bounded time). Every other write goes to a temporary
file in the same directory and is renamed into place, so a reader never trusts a
half-written file. The run directory may be shared with other users (docs/trust.md):
every folder below it is entered without following symlinks and every file is created
or appended with O_NOFOLLOW (`distanom.safe_io`), so a planted link is refused, never
written or deleted through; the `.tmp` files a killed writer left are removed by
`clean_orphans`. What each file holds,
and how it is read back, is `distanom.records`'. A capture folder every
rank has taken its files out of (the capture was replaced) is removed by whichever rank
empties it last: rmdir(2) removes only an empty folder, so no lock is needed. Paths read
back from files are resolved inside the run directory or refused. Files honour the umask.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from distanom.errors import RunDirError
from distanom.safe_io import (
    open_append_at,
    open_dir,
    parse_json,
    read_capped,
    take_lock,
    unlink_at,
    write_atomic,
    write_atomic_at,
)

_INDENTED = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE

INDEX_NAME = "index.jsonl"
RUN_JSON = "run.json"
STATUS_JSON = "status.json"
NODES_DIR = "nodes"  # nodes/node<N>.json: `distanom.records.nodes`
LATEST = "latest"
LOCK_TIMEOUT_S = 5.0  # a real writer holds it for one fsync; longer is someone else
MAX_JSON_BYTES = 64 * 1024 * 1024
CAPTURE_DIR_ATTEMPTS = 10  # another rank removing an emptied capture folder meanwhile
# what `distanom report` writes into a capture folder: regenerated on demand, so a folder
# holding nothing else once the ranks have taken their files out is removed all the same
REPORT_OUTPUTS = frozenset({"summary.json", "merged.trace.json.gz"})
# a folder removed by another rank (ESTALE: by another node over NFS) while making it
_FOLDER_RACE_ERRNOS = (errno.ENOENT, errno.EEXIST, errno.ESTALE)


_STEP_DIR = re.compile(r"^step_(\d+)$")
_ORPHAN = re.compile(r"^\..+\.tmp$")
MAX_ORPHAN_FOLDERS = 10_000


class CaptureFolderContendedError(RunDirError):
    """The capture folder kept vanishing under this rank's write: this capture is missed."""


def _current_umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # fallback: read and restore (import time, main thread)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_current_umask()


def run_id_for(name: str | None, now: datetime.datetime | None = None) -> str:
    """A run id: `<name>-<YYYYmmdd-HHMMSS>`, or the stamp alone without a name."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}" if name else stamp


def create_run(base: Path, name: str | None) -> Path:
    """Make a new, uniquely named run directory under `base` (two jobs never share one)."""
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"{base}: cannot create run directory: {err.strerror}") from None
    stem = run_id_for(name)
    for attempt in range(1000):
        candidate = base / (stem if attempt == 0 else f"{stem}-{attempt}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError as err:
            raise RunDirError(f"{candidate}: cannot create run directory: {err.strerror}") from None
        return candidate
    raise RunDirError(f"{base}: no free run id for {stem!r}")


def update_latest(base: Path, run_dir: Path) -> None:
    """Point `<base>/latest` at `run_dir`, atomically (a symlink renamed over the old one)."""
    link = base / LATEST
    temp = base / f".{LATEST}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()
    os.symlink(run_dir.name, temp)
    os.replace(temp, link)


def json_number(value: float | None, digits: int = 4) -> float | None:
    """A number for a run file: rounded, or None where JSON has no value (NaN, inf)."""
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


def write_bytes_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write `data` to `path` through a temporary file renamed into place, fsynced first
    unless `durable` is False (live files rewritten every few seconds: a process crash
    leaves the previous complete file, and the fsync would cost the control thread a
    disk flush per write); the folder's last component must not be a symlink
    (UnsafePathError)."""
    write_atomic(path, data, FILE_MODE, durable=durable)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write `obj` as indented JSON (no NaN) through `write_bytes_atomic`."""
    write_bytes_atomic(path, (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode())


def json_bytes(obj: Any, *, indent: bool = False) -> bytes:
    """`obj` as JSON bytes, by orjson first: it holds the GIL far shorter than
    `json.dumps` (a trace document; ~10 vs ~230 us for an indented status body, whose
    indent `json` runs in Python), and writes NaN and infinities as null. `json.dumps`
    takes what orjson refuses (an integer wider than 64 bits; compact: a key that is not
    a string), with no NaN (ValueError). Compact (numpy values allowed) for traces;
    `indent`: indented, newline-terminated, for files people read."""
    try:
        return orjson.dumps(obj, option=_INDENTED if indent else orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:  # orjson.JSONEncodeError is one
        if indent:
            return (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode()
        return json.dumps(obj, allow_nan=False).encode()


def write_live_json(path: Path, obj: Any, *, final: bool = False) -> None:
    """A live file (status.json, stragglers.json), rewritten every few seconds on the
    control thread: `json_bytes(indent=True)`, fsynced only when `final`."""
    write_bytes_atomic(path, json_bytes(obj, indent=True), durable=final)


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES, *, follow: bool = True) -> Any:
    """Read a small JSON file written by distanom (a regular file, at most `max_bytes`,
    nested at most MAX_JSON_DEPTH; not a link when `follow` is False); RunDirError
    naming the file on any damage."""
    try:
        return parse_json(read_capped(path, max_bytes, follow=follow))
    except FileNotFoundError:
        raise RunDirError(f"{path}: missing") from None
    except UnicodeDecodeError as err:
        raise RunDirError(f"{path}: damaged JSON ({err.reason})") from None
    except ValueError as err:
        raise RunDirError(f"{path}: damaged JSON ({err})") from None
    except OSError as err:
        raise RunDirError(f"{path}: cannot read: {err.strerror}") from None


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory (all ranks share one; see the module docstring)."""

    path: Path

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        """Open an existing run directory for reading (`runs/latest` or `runs` resolve)."""
        candidate = Path(path)
        if candidate.is_dir() and not (candidate / RUN_JSON).exists():
            latest = candidate / LATEST
            if latest.exists():
                candidate = latest
        if not candidate.exists():
            raise RunDirError(f"{path}: no such run directory")
        if not candidate.is_dir():
            raise RunDirError(f"{path}: not a directory")
        resolved = candidate.resolve()
        # another node's copy of a run holds no run.json (rank 0's) but its node file
        markers = (RUN_JSON, INDEX_NAME, NODES_DIR)
        if not any((resolved / marker).exists() for marker in markers):
            raise RunDirError(f"{path}: not a distanom run directory (no {RUN_JSON})")
        return cls(resolved)

    @property
    def run_id(self) -> str:
        """The run's id: its directory name."""
        return self.path.name

    @property
    def run_json(self) -> Path:
        """Path of run.json."""
        return self.path / RUN_JSON

    @property
    def status_json(self) -> Path:
        """Path of status.json."""
        return self.path / STATUS_JSON

    @property
    def index_path(self) -> Path:
        """Path of index.jsonl."""
        return self.path / INDEX_NAME

    @property
    def requests_dir(self) -> Path:
        """Folder of on-demand requests and their responses."""
        return self.path / "requests"

    def steps_csv(self, rank: int) -> Path:
        """Path of rank `rank`'s steps file."""
        return self.path / "steps" / f"rank{rank}.csv"

    def capture_dir(self, step: int) -> Path:
        """Folder of step `step`'s capture."""
        return self.path / "captures" / f"step_{step}"

    def trace_path(self, step: int, rank: int) -> Path:
        """Path of rank `rank`'s trace of step `step`."""
        return self.capture_dir(step) / f"rank{rank}.trace.json.gz"

    def timeline_csv(self, step: int, rank: int) -> Path:
        """Path of rank `rank`'s GPU timeline table of step `step`."""
        return self.capture_dir(step) / f"rank{rank}.gpu_timeline.csv"

    def kernel_csv(self, step: int, rank: int) -> Path:
        """Path of rank `rank`'s kernel summary table of step `step`."""
        return self.capture_dir(step) / f"rank{rank}.kernel_summary.csv"

    def cpu_timeline_csv(self, step: int, rank: int) -> Path:
        """Path of rank `rank`'s CPU timeline table of step `step`."""
        return self.capture_dir(step) / f"rank{rank}.cpu_timeline.csv"

    def rank_capture_files(self, step: int, rank: int) -> tuple[Path, ...]:
        """Every file rank `rank` may write into captures/step_<step> (trace first)."""
        return (
            self.trace_path(step, rank),
            self.timeline_csv(step, rank),
            self.kernel_csv(step, rank),
            self.cpu_timeline_csv(step, rank),
        )

    def summary_json(self, step: int) -> Path:
        """Path of the report's summary of step `step`."""
        return self.capture_dir(step) / "summary.json"

    def write_capture_file(self, path: Path, data: bytes) -> None:
        """Write one rank's file into its captures/step_<N> folder, atomically, making the
        folder if needed (never the run directory: one someone removed stays removed).

        Another rank may remove the folder the moment it is empty (see
        `remove_capture_dir_if_empty`): between our mkdir and the temporary file that then
        keeps it non-empty. The folder is then made again; once the temporary file exists,
        no rank can remove it.
        """
        parts = self._parts(path.parent)
        for attempt in range(CAPTURE_DIR_ATTEMPTS):
            if not self.path.is_dir():
                raise RunDirError(f"{self.path}: run directory vanished")
            try:
                # every folder below the run directory made here and never followed if a
                # link; FileExistsError: it existed, then was removed before mkdir could tell
                with open_dir(self.path, parts, create=True) as folder:
                    write_atomic_at(folder, path.name, data, FILE_MODE)
                return
            except OSError as err:
                if err.errno not in _FOLDER_RACE_ERRNOS:
                    raise
                if attempt == CAPTURE_DIR_ATTEMPTS - 1:
                    raise CaptureFolderContendedError(
                        f"{path.parent}: removed under this rank's write "
                        f"{CAPTURE_DIR_ATTEMPTS} times ({err})"
                    ) from err

    def remove_capture_dir_if_empty(self, step: int) -> bool:
        """Remove captures/step_<step> if no file is left in it; True if this call did.

        Safe while other ranks write into the same folder: rmdir(2) removes only an empty
        directory, atomically, so the last rank to take its files out removes it, and a
        rank still writing (its temporary file is already there) keeps it. What `distanom
        report` left there (`REPORT_OUTPUTS`) does not keep it: with no rank file left,
        those go first. A folder that is not empty or already gone is left alone; any other
        OSError is raised.
        """
        folder = self.capture_dir(step)
        try:
            with open_dir(self.path, self._parts(folder)) as fd:
                names = set(os.listdir(fd))
                if names and names <= REPORT_OUTPUTS:
                    # a rank writing meanwhile adds a temporary file: rmdir fails
                    for name in names:
                        unlink_at(fd, name)
        except FileNotFoundError:
            return False
        try:
            with open_dir(self.path, self._parts(folder.parent)) as fd:
                os.rmdir(folder.name, dir_fd=fd)
        except FileNotFoundError:
            return False
        except OSError as err:
            if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
        return True

    def remove_rank_files(self, step: int, rank: int) -> int:
        """Remove rank `rank`'s files of captures/step_<step> (a link there is removed
        itself, never followed); the size of its trace removed (0 when none)."""
        folder = self.capture_dir(step)
        removed = 0
        try:
            with open_dir(self.path, self._parts(folder)) as fd:
                for path in self.rank_capture_files(step, rank):
                    size = unlink_at(fd, path.name)
                    if size is not None and path.name.endswith(".trace.json.gz"):
                        removed = size
        except FileNotFoundError:
            return 0
        return removed

    def _parts(self, folder: Path) -> tuple[str, ...]:
        """The components of `folder` below the run directory."""
        return folder.relative_to(self.path).parts

    def open_steps_file(self, rank: int) -> int:
        """A descriptor appending to rank `rank`'s steps file (steps/ made if missing,
        neither it nor the file followed if a link)."""
        path = self.steps_csv(rank)
        with open_dir(self.path, self._parts(path.parent), create=True) as folder:
            return open_append_at(folder, path.name, FILE_MODE)

    def clean_orphans(self, min_age_s: float, now: float | None = None) -> list[str]:
        """Remove the temporary files (`.*.tmp`) a killed writer left in the run
        directory, requests/ and captures/step_*/ once older than `min_age_s` (a live
        writer's are seconds old); their paths relative to the run directory. Links are
        never followed; at most MAX_ORPHAN_FOLDERS capture folders are looked at."""
        now = time.time() if now is None else now
        removed: list[str] = []
        folders: list[tuple[str, ...]] = [(), ("requests",)]
        with contextlib.suppress(OSError), open_dir(self.path, ("captures",)) as fd:
            names = [n for n in os.listdir(fd) if _STEP_DIR.match(n)]
            folders += [("captures", n) for n in names[:MAX_ORPHAN_FOLDERS]]
        for parts in folders:
            with contextlib.suppress(OSError), open_dir(self.path, parts) as fd:
                for name in os.listdir(fd):
                    if not _ORPHAN.match(name):
                        continue
                    info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if now - info.st_mtime >= min_age_s and unlink_at(fd, name) is not None:
                        removed.append("/".join((*parts, name)))
        return removed

    def relative(self, path: Path) -> str:
        """`path` relative to the run directory."""
        return str(path.relative_to(self.path))

    def inside(self, relative: str) -> Path:
        """Resolve a path read from a run file; refuse anything outside the run directory."""
        if not isinstance(relative, str) or not relative or "\x00" in relative:
            raise RunDirError(f"{self.index_path}: invalid path {relative!r}")
        candidate = (self.path / relative).resolve()
        if candidate != self.path and self.path not in candidate.parents:
            raise RunDirError(f"{self.index_path}: path {relative!r} escapes the run directory")
        return candidate

    def append_index(self, record: Mapping[str, Any]) -> None:
        """Append one JSON line (sorted keys) to index.jsonl under the run's file lock,
        fsynced; the schema of a line is `distanom.records.index`'."""
        line = json.dumps(record, sort_keys=True, allow_nan=False)
        # the lock is mode 0600 and never a link: nobody else can open it to hold it; a
        # lock held past LOCK_TIMEOUT_S fails this write (TimeoutError), never hangs it
        with open_dir(self.path) as folder:
            lock = take_lock(folder, INDEX_NAME + ".lock", LOCK_TIMEOUT_S)
            try:
                fd = open_append_at(folder, INDEX_NAME, FILE_MODE, read=True)
                try:
                    size = os.fstat(fd).st_size
                    # a writer killed mid-line left no newline: start a fresh line so the
                    # torn record stays the only casualty
                    torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
                    os.write(fd, (("\n" if torn else "") + line + "\n").encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
            finally:
                os.close(lock)


def capture_steps_on_disk(run: RunDir) -> list[int]:
    """Steps that have a capture directory (a fallback when the index is damaged)."""
    root = run.path / "captures"
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            steps.append(int(match.group(1)))
    return sorted(steps)
