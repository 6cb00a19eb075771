"""status.json: the live state of a job, rewritten every few seconds by rank 0's control
thread and read by `distanom status`, `distanom capture` and the report.

Its `updated_at` and `state` tell a reader whether the job is alive (`job_alive`). Every
field is optional to a reader (files from older versions lack some), so `Status` is a
`TypedDict` read with `.get`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, TypedDict

from distanom.rundir import RunDir, read_json, write_json_atomic

STALE_AFTER_S = 30.0  # a running job rewrites status.json every control.status_interval_s


class CaptureCounts(TypedDict, total=False):
    """Rank 0's capture worker counters."""

    written: int
    bytes: int
    missed: int
    skipped_disk: int
    failed: str | None


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

    state: str  # "running" or "finished"
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
    stragglers: dict[str, Any] | None  # rank 0's straggler scores and drift (records.anomalies)
    updated_at: float  # added by `write_status`
    pid: int  # added by `write_status`


def write_status(run: RunDir, status: Status) -> None:
    """Rewrite status.json atomically, stamped with the time and this process id."""
    write_json_atomic(run.status_json, {**status, "updated_at": time.time(), "pid": os.getpid()})


def read_status(run: RunDir) -> Status | None:
    """The status file of a live job, None when missing, damaged or not an object."""
    try:
        body = json.loads(run.status_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None  # type: ignore[return-value]


def load_status(run: RunDir) -> Status | None:
    """The status file for a report: None when absent or not an object; RunDirError when
    damaged or too large (the report lists it as a problem)."""
    loaded = read_json(run.status_json) if run.status_json.exists() else None
    return loaded if isinstance(loaded, dict) else None  # type: ignore[return-value]


def job_alive(status: Status | dict[str, Any] | None, now: float | None = None) -> bool:
    """Whether the job behind a status file is still running (fresh heartbeat)."""
    if not status or status.get("state") != "running":
        return False
    updated = status.get("updated_at")
    if not isinstance(updated, (int, float)):
        return False
    interval = status.get("status_interval_s", 2.0)
    interval = interval if isinstance(interval, (int, float)) else 2.0
    return (now or time.time()) - updated < max(STALE_AFTER_S, 10 * interval)
