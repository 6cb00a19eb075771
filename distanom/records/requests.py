"""requests/<id>.json and <id>.response.json: on-demand capture requests to a live job.

`distanom capture` writes a request (`submit_request`); rank 0 of the job polls the folder
(`pending_requests`), carries the request to every rank through the consensus round and
answers with `Accepted` (the agreed steps and ranks) or `Refused` (`answer`). A request
file that is too large, too deep, not a regular file or malformed in any field is
answered `Refused` with its error at once, so it is never retried; at most
MAX_REQUESTS_PER_POLL files are read per poll (the rest wait for later polls), so a
flood of files costs rank 0 a bounded time per poll. Nothing listens on a port: the
(shared) run directory is the channel.
"""

from __future__ import annotations

import itertools
import os
import re
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from distanom.errors import CaptureRequestError, RunDirError
from distanom.rundir import RunDir, read_json, write_json_atomic
from distanom.safe_io import open_dir, parse_json, read_capped

MAX_REQUEST_STEPS = 100
MAX_RANK_RANGES = 8
MAX_RANK = 2**24  # far beyond any world; a larger rank is damage
MAX_REQUEST_BYTES = 4096
MAX_REQUEST_DEPTH = 4  # {"ranks": [[lo, hi]]} is three levels deep
MAX_REQUESTS_PER_POLL = 8
MAX_RESPONSE_BYTES = 64 * 1024
MAX_LISTED = 100_000  # directory entries looked at per poll
_REQUEST_ID = re.compile(r"^[0-9]{8}T[0-9]{6}-[0-9a-f]{8}$")


@dataclass(frozen=True)
class Request:
    """A well-formed request file: its id, how many steps, which ranks (() = every rank)."""

    request_id: str
    n_steps: int
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Accepted:
    """The job's yes: the request's number in the job, the steps and ranks agreed."""

    request: str
    steps: list[int]
    ranks: list[int] | Literal["all"]
    world_size: int

    def to_json(self) -> dict[str, Any]:
        """The response file's body."""
        return {
            "status": "accepted",
            "request": self.request,
            "steps": self.steps,
            "ranks": self.ranks,
            "world_size": self.world_size,
        }


@dataclass(frozen=True)
class Refused:
    """The job's no, and why."""

    reason: str

    def to_json(self) -> dict[str, Any]:
        """The response file's body."""
        return {"status": "refused", "reason": self.reason}


def parse_ranks(text: str | None) -> tuple[tuple[int, int], ...]:
    """'0,3-5' -> ((0, 0), (3, 5)); None or 'all' -> () (every rank)."""
    if text is None or text.strip().lower() in ("", "all"):
        return ()
    ranges: list[tuple[int, int]] = []
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise CaptureRequestError(f"--ranks: {part!r} is not a rank or a range like 3-5")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise CaptureRequestError(f"--ranks: range {part!r} runs backwards")
        ranges.append((lo, hi))
    ranges.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    if len(merged) > MAX_RANK_RANGES:
        raise CaptureRequestError(
            f"--ranks: at most {MAX_RANK_RANGES} separate ranges per request, got {len(merged)}"
        )
    return tuple(merged)


def validate_request(
    n_steps: int, ranges: tuple[tuple[int, int], ...], world_size: int | None
) -> None:
    """Raise CaptureRequestError unless the step count and ranks fit this job (with
    `world_size` None, every check but the ranks' existence)."""
    if not 1 <= n_steps <= MAX_REQUEST_STEPS:
        raise CaptureRequestError(f"--steps must be 1..{MAX_REQUEST_STEPS}, got {n_steps}")
    if len(ranges) > MAX_RANK_RANGES:
        raise CaptureRequestError(
            f"--ranks: at most {MAX_RANK_RANGES} separate ranges per request, got {len(ranges)}"
        )
    if any(lo < 0 or hi < lo for lo, hi in ranges):
        raise CaptureRequestError("--ranks: ranges must be non-negative and run forwards")
    if world_size is None:
        return
    unknown = [hi for _, hi in ranges if hi >= world_size]
    if unknown:
        raise CaptureRequestError(
            f"--ranks: rank {max(unknown)} does not exist (the job has ranks 0-{world_size - 1})"
        )


