"""The hang record's format and the hang verdict (which rank the others wait for)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distanom.analysis.hangs import hang_lines, judge_hang, read_hangs
from distanom.errors import RunDirError
from distanom.records.hangs import (
    CAUSE_NO_STEP,
    Collective,
    Frame,
    GroupCollectives,
    HangRecord,
    ThreadStack,
    read_hang_record,
    record_path,
    write_hang_record,
)
from distanom.rundir import RunDir

TORCH_WAIT = Frame("/venv/site-packages/torch/autograd/graph.py", 979, "_engine_run_backward", "")
USER_WAIT = Frame("train.py", 7, "wait_forever", "threading.Event().wait()")
MAIN = Frame("train.py", 30, "<module>", "main()")


def _group(entered: int, in_flight: bool, group: str = "default_pg") -> GroupCollectives:
    recent = [
        Collective(seq, "gloo:all_reduce", "scheduled", seq < entered or not in_flight, seq)
        for seq in range(max(1, entered - 2), entered + 1)
    ]
    return GroupCollectives(
        group=group,
        last_enqueued=entered,
        last_completed=entered - 1 if in_flight else entered,
        in_flight=[c for c in recent if not c.completed],
        recent=recent,
    )


def _record(
    rank: int,
    *,
    last_step: int = 24,
    frames: list[Frame] | None = None,
    groups: list[GroupCollectives] | None = None,
    world_size: int = 2,
) -> HangRecord:
    stack = ThreadStack(1, "MainThread", True, frames or [MAIN, TORCH_WAIT])
    other = ThreadStack(2, "distanom-hang", False, [Frame("hang.py", 1, "_watch", "")])
    return HangRecord(
        rank=rank,
        world_size=world_size,
        host="h",
        pid=100 + rank,
        number=1,
        detected_at=1000.0 + rank,
        cause=CAUSE_NO_STEP,
        reason="no step has ended for 4 s (limit 4 s)",
        last_step=last_step,
        silent_s=4.2,
        after_s=4.0,
        threads=[other, stack],
        flight_recorder=groups,
        flight_recorder_note=None if groups else "Flight Recorder is off",
    )


def test_the_rank_that_never_entered_the_collective_is_the_culprit() -> None:
    records = [
        _record(0, groups=[_group(26, in_flight=True)]),
        _record(1, frames=[MAIN, USER_WAIT], groups=[_group(25, in_flight=False)]),
        _record(2, groups=[_group(26, in_flight=True)]),
    ]
    hang = judge_hang(1, records, 3)
    assert hang.culprit_rank == 1
    assert hang.step == 25
    assert hang.detected_at == 1000.0
    assert "rank 1 never entered gloo:all_reduce #26 on default_pg" in hang.cause
    assert "ranks 0, 2 wait in" in hang.cause
    assert "train.py:7 in wait_forever" in hang.cause  # the script's frame, not a library's
    body = hang.as_json()
    assert set(body) == {"step", "detected_at", "culprit_rank", "cause", "ranks", "ranks_unlisted"}
    assert set(body["ranks"]["1"]) == {"stack", "collective", "last_step"}
    assert body["ranks"]["1"]["stack"][-1] == "train.py:7 in wait_forever: threading.Event().wait()"
    assert body["ranks"]["0"]["collective"] == {
        "group": "default_pg",
        "op": "gloo:all_reduce",
        "seq": 26,
        "completed": False,
    }


def test_the_most_behind_rank_is_named_first() -> None:
    records = [
        _record(0, groups=[_group(30, in_flight=True)]),
        _record(1, groups=[_group(29, in_flight=False)]),
        _record(2, groups=[_group(27, in_flight=False)]),
    ]
    assert judge_hang(1, records, 3).culprit_rank == 2


def test_a_rank_without_a_record_is_the_culprit_when_the_others_all_wait() -> None:
    records = [_record(0, groups=[_group(26, True)]), _record(2, groups=[_group(26, True)])]
    hang = judge_hang(1, records, 3)
    assert hang.culprit_rank == 1
    assert "wrote no hang record" in hang.cause
    assert hang.ranks[1].last_step is None
    assert hang.step == 25
    assert "  rank 1: no hang record" in hang_lines(hang)


def test_without_flight_recorder_the_rank_behind_in_steps_is_named() -> None:
    hang = judge_hang(1, [_record(0, last_step=24), _record(1, last_step=23)], 2)
    assert hang.culprit_rank == 1
    assert "last completed step is 23" in hang.cause
    assert hang.step == 24


def test_without_flight_recorder_the_one_rank_outside_torch_is_named() -> None:
    records = [_record(0), _record(1, frames=[MAIN, USER_WAIT]), _record(2)]
    hang = judge_hang(1, records, 3)
    assert hang.culprit_rank == 1
    assert "in the script's own code while ranks 0, 2 wait inside torch" in hang.cause


def test_no_culprit_when_no_rank_stands_out() -> None:
    hang = judge_hang(1, [_record(0), _record(1)], 2)
    assert hang.culprit_rank is None
    assert "no rank stands out" in hang.summary()


def test_records_round_trip_and_the_report_reads_them(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    records = [
        _record(0, groups=[_group(26, True)]),
        _record(1, frames=[MAIN, USER_WAIT], groups=[_group(25, False)]),
    ]
    for record in records:
        path = write_hang_record(run, record)
        assert path == record_path(run, 1, record.rank)
        assert read_hang_record(path) == record
    hangs, problems = read_hangs(run, 2)
    assert problems == []
    assert [h.culprit_rank for h in hangs] == [1]
    lines = hang_lines(hangs[0])
    assert lines[0].startswith("HANG 1: hung at step 25: culprit rank 1")
    assert any("waits in it" in line for line in lines)
    assert lines[-1].endswith("train.py:7 in wait_forever: threading.Event().wait()")


def test_a_damaged_record_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    write_hang_record(run, _record(0, groups=[_group(26, True)]))
    bad = record_path(run, 1, 1)
    bad.write_text('{"version": 1, "rank": 1}')
    newer = record_path(run, 2, 0)
    newer.parent.mkdir()
    newer.write_text(json.dumps({"version": 99}))
    hangs, problems = read_hangs(run, 2)
    assert len(hangs) == 1  # hang 2 has no readable record
    assert hangs[0].culprit_rank == 1  # rank 1 wrote nothing readable
    assert any("damaged hang record" in p for p in problems)
    assert any("version 99" in p for p in problems)
    with pytest.raises(RunDirError, match="damaged hang record"):
        read_hang_record(bad)
