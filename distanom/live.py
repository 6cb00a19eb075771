"""`distanom status` and `distanom capture`: a client of a live job, run from a shell.

Reads the status file rank 0 of a job keeps fresh (`records.status`), and drives the
request/response file protocol (`records.requests`) from the requesting side: submit,
wait for the job's answer, then wait until every chosen rank has written its trace of
the agreed steps (`records.index`). Never waits forever: a job that stops answering
(stale heartbeat) or has finished is reported as such. Output goes to stdout; no torch,
no agent here.
"""

from __future__ import annotations

import time
from typing import Any

from distanom.analysis.text import table
from distanom.errors import CaptureRequestError
from distanom.records.index import read_index
from distanom.records.requests import (
    parse_ranks,
    read_response,
    submit_request,
    validate_request,
)
from distanom.records.status import Status, job_alive, read_status
from distanom.rundir import RunDir

POLL_S = 0.2


def render_status(run: RunDir, status: Status | dict[str, Any]) -> str:
    """The status of a job as a few lines of text (`distanom status`)."""
    alive = job_alive(status)
    state = status.get("state", "unknown")
    if state == "running" and not alive:
        age = time.time() - float(status.get("updated_at", 0))
        state = f"not responding (last heartbeat {age:.0f} s ago)"
    lines = [
        f"run {run.run_id}: {state}",
        f"  step {status.get('step')} (gathered up to {status.get('gathered_step')}),"
        f" world size {status.get('world_size')}",
        f"  step median {_ms(status.get('median_ms'))},"
        f" threshold {_ms(status.get('threshold_ms'))}",
    ]
    tracer = status.get("tracer") or {}
    if tracer.get("note"):
        lines.append(f"  {tracer['note']}")
    overhead = tracer.get("overhead_pct")
    if isinstance(overhead, (int, float)):
        lines.append(f"  measured tracing overhead: {overhead:.2f}% of step time")
    captures = status.get("captures") or {}
    detector = status.get("detector") or {}
    lines.append(
        f"  anomalous steps {detector.get('anomalous', 0)}, captures written "
        f"{captures.get('written', 0)} ({(captures.get('bytes') or 0) / 1e6:.1f} MB on rank 0)"
    )
    for key in ("capture_off", "consensus_error"):
        if status.get(key):
            lines.append(f"  capture stepped aside: {status[key]}")
    lines += _straggler_lines(status.get("stragglers"))
    recent = status.get("recent_ms") or {}
    order = [str(r) for r in status.get("slowest_ranks") or []] + sorted(recent, key=int)
    seen: list[str] = []
    for rank in order:
        if rank in recent and rank not in seen:
            seen.append(rank)
    if seen:
        lines.append("  recent step times (ms), slowest ranks first:")
        rows = [
            [f"rank {rank}"] + [("-" if t is None else f"{t:.1f}") for t in recent[rank][-8:]]
            for rank in seen[:16]
        ]
        lines += ["    " + line for line in table([""] * len(rows[0]), rows)[1:]]
    return "\n".join(lines) + "\n"


def _straggler_lines(scores: Any) -> list[str]:
    """Stragglers (most severe first) and drift from the status file, if any."""
    if not isinstance(scores, dict):
        return []
    lines = []
    for entry in scores.get("stragglers") or []:
        if not isinstance(entry, dict):
            continue
        found = entry.get("evidence")
        evidence: dict[str, Any] = found if isinstance(found, dict) else {}
        score = entry.get("score")
        share = f"{100 * score:.0f}%" if isinstance(score, (int, float)) else "-"
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
    return f"{value:.1f} ms" if isinstance(value, (int, float)) else "-"


def request_capture(run_dir: str, n_steps: int, ranks_text: str | None, timeout_s: float) -> int:
    """Ask the live job in `run_dir` to capture its next `n_steps` steps on the ranks named
    by `ranks_text`, wait for every file and print their paths; returns the exit status
    (CaptureRequestError when refused, stopped or timed out)."""
    run = RunDir.open(run_dir)
    status = read_status(run)
    if not job_alive(status):
        state = (status or {}).get("state", "no status")
        raise CaptureRequestError(f"{run.path}: the job is not running ({state}); nothing to ask")
    assert status is not None
    ranges = parse_ranks(ranks_text)
    world_size = int(status.get("world_size") or 1)
    validate_request(n_steps, ranges, world_size)
    request_id = submit_request(run, n_steps, ranges)
    deadline = time.monotonic() + timeout_s
    response = _wait_response(run, request_id, deadline)
    if response.get("status") != "accepted":
        raise CaptureRequestError(f"request refused by the job: {response.get('reason')}")
    steps = [int(s) for s in response.get("steps", [])]
    ranks_field = response.get("ranks")
    if ranks_field == "all" or not isinstance(ranks_field, list):
        ranks = list(range(world_size))
    else:
        ranks = [int(r) for r in ranks_field]
    print(
        f"job accepted: capturing step(s) {steps[0]}-{steps[-1]} on rank(s) "
        f"{'all' if ranks_field == 'all' else ','.join(map(str, ranks))}; waiting for the files",
        flush=True,
    )
    written = _wait_files(run, str(response.get("request")), steps, ranks, deadline)
    for step in steps:
        for rank in ranks:
            print(f"step {step} rank {rank}: {run.path / written[(step, rank)]}")
    return 0


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
