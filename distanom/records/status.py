"""status.json: the live state of a job, rewritten every few seconds by rank 0's control
thread and read by `distanom status`, `distanom capture` and the report.

Its `updated_at` (the heartbeat, rewritten every `control.status_interval_s`) and
`state` tell a reader whether the job is alive (`job_alive`) or went silent without
saying it finished (`stale_since`: killed, hung). Every
field is optional to a reader (files from older versions lack some), so `Status` is a
`TypedDict` read with `.get`.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from typing import Any, TypedDict

from distanom.errors import RunDirError
from distanom.rundir import RunDir, read_json, write_live_json

MAX_STATUS_BYTES = 1024 * 1024  # a status is a few KB
MAX_TIME = 4.1e9  # year 2100: a later heartbeat is damage
STALE_AFTER_S = 30.0  # a running job rewrites status.json every control.status_interval_s


class CaptureCounts(TypedDict, total=False):
    """Rank 0's capture worker counters."""

    written: int  # trace files kept (written, less those replaced since)
    replaced: int  # trace files removed for a newer reference or a more severe capture
    bytes: int
    missed: int
    skipped_disk: int
    failed: str | None
    errors: int  # captures that failed (capture went on)


class TracerReport(TypedDict, total=False):
    """Backend, duty cycle and measured overhead of rank 0's tracer."""

    backend: str | None
    note: str
    duty_cycle: dict[str, Any]
    overhead_pct: float | None
    traced_fraction: float | None
    stats: dict[str, Any]


class Status(TypedDict, total=False):
    """The body of status.json (keys in the order written)."""

    state: str  # "running", then "finished", "failed" or "interrupted"
    run_id: str | None
    world_size: int
    step: int  # the step in progress on rank 0's host
    gathered_step: int  # the last step every rank's time was gathered for
    median_ms: float | None
    threshold_ms: float | None
    recent_ms: dict[str, list[float | None]]  # rank -> its last step times
    slowest_ranks: list[int]
    detector: dict[str, int]
    episodes: list[dict[str, Any]]
    captures: CaptureCounts
    tracer: TracerReport
    capture_off: str | None
    consensus_error: str | None
    status_interval_s: float
    exit_code: int | None  # the script's exit status once it ended
    stragglers: dict[str, Any] | None  # rank 0's straggler scores and drift (records.anomalies)
    agent_cost: dict[str, Any]  # distanom's own time per step on rank 0 (ControlLoop.own_cost)
    updated_at: float  # added by `write_status`
    pid: int  # added by `write_status`


def write_status(run: RunDir, status: Status) -> None:
    """Rewrite status.json atomically, stamped with the time and this process id."""
    body = {**status, "updated_at": time.time(), "pid": os.getpid()}
    # rewritten every few seconds while training runs: not fsynced (the last one is)
    write_live_json(run.status_json, body, final=status["state"] != "running")


def read_status(run: RunDir) -> Status | None:
    """The status file of a live job, None when missing, damaged (too large, too deep,
    not a regular file) or not an object."""
    try:
        body = read_json(run.status_json, MAX_STATUS_BYTES)
    except RunDirError:
        return None
    return body if isinstance(body, dict) else None  # type: ignore[return-value]


def load_status(run: RunDir) -> Status | None:
    """The status file for a report: None when absent or not an object; RunDirError when
    damaged or too large (the report lists it as a problem)."""
    exists = run.status_json.exists() or run.status_json.is_symlink()
    loaded = read_json(run.status_json, MAX_STATUS_BYTES) if exists else None
    return loaded if isinstance(loaded, dict) else None  # type: ignore[return-value]


def heartbeat(status: Status | dict[str, Any] | None) -> float | None:
    """The status file's `updated_at` (Unix time) when it is a plausible time, else None."""
    updated = (status or {}).get("updated_at")
    if isinstance(updated, bool) or not isinstance(updated, (int, float)):
        return None
    return float(updated) if 0 < updated < MAX_TIME else None


def stale_since(status: Status | dict[str, Any] | None, now: float | None = None) -> str | None:
    """ "stale since <UTC time>" for a job that says it is running but whose heartbeat
    stopped (killed, hung, its node gone); None for a live or finished job."""
    if not status or status.get("state") != "running" or job_alive(status, now):
        return None
    updated = heartbeat(status)
    if updated is None:
        return "stale (no heartbeat time)"
    stamp = datetime.datetime.fromtimestamp(updated, datetime.timezone.utc)
    return f"stale since {stamp:%Y-%m-%d %H:%M:%S} UTC"


def job_alive(status: Status | dict[str, Any] | None, now: float | None = None) -> bool:
    """Whether the job behind a status file is still running (fresh heartbeat)."""
    if not status or status.get("state") != "running":
        return False
    updated = heartbeat(status)
    if updated is None:
        return False
    interval = status.get("status_interval_s", 2.0)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)):
        interval = 2.0
    interval = min(max(float(interval), 0.0), 3600.0) if math.isfinite(interval) else 2.0
    return (now or time.time()) - updated < max(STALE_AFTER_S, 10 * interval)
