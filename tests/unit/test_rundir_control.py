from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from distanom.errors import CaptureRequestError, RunDirError
from distanom.records.index import IndexDropped, IndexWritten, read_index
from distanom.records.requests import (
    Accepted,
    answer,
    parse_ranks,
    pending_requests,
    read_response,
    submit_request,
    validate_request,
)
from distanom.records.run_info import build_run_info
from distanom.records.status import job_alive, write_status
from distanom.records.steps import STEPS_CSV_HEADER, StepRow, StepsWriter, read_steps
from distanom.rundir import RunDir, create_run, update_latest, write_json_atomic


def new_run(tmp_path: Path) -> RunDir:
    path = create_run(tmp_path / "runs", "demo")
    write_json_atomic(path / "run.json", {"world_size": 4})
    return RunDir(path)


def test_run_ids_are_unique_and_latest_follows(tmp_path: Path) -> None:
    base = tmp_path / "runs"
    first = create_run(base, "job")
    second = create_run(base, "job")
    assert first != second and first.name.startswith("job-") and second.is_dir()
    update_latest(base, first)
    update_latest(base, second)
    assert (base / "latest").resolve() == second.resolve()
    write_json_atomic(second / "run.json", {})
    assert RunDir.open(base).path == second.resolve()


def test_open_refuses_non_run_directories(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="no such run directory"):
        RunDir.open(tmp_path / "absent")
    with pytest.raises(RunDirError, match="not a distanom run directory"):
        RunDir.open(tmp_path)


def test_files_honour_the_umask_and_nothing_is_world_writable(tmp_path: Path) -> None:
    run = new_run(tmp_path)
    write_json_atomic(run.path / "x.json", {"a": 1})
    run.append_index({"event": "written", "step": 1, "rank": 0, "trace": "t"})
    for path in (run.path / "x.json", run.index_path, run.path):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert not mode & stat.S_IWOTH, path
    assert stat.S_IMODE(os.stat(run.path / "x.json").st_mode) & stat.S_IRUSR


def test_index_survives_damaged_lines(tmp_path: Path) -> None:
    run = new_run(tmp_path)
    run.append_index({"event": "written", "step": 3, "rank": 0, "trace": "a"})
    with open(run.index_path, "a") as handle:
        handle.write('{"event": "written", "step": 4, "ra\n')  # truncated by a crash
        handle.write('{"event": "written", "step": -1, "rank": 0}\n')
        handle.write("[1, 2]\n")
    run.append_index({"event": "dropped", "step": 3, "rank": 0})
    records, problems = read_index(run)
    assert [r.event for r in records] == ["written", "dropped"]
    assert [p.line for p in problems] == [2, 3, 4]


def test_paths_from_files_cannot_escape(tmp_path: Path) -> None:
    run = new_run(tmp_path)
    assert run.inside("captures/step_1/rank0.trace.json.gz").is_relative_to(run.path)
    for evil in ("../../etc/passwd", "/etc/passwd", "", "a\x00b"):
        with pytest.raises(RunDirError):
            run.inside(evil)


def test_atomic_write_leaves_no_partial_file(tmp_path: Path) -> None:
    run = new_run(tmp_path)
    target = run.path / "big.json"

    class Boom:
        pass

    with pytest.raises(TypeError):
        write_json_atomic(target, {"x": Boom()})
    assert not target.exists()
    assert [p for p in run.path.iterdir() if p.name.startswith(".big")] == []


def test_parse_ranks() -> None:
    assert parse_ranks(None) == ()
    assert parse_ranks("all") == ()
    assert parse_ranks("3,0,4-5,1") == ((0, 1), (3, 5))
    for bad, match in (("a", "not a rank"), ("5-3", "backwards"), ("-1", "not a rank")):
        with pytest.raises(CaptureRequestError, match=match):
            parse_ranks(bad)
    with pytest.raises(CaptureRequestError, match="at most 8"):
        parse_ranks(",".join(str(2 * i) for i in range(9)))


