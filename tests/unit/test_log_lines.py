"""The quiet filter: which INFO lines a rank prints, and the end line's wording."""

from __future__ import annotations

import logging

from distanom.log_lines import HEADLINE, QuietFilter, end_line


def record(name: str, msg: str, args: tuple = (), level: int = logging.INFO, **extra: object):
    made = logging.LogRecord(name, level, __file__, 1, msg, args, None)
    made.__dict__.update(extra)
    return made


CAPTURE = "captured step %d (%s%s) -> %s"


def test_info_lines_are_start_end_and_rank_zeros_anomaly_captures() -> None:
    rank0, rank1 = QuietFilter(0, "INFO"), QuietFilter(1, "INFO")
    anomaly = record("distanom.capture", CAPTURE, (60, "anomaly", "", "x"))
    reference = record("distanom.capture", CAPTURE, (40, "reference", "", "x"))
    assert rank0.filter(anomaly) and not rank1.filter(anomaly)
    assert not rank0.filter(reference)
    assert rank1.filter(record("distanom.agent", "finished", **HEADLINE))
    assert not rank0.filter(record("distanom.tracers.cupti.tracer", "closed: %s", ({"a": 1},)))
    assert rank1.filter(record("distanom.capture", "disk full", level=logging.WARNING))
    assert QuietFilter(1, "DEBUG").filter(reference)


def test_end_line_says_what_was_captured_where_and_at_what_cost() -> None:
    line = end_line(
        outcome="finished", steps=200, skipped=3, kept=6, bytes_written=2_500_000,
        missed=1, where="runs/x", overhead_pct=1.25, capture_ms=12.34,
    )  # fmt: skip
    small = end_line(
        outcome="finished", steps=9, skipped=0, kept=2, bytes_written=48_200, missed=0,
        where=None, overhead_pct=None,
    )  # fmt: skip
    assert small == "finished: 9 steps; 2 trace files (48 kB); 0.0 ms of capture work"
    kept = end_line(
        outcome="finished", steps=160, skipped=0, kept=5, bytes_written=21_000, missed=0,
        where=None, overhead_pct=None, replaced=2,
    )  # fmt: skip
    assert kept.startswith("finished: 160 steps; 5 trace files (21 kB) after 2 replaced;")
    from distanom.capture import CaptureStats

    assert CaptureStats(written=7, dropped=2).kept == 5
    assert line == (
        "finished: 200 steps (3 with the optimizer step skipped); 6 trace files (2.5 MB), "
        "1 capture missed in runs/x; 12.3 ms of capture work; tracing cost 1.2% of step time"
    )


def test_a_stale_running_status_is_not_called_running(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    import pytest

    from distanom.errors import CaptureRequestError
    from distanom.live import request_capture

    (tmp_path / "status.json").write_text(
        json.dumps({"state": "running", "updated_at": 1.0, "status_interval_s": 2.0})
    )
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(CaptureRequestError, match="not running") as info:
        request_capture(str(tmp_path), 1, None, 1.0)
    assert "(running)" not in str(info.value) and "heartbeat stopped" in str(info.value)


def test_capture_checks_its_arguments_before_the_jobs_state(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    import pytest

    from distanom.errors import CaptureRequestError
    from distanom.live import request_capture

    (tmp_path / "status.json").write_text(json.dumps({"state": "finished", "updated_at": 1.0}))
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(CaptureRequestError, match=r"--steps must be 1\.\.\d+, got 0"):
        request_capture(str(tmp_path), 0, None, 1.0)
    with pytest.raises(CaptureRequestError, match="--ranks"):
        request_capture(str(tmp_path), 1, "x", 1.0)
    # good arguments: then the job's state is what is said
    with pytest.raises(CaptureRequestError, match=r"not running \(finished\)"):
        request_capture(str(tmp_path), 1, "0", 1.0)
