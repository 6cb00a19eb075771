"""`distanom status` and `distanom capture`: a client of a live job, run from a shell.

Reads the status file rank 0 of a job keeps fresh (`records.status`), and drives the
request/response file protocol (`records.requests`) from the requesting side: submit,
wait for the job's answer, then wait until every chosen rank has written its trace of
the agreed steps (`records.index`). Never waits forever: a job that stops answering
(stale heartbeat) or has finished is reported as such. Output goes to stdout; no torch,
no agent here.
"""

from __future__ import annotations

import math
import time
from typing import Any, TypeGuard

from distanom.analysis.hangs import Hang, hang_lines, read_hangs
from distanom.analysis.text import comparisons_words, table, unmeasured_words
from distanom.errors import CaptureRequestError
from distanom.records.index import read_index
from distanom.records.requests import (
    MAX_REQUEST_STEPS,
    parse_ranks,
    read_response,
    submit_request,
    validate_request,
)
from distanom.records.run_info import MAX_WORLD_SIZE, world_size_of
from distanom.records.status import Status, heartbeat, job_alive, read_status, stale_since
from distanom.rundir import RunDir
from distanom.sanitize import json_finite, terminal_safe

POLL_S = 0.2


def render_status(run: RunDir, status: Status | dict[str, Any]) -> str:
    """The status of a job as a few lines of text (`distanom status`); every field is
    checked before use (a damaged file shows "-" where a value is wrong)."""
    state = str(status.get("state", "unknown"))[:40]
    stale = stale_since(status)
    if stale is not None:
        updated = heartbeat(status)
        age = f", last heartbeat {time.time() - updated:.0f} s ago" if updated else ""
        state = f"not responding ({stale}{age})"
    lines = [
        f"run {run.run_id}: {state}",
        f"  step {_int(status.get('step'))} (gathered up to {_int(status.get('gathered_step'))}),"
        f" world size {_int(status.get('world_size'))}",
        f"  rolling median step {_ms(status.get('median_ms'))},"
        f" threshold {_ms(status.get('threshold_ms'))}",
    ]
    tracer = _obj(status.get("tracer"))
    if tracer.get("note"):
        lines.append(f"  {str(tracer['note'])[:500]}")
    overhead = tracer.get("overhead_pct")
    duty = _obj(tracer.get("duty_cycle"))
    if _number(overhead):
        said = comparisons_words(duty.get("overhead_comparisons"))  # one swings by tens of %
        lines.append(f"  measured tracing overhead: {overhead:.2f}% of step time{said}")
    elif _number(duty.get("traced_fraction")):
        lines.append(f"  tracing: {unmeasured_words(duty)}")
    captures = _obj(status.get("captures"))
    detector = _obj(status.get("detector"))
    written_bytes = captures.get("bytes")
    written_mb = written_bytes / 1e6 if _number(written_bytes) else 0.0
    replaced = captures.get("replaced")
    lines.append(
        f"  anomalous steps {_int(detector.get('anomalous', 0))}, trace files kept: "
        f"{_int(captures.get('written', 0))} on rank 0 ({written_mb:.1f} MB"
        + (f", {_int(replaced)} replaced" if _number(replaced) and replaced > 0 else "")
        + ")"
    )
    if _number(captures.get("errors")) and captures["errors"] > 0:
        lines.append(f"  captures failed: {_int(captures['errors'])} (capture went on)")
    for key in ("capture_off", "consensus_error"):
        if status.get(key):
            lines.append(f"  capture stepped aside: {str(status[key])[:500]}")
    lines += _straggler_lines(status.get("stragglers"))
    recent = {
        str(rank): times
        for rank, times in list(_obj(status.get("recent_ms")).items())[:MAX_RANKS_SHOWN]
        # ASCII decimal digits only: str.isdigit() also accepts '²', which int() refuses
        if str(rank).isascii()
        and str(rank).isdecimal()
        and len(str(rank)) < 10
        and isinstance(times, list)
    }
    slowest = status.get("slowest_ranks")
    slowest = slowest[:MAX_RANKS_SHOWN] if isinstance(slowest, list) else []
    order = [str(r) for r in slowest if isinstance(r, int)] + sorted(recent, key=int)
    seen: list[str] = []
    for rank in order:
        if rank in recent and rank not in seen:
            seen.append(rank)
    if seen:
        lines.append("  recent step times (ms), slowest ranks first:")
        rows = [
            [f"rank {rank}"] + [(f"{t:.1f}" if _number(t) else "-") for t in recent[rank][-8:]]
            for rank in seen[:16]
        ]
        width = max(len(row) for row in rows)
        rows = [row + [""] * (width - len(row)) for row in rows]
        lines += ["    " + line for line in table([""] * width, rows)[1:]]
    lines += _hang_lines(run, status)
    return "\n".join(lines) + "\n"