def test_validate_request() -> None:
    validate_request(2, ((0, 3),), 4)
    with pytest.raises(CaptureRequestError, match="rank 7 does not exist"):
        validate_request(1, ((7, 7),), 4)
    with pytest.raises(CaptureRequestError, match="--steps"):
        validate_request(0, (), 4)
    with pytest.raises(CaptureRequestError, match="--steps"):
        validate_request(10_000, (), 4)


def test_request_response_protocol(tmp_path: Path) -> None:
    run = new_run(tmp_path)
    first = submit_request(run, 2, ((1, 1),))
    time.sleep(1.1)  # ids sort by time: the second must come after the first
    second = submit_request(run, 1, ())
    (run.requests_dir / "junk.json").write_text("not a request")
    pending = pending_requests(run)
    assert [p.request_id for p in pending] == [first, second]
    assert pending[0].n_steps == 2 and pending[0].ranges == ((1, 1),)
    answer(run, first, Accepted(request="1", steps=[5, 6], ranks=[1], world_size=4))
    assert read_response(run, first) == {
        "status": "accepted",
        "request": "1",
        "steps": [5, 6],
        "ranks": [1],
        "world_size": 4,
    }
    assert [p.request_id for p in pending_requests(run)] == [second]
    # a malformed request file is answered, not retried forever
    broken = second.replace(second[-8:], "deadbeef")
    (run.requests_dir / f"{broken}.json").write_text("{")
    pending_requests(run)
    assert (
        json.loads((run.requests_dir / f"{broken}.response.json").read_text())["status"]
        == "refused"
    )


def test_job_alive_needs_a_fresh_running_heartbeat(tmp_path: Path) -> None:
    run = new_run(tmp_path)
    write_status(run, {"state": "running", "status_interval_s": 1.0})
    status = json.loads(run.status_json.read_text())
    assert job_alive(status)
    assert not job_alive(status, now=status["updated_at"] + 120)
    assert not job_alive({**status, "state": "finished"})
    assert not job_alive(None)


def test_step_rows_keep_their_bytes_and_older_files_still_read(tmp_path: Path) -> None:
    row = StepRow(7, 12.345678, True, False, 0.5, 1.25, 2)
    unknown = ",nan" * 9  # phases not known
    assert row.line() == "7,12.3457,1,0,0.500,1.250,2,0" + unknown + "\n"
    phased = StepRow(9, 2.0, False, False, 0.0, phases=(1.0,) * 6 + (0.5,) * 3)
    assert phased.line().endswith(",0" + ",1.000" * 6 + ",0.500" * 3 + "\n")
    path = tmp_path / "steps" / "rank0.csv"
    writer = StepsWriter(path)
    writer.write_rows([row])
    writer.write_rows([StepRow(8, 3.0, False, True, 0.0)])
    writer.close()
    writer = StepsWriter(path)
    writer.write_rows([phased])
    writer.close()
    assert path.read_text() == (
        STEPS_CSV_HEADER + row.line() + "8,3.0000,0,1,0.000,0.000,-1,0" + unknown + "\n"
        + phased.line()
    )  # fmt: skip
    read = read_steps(path)
    assert read.bad == 0 and [r.step for r in read.rows] == [7, 8, 9]
    assert read.rows[2].phases == phased.phases
    assert read.rows[0].gc_pause == (1.25, 2) and read.rows[1].gc_pause is None
    older = tmp_path / "older.csv"
    older.write_text("step,duration_ms,traced\n1,2.5,1\nx,1,0\n2,3.5,0,1,0.2,nan,2\n")
    read = read_steps(older)
    assert read.bad == 1
    assert read.rows == [StepRow(1, 2.5, True, False, 0.0), StepRow(2, 3.5, False, True, 0.2)]


