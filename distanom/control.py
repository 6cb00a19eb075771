"""The file protocol between a running job and `distanom capture` / `distanom status`.

Nothing listens on a port: a request is a small JSON file under `requests/` in the (shared)
run directory, rank 0 of the job polls that folder, carries the request to every rank
through the consensus round, and answers with `<id>.response.json`. Rank 0 also rewrites
`status.json` every few seconds; its `updated_at` and `state` tell a reader whether the
job is alive. Both sides of the protocol live here so they cannot drift apart.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distanom.errors import CaptureRequestError
from distanom.rundir import RunDir, write_json_atomic

MAX_REQUEST_STEPS = 100
MAX_RANK_RANGES = 8
MAX_REQUEST_BYTES = 4096
STALE_AFTER_S = 30.0  # a running job rewrites status.json every control.status_interval_s
_REQUEST_ID = re.compile(r"^[0-9]{8}T[0-9]{6}-[0-9a-f]{8}$")


@dataclass(frozen=True)
class Request:
    request_id: str
    n_steps: int
    ranges: tuple[tuple[int, int], ...]  # () = every rank


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


def validate_request(n_steps: int, ranges: tuple[tuple[int, int], ...], world_size: int) -> None:
    if not 1 <= n_steps <= MAX_REQUEST_STEPS:
        raise CaptureRequestError(f"--steps must be 1..{MAX_REQUEST_STEPS}, got {n_steps}")
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
    return run.requests_dir / f"{request_id}.response.json"


def pending_requests(run: RunDir) -> list[Request]:
    """Unanswered, well-formed requests, oldest first (rank 0 of the job)."""
    folder = run.requests_dir
    if not folder.is_dir():
        return []
    found: list[Request] = []
    for path in sorted(folder.glob("*.json")):
        stem = path.name[: -len(".json")]
        if not _REQUEST_ID.match(stem) or response_path(run, stem).exists():
            continue
        request = _read_request(path, stem)
        if request is None:
            write_json_atomic(
                response_path(run, stem), {"status": "refused", "reason": "malformed request"}
            )
            continue
        found.append(request)
    return found


def _read_request(path: Path, stem: str) -> Request | None:
    try:
        if path.stat().st_size > MAX_REQUEST_BYTES:
            return None
        body = json.loads(path.read_text(encoding="utf-8"))
        n_steps = body["steps"]
        ranges = tuple((int(lo), int(hi)) for lo, hi in body["ranks"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(n_steps, int) or isinstance(n_steps, bool):
        return None
    return Request(stem, n_steps, ranges)


def answer(run: RunDir, request_id: str, body: dict[str, Any]) -> None:
    write_json_atomic(response_path(run, request_id), body)


def read_response(run: RunDir, request_id: str) -> dict[str, Any] | None:
    path = response_path(run, request_id)
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def write_status(run: RunDir, status: dict[str, Any]) -> None:
    write_json_atomic(run.status_json, {**status, "updated_at": time.time(), "pid": os.getpid()})


def read_status(run: RunDir) -> dict[str, Any] | None:
    try:
        body = json.loads(run.status_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def job_alive(status: dict[str, Any] | None, now: float | None = None) -> bool:
    """Whether the job behind a status file is still running (fresh heartbeat)."""
    if not status or status.get("state") != "running":
        return False
    updated = status.get("updated_at")
    if not isinstance(updated, (int, float)):
        return False
    interval = status.get("status_interval_s", 2.0)
    interval = interval if isinstance(interval, (int, float)) else 2.0
    return (now or time.time()) - updated < max(STALE_AFTER_S, 10 * interval)
