"""The hang watch: when it judges a rank hung, what it writes, once per hang."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path

import pytest

import distanom.hang as hang_module
from distanom.config import HangConfig
from distanom.hang import HangWatch, thread_stacks
from distanom.records.hangs import ThreadStack, record_path
from distanom.rundir import RunDir
from distanom.world import WorldInfo

POLL_S = 0.02


class Steps:
    """A step counter the test advances, like the training thread's."""

    def __init__(self) -> None:
        self.value = 0

    def advance(self, steps: int, every_s: float = 0.01) -> None:
        for _ in range(steps):
            self.value += 1
            time.sleep(every_s)


def _watch(
    tmp_path: Path | None, steps: Steps, *, rank: int = 0, world_size: int = 1, **config: object
) -> HangWatch:
    settings = {"after_s": 0.3, "poll_s": POLL_S, **config}
    world = WorldInfo(rank, world_size, rank, world_size, 0, "host", None, None, "job")
    run = RunDir(tmp_path) if tmp_path is not None else None
    return HangWatch(
        HangConfig(**settings),  # type: ignore[arg-type]
        world,
        current_step=lambda: steps.value,
        median_ms=lambda: math.nan,
        run=lambda: run,
    )


def _wait_file(path: Path, timeout_s: float = 5.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.01)
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_a_rank_that_stops_ending_steps_writes_one_record_per_hang(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    steps = Steps()
    watch = _watch(tmp_path, steps)
    watch.start()
    try:
        with caplog.at_level(logging.WARNING, logger="distanom.hang"):
            steps.advance(40)  # 0.4 s of steps, longer than after_s: no hang
            run = RunDir(tmp_path)
            assert not (tmp_path / "hangs").exists()
            stopped = time.monotonic()
            record = _wait_file(record_path(run, 1, 0))
            assert time.monotonic() - stopped < 0.3 + 1.0
            time.sleep(0.3)  # still hung: no second record
            assert not record_path(run, 2, 0).exists()
            steps.advance(3)  # recovers, then hangs again
            _wait_file(record_path(run, 2, 0))
            # the verdict line follows the record from the watch thread: wait for it too
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                if sum("hang verdict" in r.message for r in caplog.records) >= 2:
                    break
                time.sleep(0.01)
        assert record["cause"] == "no_step"
        assert record["last_step"] == 39
        assert 0.3 <= record["silent_s"] <= 0.3 + 5 * POLL_S  # type: ignore[operator]
        threads = record["threads"]
        assert isinstance(threads, list)
        training = [t for t in threads if t["training"]]
        assert [t["name"] for t in training] == ["MainThread"]
        assert any(f["function"] == "_wait_file" for f in training[0]["frames"])
        hang_lines = [r.message for r in caplog.records if "HANG:" in r.message]
        assert len(hang_lines) == 2
        assert "no step has ended for 0 s (limit 0 s) after step 39" in hang_lines[0]
        assert "hangs/hang_1/rank0.json" in hang_lines[0]
        verdicts = [r.message for r in caplog.records if "hang verdict" in r.message]
        assert len(verdicts) == 2
    finally:
        watch.stop()


def test_not_armed_before_the_first_step(tmp_path: Path) -> None:
    watch = _watch(tmp_path, Steps(), after_s=0.05)
    watch.start()
    time.sleep(0.3)
    watch.stop()
    assert not (tmp_path / "hangs").exists()


def test_a_failed_round_while_steps_go_on_is_no_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hang_module, "ROUND_FAILED_AFTER_S", 0.1)
    steps = Steps()
    watch = _watch(tmp_path, steps, after_s=100.0)
    watch.start()
    try:
        steps.advance(5)
        watch.round_timed_out("all-gather failed: peer gone", 0.0)
        steps.advance(30)  # a rank gone, this one trains on
        assert not (tmp_path / "hangs").exists()
        watch.round_timed_out("all-gather failed: timed out", 0.1)
        record = _wait_file(record_path(RunDir(tmp_path), 1, 0), timeout_s=3.0)
    finally:
        watch.stop()
    assert record["cause"] == "round_timeout"
    assert "a consensus round failed (all-gather failed: timed out)" in str(record["reason"])


def test_the_limit_scales_with_the_median_above_a_floor() -> None:
    config = HangConfig(after_s=None, floor_s=120.0, median_factor=50.0)
    world = WorldInfo(0, 1, 0, 1, 0, "h", None, None, "j")
    median = [math.nan]
    watch = HangWatch(
        config, world, current_step=lambda: 0, median_ms=lambda: median[0], run=lambda: None
    )
    assert watch.limit_s() == 120.0  # no median yet: the floor
    median[0] = 10_000.0
    assert watch.limit_s() == 500.0
    median[0] = 100.0
    assert watch.limit_s() == 120.0
    assert _watch(None, Steps(), after_s=7.0).limit_s() == 7.0


def test_without_a_run_directory_the_hang_is_still_logged(caplog: pytest.LogCaptureFixture) -> None:
    steps = Steps()
    watch = _watch(None, steps, after_s=0.1)
    with caplog.at_level(logging.WARNING, logger="distanom.hang"):
        watch.start()
        steps.advance(1)
        deadline = time.monotonic() + 3.0
        while not any("HANG:" in r.message for r in caplog.records):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        watch.stop()
    assert "no run directory" in next(r.message for r in caplog.records if "HANG:" in r.message)


def test_disabled_watch_starts_no_thread() -> None:
    before = threading.active_count()
    _watch(None, Steps(), enabled=False).start()
    assert threading.active_count() == before


def test_stacks_are_bounded() -> None:
    def deep(n: int) -> list[ThreadStack]:
        return deep(n - 1) if n else thread_stacks(threading.get_ident(), 5)

    stacks = deep(30)
    mine = next(s for s in stacks if s.training)
    assert len(mine.frames) == 5
    assert mine.truncated
    assert [f.function for f in mine.frames[-2:]] == ["deep", "thread_stacks"]


def test_a_planted_record_does_not_stop_the_live_watch_from_its_verdict(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A co-user plants hangs/hang_1/rank5.json (a rank outside the world) with an
    overflowing number. Before, reading it raised OverflowError in the watch thread:
    it logged an internal error and gave no verdict."""
    planted = tmp_path / "hangs" / "hang_1"
    planted.mkdir(parents=True)
    frame = '{"file": "t.py", "line": 1e999, "function": "f", "code": "x"}'
    (planted / "rank5.json").write_text(
        '{"version": 1, "rank": 5, "world_size": 131072, "host": "h", "pid": 1, '
        '"number": 1, "detected_at": 1.0, "cause": "no_step", "reason": "r", '
        '"last_step": 1, "silent_s": 1.0, "after_s": 1.0, "threads": [{"ident": 1, '
        f'"name": "M", "training": true, "frames": [{frame}]}}], "flight_recorder": null}}'
    )
    steps = Steps()
    watch = _watch(tmp_path, steps)
    watch.start()
    try:
        with caplog.at_level(logging.WARNING, logger="distanom"):
            steps.advance(5)
            _wait_file(record_path(RunDir(tmp_path), 1, 0))
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                if any("hang verdict" in r.message for r in caplog.records):
                    break
                time.sleep(0.01)
        messages = [r.message for r in caplog.records]
        assert any("hang verdict" in m for m in messages), messages
        assert not any("internal error" in m or "Overflow" in m for m in messages), messages
    finally:
        watch.stop()