def test_step_fields_write_the_same_text_as_step_rows(tmp_path: Path) -> None:
    def old_line(r: StepRow) -> str:  # the f-string StepRow.line used before ROW_FORMAT
        return (
            f"{r.step},{r.duration_ms:.4f},{int(r.traced)},{int(r.after_flush)},"
            f"{r.self_ms:.3f},{r.gc_ms:.3f},{r.gc_generation},{int(r.skipped)}"
            + "".join(f",{value:.3f}" for value in r.phases)
            + "\n"
        )

    nan, inf = float("nan"), float("inf")
    rows = [
        StepRow(0, 0.0, False, False, 0.0),
        StepRow(7, 12.345678, True, False, 0.5, 1.25, 2),
        StepRow(2**40, 1e9, True, True, 1e-9, 0.00049, 0, True),
        StepRow(3, nan, False, True, inf, -inf, -1, False),
        StepRow(4, -0.0, True, False, 3, 2, 1, True),  # ints where floats go
    ]
    assert [row.line() for row in rows] == [old_line(row) for row in rows]
    by_rows, by_fields = tmp_path / "rows.csv", tmp_path / "fields.csv"
    writer = StepsWriter(by_rows)
    writer.write_rows(rows)
    writer.close()
    writer = StepsWriter(by_fields)
    writer.write_fields(
        [
            (
                r.step,
                r.duration_ms,
                r.traced,
                r.after_flush,
                r.self_ms,
                r.gc_ms,
                r.gc_generation,
                r.skipped,
                *r.phases,
            )
            for r in rows
        ]
    )
    writer.close()
    assert by_fields.read_text() == by_rows.read_text()


def test_index_and_run_json_keep_their_keys(tmp_path: Path) -> None:
    written = IndexWritten(
        step=3, rank=1, host="h", kind="anomaly", trace="captures/step_3/rank1.trace.json.gz",
        bytes=10, step_ms=4.0, median_ms=2.0, threshold_ms=3.0, slowest_rank=1, episode=None,
        request=None, tracer="kineto", tracer_stats={}, time=1.0,
    )  # fmt: skip
    assert list(written.to_json()) == [
        "event", "step", "rank", "host", "kind", "trace", "bytes", "step_ms", "median_ms",
        "threshold_ms", "slowest_rank", "episode", "request", "tracer", "tracer_stats", "time",
    ]  # fmt: skip
    with_cost = IndexWritten(**{**vars(written), "cost_ms": {"write_ms": 0.5}})
    assert with_cost.to_json()["cost_ms"] == {"write_ms": 0.5}
    assert IndexDropped(3, 1, "anomaly", 9).to_json() == {
        "event": "dropped", "step": 3, "rank": 1, "kind": "anomaly", "replaced_by": 9,
    }  # fmt: skip
    info = build_run_info(
        run_id="r", versions={"distanom": "0", "torch": "t", "cuda": None, "python": "3"},
        world_size=2, started_at=1.0, argv=["x"], config={}, hosts=["a", "b"],
    )  # fmt: skip
    assert list(info) == [
        "run_id", "distanom", "torch", "cuda", "python", "world_size", "started_at", "argv",
        "config", "hosts", "nodes",
    ]  # fmt: skip
    assert info["nodes"] == {"a": [0], "b": [1]}


def test_a_live_file_is_fsynced_only_when_final_and_writes_nan_as_null(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distanom.rundir import write_live_json

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    path = tmp_path / "status.json"
    write_live_json(path, {"median_ms": float("nan"), "ranks": {1: "a"}})
    assert json.loads(path.read_text()) == {"median_ms": None, "ranks": {"1": "a"}}
    assert synced == []  # rewritten every few seconds: not flushed to disk
    write_live_json(path, {"state": "finished", "big": 2**70}, final=True)  # json's path
    assert json.loads(path.read_text()) == {"state": "finished", "big": 2**70}
    assert len(synced) == 1