def submit_request(run: RunDir, n_steps: int, ranges: tuple[tuple[int, int], ...]) -> str:
    """Write a request file; returns its id."""
    request_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]
    run.requests_dir.mkdir(exist_ok=True)
    body = {"id": request_id, "steps": n_steps, "ranks": [list(r) for r in ranges]}
    write_json_atomic(run.requests_dir / f"{request_id}.json", body)
    return request_id


def response_path(run: RunDir, request_id: str) -> Path:
    """Where the job answers request `request_id`."""
    return run.requests_dir / f"{request_id}.response.json"


def pending_requests(run: RunDir, skip: Collection[str] = ()) -> list[Request]:
    """Unanswered, well-formed requests, oldest first (rank 0 of the job); ids in `skip`
    (already taken) are not read again. A malformed one is answered `Refused` with its
    error; at most MAX_REQUESTS_PER_POLL files are read per call."""
    folder = run.requests_dir
    try:
        with open_dir(run.path, ("requests",)) as fd, os.scandir(fd) as entries:
            listed = {entry.name for entry in itertools.islice(entries, MAX_LISTED)}
    except FileNotFoundError:
        return []
    found: list[Request] = []
    read = 0
    for name in sorted(listed):
        if not name.endswith(".json") or name.endswith(".response.json"):
            continue
        stem = name[: -len(".json")]
        if not _REQUEST_ID.match(stem) or stem in skip:
            continue
        if f"{stem}.response.json" in listed:
            continue
        if read >= MAX_REQUESTS_PER_POLL:
            break
        read += 1
        request = read_request(folder / name, stem)
        if isinstance(request, str):
            answer(run, stem, Refused(f"malformed request: {request}"))
            continue
        found.append(request)
    return found


def read_request(path: Path, stem: str) -> Request | str:
    """The request in `path`, or what is wrong with it (checked in full: a regular file,
    never a link, at most MAX_REQUEST_BYTES and MAX_REQUEST_DEPTH, an object with an
    integer `steps` and at most MAX_RANK_RANGES `ranks` pairs of non-negative integers)."""
    try:
        body = parse_json(read_capped(path, MAX_REQUEST_BYTES, follow=False), MAX_REQUEST_DEPTH)
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    except ValueError as err:
        return f"not JSON ({err})"
    if not isinstance(body, dict):
        return "not a JSON object"
    n_steps = body.get("steps")
    if not isinstance(n_steps, int) or isinstance(n_steps, bool):
        return "steps is not an integer"
    ranks = body.get("ranks", [])
    if not isinstance(ranks, list) or len(ranks) > MAX_RANK_RANGES:
        return f"ranks is not a list of at most {MAX_RANK_RANGES} ranges"
    ranges: list[tuple[int, int]] = []
    for pair in ranks:
        if not (isinstance(pair, list) and len(pair) == 2 and all(map(_is_int, pair))):
            return "a rank range is not a pair of integers"
        lo, hi = pair
        if not 0 <= lo <= hi < MAX_RANK:
            return f"rank range {lo}-{hi} is out of order or range"
        ranges.append((lo, hi))
    return Request(stem, n_steps, tuple(ranges))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def answer(run: RunDir, request_id: str, response: Accepted | Refused) -> None:
    """Write the job's response to a request, atomically."""
    write_json_atomic(response_path(run, request_id), response.to_json())


def read_response(run: RunDir, request_id: str) -> dict[str, Any] | None:
    """The job's response as written, None until it exists (or while damaged: a file
    too large, too deep, not regular or not an object reads as not there yet)."""
    path = response_path(run, request_id)
    try:
        body = parse_json(read_capped(path, MAX_RESPONSE_BYTES, follow=False))
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def accepted_ranks(run: RunDir, number: str, world_size: int) -> list[int] | None:
    """The ranks the job accepted for its request `number`, None when no readable
    response names them (a damaged response file is skipped)."""
    folder = run.requests_dir
    if not folder.is_dir():
        return None
    for path in itertools.islice(folder.glob("*.response.json"), MAX_LISTED):
        try:
            body = read_json(path, MAX_RESPONSE_BYTES)
        except RunDirError:
            continue
        if isinstance(body, dict) and body.get("request") == number:
            ranks = body.get("ranks")
            if ranks == "all":
                return list(range(world_size))
            if isinstance(ranks, list) and all(_is_int(r) and 0 <= r < world_size for r in ranks):
                return sorted(ranks)
    return None