MAX_RANKS_SHOWN = 4096


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> TypeGuard[float]:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and -1e15 < value < 1e15  # also refuses NaN and integers too large for a float
    )


def _int(value: Any) -> str:
    return str(int(value)) if _number(value) else "-"


def status_json(run: RunDir, status: Status | dict[str, Any]) -> dict[str, Any]:
    """`distanom status --json`: status.json as written, plus the hangs the ranks recorded
    (each rank writes its own, so they show even while rank 0's status is stale); a
    number that is not finite is null."""
    body = json_finite(dict(status))  # a planted 1e999 must not crash the JSON writer
    return {**body, "hangs": [hang.as_json() for hang in _hangs(run, status)]}


def _hangs(run: RunDir, status: Status | dict[str, Any]) -> list[Hang]:
    world_size = status.get("world_size")
    ranks = world_size if isinstance(world_size, int) and 0 < world_size <= MAX_WORLD_SIZE else 1
    return read_hangs(run, ranks)[0]


def _hang_lines(run: RunDir, status: Status | dict[str, Any]) -> list[str]:
    """The latest hang the ranks recorded, with its verdict (hang records are written by
    each rank itself, so they show even while rank 0's status is stale)."""
    hangs = _hangs(run, status)
    if not hangs:
        return []
    earlier = f" ({len(hangs) - 1} earlier hang(s): distanom report)" if len(hangs) > 1 else ""
    return ["  " + line for line in hang_lines(hangs[-1])] + ([earlier] if earlier else [])


def _straggler_lines(scores: Any) -> list[str]:
    """Stragglers (most severe first) and drift from the status file, if any."""
    if not isinstance(scores, dict):
        return []
    lines = []
    entries = scores.get("stragglers")
    for entry in entries[:64] if isinstance(entries, list) else []:
        if not isinstance(entry, dict):
            continue
        found = entry.get("evidence")
        evidence: dict[str, Any] = found if isinstance(found, dict) else {}
        score = entry.get("score")
        share = f"{100 * score:.0f}%" if _number(score) else "-"  # a 400-digit int overflowed
        lines.append(
            f"  straggler: rank {entry.get('rank')} since step {entry.get('since_step')}: ranks "
            f"wait for it {share} of their step time (late at {evidence.get('late_steps')} of "
            f"the last {evidence.get('window_steps')} steps)"
        )
    drift = scores.get("drift")
    if isinstance(drift, dict):
        lines.append(
            f"  drift: median step {_ms(drift.get('first_ms'))} -> {_ms(drift.get('last_ms'))}"
            f" ({drift.get('ratio')}x)"
        )
    return lines


def _ms(value: Any) -> str:
    return f"{value:.1f} ms" if _number(value) else "-"


