"""Planted hang records (issue 37's probes): a non-finite or overflowing number, a rank
outside the world, a world size a record claims, line breaks in one-line fields. Each
ends in a one-line problem or is ignored; none crashes the reader or inflates the
verdict (run.json's world size is the one that counts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distanom.analysis.hangs import judge_hang, read_hangs
from distanom.errors import RunDirError
from distanom.records.hangs import (
    CAUSE_NO_STEP,
    HangRecord,
    read_hang_record,
    record_path,
    write_hang_record,
)
from distanom.rundir import RunDir


def record(rank: int, world: int = 2, **changes: object) -> HangRecord:
    base = HangRecord(
        rank=rank, world_size=world, host="vm", pid=100 + rank, number=1, detected_at=1.0,
        cause=CAUSE_NO_STEP, reason="no step for 5 s", last_step=7, silent_s=5.0,
        after_s=5.0, threads=[], flight_recorder=None,
    )  # fmt: skip
    return HangRecord(**{**base.as_json(), **changes}) if changes else base  # type: ignore[arg-type]


def planted(run: RunDir, writer: int, **fields: object) -> Path:
    """Write rank `writer`'s record of hang 1, then overwrite fields in its JSON as a
    co-user could ("__INF__" becomes the literal 1e999, which Python reads as inf)."""
    path = write_hang_record(run, record(writer))
    body = json.loads(path.read_text())
    body.update(fields)
    text = json.dumps(body).replace('"__INF__"', "1e999")
    path.write_text(text)
    return path


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    (tmp_path / "r").mkdir()
    return RunDir(tmp_path / "r")


@pytest.mark.parametrize(
    "field", ["line", "last_step", "silent_s", "detected_at", "rank", "world_size", "pid"]
)
def test_a_non_finite_or_overflowing_number_is_a_damaged_record_not_a_crash(
    run: RunDir, field: str
) -> None:
    if field == "line":
        path = write_hang_record(run, record(0))
        body = json.loads(path.read_text())
        body["threads"] = [
            {"ident": 1, "name": "MainThread", "training": True,
             "frames": [{"file": "t.py", "line": "__INF__", "function": "f", "code": "x"}]}
        ]  # fmt: skip
        path.write_text(json.dumps(body).replace('"__INF__"', "1e999"))
    else:
        path = planted(run, 0, **{field: "__INF__"})
    with pytest.raises(RunDirError, match="damaged hang record"):
        read_hang_record(path)
    hangs, problems = read_hangs(run, 2)
    assert hangs == [] and len(problems) == 1


def test_a_claimed_world_size_and_a_rank_outside_the_world_change_nothing(run: RunDir) -> None:
    write_hang_record(run, record(0))
    planted(run, 1, world_size=131072)  # claims a huge world
    stranger = record_path(run, 1, 5)
    stranger.write_text(json.dumps({**record(5).as_json(), "version": 1}))
    hangs, problems = read_hangs(run, 2)
    assert problems == []
    (hang,) = hangs
    assert sorted(hang.ranks) == [0, 1]  # not 131072 ranks, not rank 5


def test_line_breaks_in_one_line_fields_cannot_forge_report_lines(run: RunDir) -> None:
    path = planted(run, 0, reason="stuck\nverdict: rank 1 — forged", host="a\r\nb")
    got = read_hang_record(path)
    assert "\n" not in got.reason and "\r" not in got.host
    assert got.reason == "stuck\\nverdict: rank 1 — forged"
    hang = judge_hang(1, [got, record(1)], 2)
    assert "\n" not in hang.summary()
