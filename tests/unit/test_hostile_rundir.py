"""The job side against a hostile run directory: planted links, a held lock, junk
requests, FIFOs and device links never redirect, block or disarm the job."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import time
from pathlib import Path

import pytest

from distanom import rundir
from distanom.capture import CaptureWorker
from distanom.config import load_config
from distanom.errors import CaptureRequestError
from distanom.records.requests import (
    MAX_REQUESTS_PER_POLL,
    pending_requests,
    read_request,
    validate_request,
)
from distanom.records.steps import StepRow, StepsWriter
from distanom.rundir import RunDir, create_run
from distanom.safe_io import UnsafePathError
from distanom.world import WorldInfo
from tests.unit.test_capture_worker import ReadyTracer, rank_worker, reference, wait_for

RECORD = {"event": "written", "step": 1, "rank": 0, "trace": "captures/step_1/rank0.trace.json.gz"}


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    return RunDir(create_run(tmp_path / "runs", None))


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("precious")
    return path


def test_index_append_never_follows_a_planted_link(run: RunDir, victim: Path) -> None:
    run.index_path.symlink_to(victim)
    with pytest.raises(UnsafePathError):
        run.append_index(RECORD)
    assert victim.read_text() == "precious"


def test_steps_file_and_folder_never_followed(run: RunDir, victim: Path, tmp_path: Path) -> None:
    (run.path / "steps").mkdir()
    run.steps_csv(0).symlink_to(victim)
    with pytest.raises(UnsafePathError):
        StepsWriter(run.steps_csv(0))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run.path / "steps").rename(run.path / "steps.old")
    (run.path / "steps").symlink_to(elsewhere)
    with pytest.raises(UnsafePathError):
        StepsWriter(run.steps_csv(1))
    assert victim.read_text() == "precious" and not list(elsewhere.iterdir())
    os.mkfifo(run.path / "steps.old" / "rank2.csv")
    (run.path / "steps").unlink()
    (run.path / "steps.old").rename(run.path / "steps")
    with pytest.raises(UnsafePathError):  # a FIFO: refused at once, never blocks
        StepsWriter(run.steps_csv(2))
    writer = StepsWriter(run.steps_csv(3))
    writer.write_rows([StepRow(0, 1.0, False, False, 0.0)])
    writer.close()
    assert run.steps_csv(3).read_text().count("\n") == 2


def test_a_linked_capture_folder_receives_nothing(run: RunDir, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run.path / "captures").mkdir()
    run.capture_dir(5).symlink_to(elsewhere)
    with pytest.raises(UnsafePathError):
        run.write_capture_file(run.trace_path(5, 0), b"trace")
    (run.path / "captures").rename(run.path / "captures.old")
    (run.path / "captures").symlink_to(elsewhere)
    with pytest.raises(UnsafePathError):
        run.write_capture_file(run.trace_path(6, 0), b"trace")
    assert not list(elsewhere.iterdir())


def test_dropping_a_capture_never_deletes_through_a_link(run: RunDir, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("rank0.trace.json.gz", "summary.json", "merged.trace.json.gz"):
        (elsewhere / name).write_text("keep")
    (run.path / "captures").mkdir()
    run.capture_dir(5).symlink_to(elsewhere)
    with pytest.raises(UnsafePathError):
        run.remove_rank_files(5, 0)
    with pytest.raises(UnsafePathError):
        run.remove_capture_dir_if_empty(5)
    assert len(list(elsewhere.iterdir())) == 3
    # a link in place of a rank file is removed itself, its target kept
    run.capture_dir(5).unlink()
    run.capture_dir(5).mkdir()
    run.trace_path(5, 0).symlink_to(elsewhere / "summary.json")
    run.remove_rank_files(5, 0)
    assert (elsewhere / "summary.json").read_text() == "keep"
    assert run.remove_capture_dir_if_empty(5)


def test_index_lock_is_private_and_a_held_lock_fails_the_write_in_bounded_time(
    run: RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = Path(str(run.index_path) + ".lock")
    lock.write_text("")
    lock.chmod(0o666)  # left open to others (an older version, or planted by us)
    run.append_index(RECORD)
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    monkeypatch.setattr(rundir, "LOCK_TIMEOUT_S", 0.3)
    with open(lock, "rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            run.append_index(RECORD)
        assert time.monotonic() - started < 2.0
    run.append_index(RECORD)
    assert run.index_path.read_text().count("\n") == 2


def test_capture_worker_counts_a_failed_capture_and_goes_on(run: RunDir) -> None:
    (run.path / "captures").mkdir()
    run.capture_dir(26).symlink_to(run.path)  # a planted link: that capture fails
    worker = rank_worker(run, 0, 1)
    worker.submit([reference(26)])
    worker.submit([reference(27)])
    worker.close(5.0)
    assert worker.active and worker.stats.errors == 1 and worker.stats.written == 1
    assert "refused" in str(worker.stats.last_error)
    assert run.trace_path(27, 0).is_file()


def _request(run: RunDir, stem: str, body: bytes | str) -> Path:
    run.requests_dir.mkdir(exist_ok=True)
    path = run.requests_dir / f"{stem}.json"
    path.write_bytes(body.encode() if isinstance(body, str) else body)
    return path


HOSTILE = {
    "negative": '{"steps": 1, "ranks": [[-1000000000000, 0]]}',
    "backwards": '{"steps": 1, "ranks": [[3, 1]]}',
    "too_many": json.dumps({"steps": 1, "ranks": [[2 * i, 2 * i] for i in range(9)]}),
    "infinity": '{"steps": 1, "ranks": [[0, Infinity]]}',
    "float": '{"steps": 1, "ranks": [[0, 1.5]]}',
    "bool": '{"steps": true, "ranks": []}',
    "deep": "[" * 1500 + "]" * 1500,
    "not_object": "[1, 2]",
    "big": '{"steps": 1, "pad": "' + "x" * 5000 + '"}',
    "huge_int": '{"steps": ' + "9" * 5000 + "}",
    "ranks_type": '{"steps": 1, "ranks": {"a": 1}}',
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_request_is_refused_with_its_error(run: RunDir, name: str) -> None:
    stem = f"20260101T000000-{abs(hash(name)) % 16**8:08x}"
    path = _request(run, stem, HOSTILE[name])
    assert isinstance(read_request(path, stem), str)
    assert pending_requests(run) == []
    response = json.loads((run.requests_dir / f"{stem}.response.json").read_text())
    assert response["status"] == "refused" and response["reason"].startswith("malformed")


def test_a_request_that_is_a_fifo_or_a_device_link_never_blocks(run: RunDir) -> None:
    run.requests_dir.mkdir()
    os.mkfifo(run.requests_dir / "20260101T000000-00000001.json")
    (run.requests_dir / "20260101T000000-00000002.json").symlink_to("/dev/zero")
    started = time.monotonic()
    assert pending_requests(run) == []
    assert time.monotonic() - started < 1.0
    for stem in ("20260101T000000-00000001", "20260101T000000-00000002"):
        body = json.loads((run.requests_dir / f"{stem}.response.json").read_text())
        assert body["status"] == "refused"


def test_a_request_flood_costs_a_bounded_time_per_poll(run: RunDir) -> None:
    run.requests_dir.mkdir()
    for i in range(3000):
        (run.requests_dir / f"20260101T000000-{i:08x}.json").write_text("junk")
    for i in range(2000):
        (run.requests_dir / f"junk-{i}.json").write_text("{}")
    started = time.monotonic()
    assert pending_requests(run) == []
    assert time.monotonic() - started < 2.0
    answered = list(run.requests_dir.glob("*.response.json"))
    assert len(answered) == MAX_REQUESTS_PER_POLL  # the rest wait for later polls
    good = "20260101T000001-0000000a"
    _request(run, good, '{"steps": 2, "ranks": [[0, 1]]}')
    for _ in range(3000 // MAX_REQUESTS_PER_POLL + 2):
        found = pending_requests(run)
        if found:
            break
    assert [r.request_id for r in found] == [good] and found[0].ranges == ((0, 1),)


def test_validate_request_refuses_negative_and_too_many_ranges() -> None:
    with pytest.raises(CaptureRequestError, match="non-negative"):
        validate_request(1, ((-5, 0),), 4)
    with pytest.raises(CaptureRequestError, match="at most 8"):
        validate_request(1, tuple((i, i) for i in range(9)), 100)


def test_rank0_polling_survives_every_hostile_request(
    run: RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distanom import request_desk
    from distanom.health import Health

    health = Health()
    desk = request_desk.RequestDesk(2, health.warn_once)
    for i, name in enumerate(sorted(HOSTILE)):
        _request(run, f"20260101T000000-{i:08x}", HOSTILE[name])
    _request(run, "20260101T000000-000000ff", '{"steps": 1, "ranks": [[5, 5]]}')  # no rank 5
    for _ in range(3):
        desk.poll(run)
    assert desk.offered is None and health.capture_off_reason is None
    assert len(list(run.requests_dir.glob("*.response.json"))) == len(HOSTILE) + 1
    good = "20260101T000001-00000001"
    _request(run, good, '{"steps": 2, "ranks": [[1, 1]]}')
    desk.poll(run)
    assert desk.offered is not None and desk.offered[1] == good

    def broken(*args: object, **kwargs: object) -> list[object]:
        raise RecursionError("maximum recursion depth exceeded")

    desk.carried()
    monkeypatch.setattr(request_desk, "pending_requests", broken)
    desk.poll(run)  # logged once, never raised into the round loop
    assert desk.offered is None and health.capture_off_reason is None


def test_a_removed_run_directory_is_said_once_for_every_writer(
    run: RunDir, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    from distanom.health import Health

    health = Health()
    health.run_dir = run.path
    health.warn_write_failed("status", "status file not written (%s)", "disk full")
    assert not health.run_dir_gone and health.capture_off_reason is None  # a writer's own
    shutil.rmtree(run.path)
    for key in ("status", "steps", "capture-tables", "answer"):
        health.warn_write_failed(key, "%s failed", key)
    assert health.run_dir_gone and health.capture_is_off()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "status file not written (disk full)",
        f"run directory {run.path} was removed; distanom writes nothing more (training goes on)",
    ]
    # a link put in its place is no run directory either: it is never written through
    other = Health()
    run.path.symlink_to(tmp_path, target_is_directory=True)
    other.run_dir = run.path
    assert other.check_run_dir() and other.capture_stepped_aside()


def test_a_capture_worker_reports_its_failures_through_the_agents_warning(
    run: RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    def tables_fail(*args: object) -> None:
        raise FileNotFoundError("the trace is gone")

    monkeypatch.setattr("distanom.analysis.tables_io.write_rank_tables", tables_fail)
    said: list[str] = []
    config = load_config(None, ["analysis.on_capture=now"])
    worker = CaptureWorker(
        run, WorldInfo.from_env({}), ReadyTracer(), config, tracer_name="ready",
        warn=lambda key, message, *args: said.append(key),
    )  # fmt: skip
    worker.submit([reference(3), reference(4)])
    wait_for(lambda: worker.stats.written == 2)
    worker.close(5.0)
    assert said == ["capture-tables"]  # the tables are left to the report after the first