def request_capture(run_dir: str, n_steps: int, ranks_text: str | None, timeout_s: float) -> int:
    """Ask the live job in `run_dir` to capture its next `n_steps` steps on the ranks named
    by `ranks_text`, wait for every file and print their paths; returns the exit status
    (CaptureRequestError when refused, stopped or timed out)."""
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise CaptureRequestError(f"--timeout must be a positive number of seconds: {timeout_s}")
    ranges = parse_ranks(ranks_text)
    validate_request(n_steps, ranges, None)  # a bad argument is said before the job's state
    run = RunDir.open(run_dir)
    status = read_status(run)
    if not job_alive(status):
        state = (status or {}).get("state", "no status")
        if state == "running":  # the file says running, but its heartbeat stopped
            state = "its status heartbeat stopped"
        raise CaptureRequestError(f"{run.path}: the job is not running ({state}); nothing to ask")
    assert status is not None
    world_size = world_size_of(dict(status))
    validate_request(n_steps, ranges, world_size)
    request_id = submit_request(run, n_steps, ranges)
    deadline = time.monotonic() + timeout_s
    response = _wait_response(run, request_id, deadline)
    if response.get("status") != "accepted":
        raise CaptureRequestError(
            f"request refused by the job: {str(response.get('reason'))[:500]}"
        )
    steps, ranks = _accepted(response, world_size)
    ranks_field = response.get("ranks")
    print(
        f"job accepted: capturing step(s) {steps[0]}-{steps[-1]} on rank(s) "
        f"{'all' if ranks_field == 'all' else ','.join(map(str, ranks))}; waiting for the files",
        flush=True,
    )
    number = response.get("request")
    if not isinstance(number, str) or len(number) > 64:
        raise CaptureRequestError("the job's response is malformed (request)")
    written = _wait_files(run, number, steps, ranks, deadline)
    for step in steps:
        for rank in ranks:
            print(terminal_safe(f"step {step} rank {rank}: {run.path / written[(step, rank)]}"))
    return 0


def _accepted(response: dict[str, Any], world_size: int) -> tuple[list[int], list[int]]:
    """The steps and ranks of an accepted response, checked (CaptureRequestError when the
    file is not what a job writes)."""
    steps = response.get("steps")
    if not (
        isinstance(steps, list)
        and 0 < len(steps) <= MAX_REQUEST_STEPS
        and all(_is_count(s, 2**53) for s in steps)
    ):
        raise CaptureRequestError("the job's response is malformed (steps)")
    ranks_field = response.get("ranks")
    if ranks_field == "all":
        return steps, list(range(world_size))
    if not (
        isinstance(ranks_field, list)
        and 0 < len(ranks_field) <= world_size
        and all(_is_count(r, world_size) for r in ranks_field)
    ):
        raise CaptureRequestError("the job's response is malformed (ranks)")
    return steps, ranks_field


def _is_count(value: Any, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


def _wait_response(run: RunDir, request_id: str, deadline: float) -> dict[str, Any]:
    while True:
        response = read_response(run, request_id)
        if response is not None:
            return response
        _check_alive(run, deadline, "before it answered the request")
        time.sleep(POLL_S)


def _wait_files(
    run: RunDir, number: str, steps: list[int], ranks: list[int], deadline: float
) -> dict[tuple[int, int], str]:
    wanted = {(step, rank) for step in steps for rank in ranks}
    found: dict[tuple[int, int], str] = {}
    finished_seen_at: float | None = None
    while True:
        records, _ = read_index(run)
        for record in records:
            key = (record.step, record.rank)
            if record.request == number and record.event == "written" and key in wanted:
                found[key] = record.trace
        if wanted <= found.keys():
            return found
        status = read_status(run)
        if not job_alive(status):
            # the job may still be flushing its last captures for a moment after it ends
            finished_seen_at = finished_seen_at or time.monotonic()
            if time.monotonic() - finished_seen_at > 5.0:
                missing = sorted(wanted - found.keys())
                raise CaptureRequestError(
                    f"the job ended before capturing everything; missing (step, rank): {missing}"
                )
        if time.monotonic() > deadline:
            missing = sorted(wanted - found.keys())
            raise CaptureRequestError(f"timed out; still missing (step, rank): {missing}")
        time.sleep(POLL_S)


def _check_alive(run: RunDir, deadline: float, when: str) -> None:
    if not job_alive(read_status(run)):
        raise CaptureRequestError(f"the job stopped {when}")
    if time.monotonic() > deadline:
        raise CaptureRequestError(f"timed out waiting for the job {when}")
