"""Fuzzing the records issue 37 hardened (hypothesis): a hang record, an anomaly line and
stragglers.json built from well-formed records with any field replaced by any JSON value
(huge integers, non-finite numbers, wrong types, text with line breaks). Each reader
returns a record or a one-line `RunDirError`, and whatever it returns renders and goes
through a strict JSON writer: no other exception, no non-finite number."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distanom.analysis.anomalies import anomalies_of
from distanom.analysis.hangs import judge_hang
from distanom.errors import RunDirError
from distanom.records.anomalies import AnomalyRecord, read_stragglers, stragglers_path
from distanom.records.hangs import read_hang_record
from distanom.rundir import RunDir

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["a\nb", "\r", "1e999"]),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
HANG = {
    "version": 1, "rank": 0, "world_size": 2, "host": "h", "pid": 1, "number": 1,
    "detected_at": 1.0, "cause": "no_step", "reason": "r", "last_step": 3, "silent_s": 1.0,
    "after_s": 1.0, "flight_recorder": None,
    "threads": [{"ident": 1, "name": "M", "training": True,
                 "frames": [{"file": "t.py", "line": 3, "function": "f", "code": "x"}]}],
}  # fmt: skip
ANOMALY = {
    "v": 1, "step": 40, "step_ms": 90.0, "median_ms": 10.0, "threshold_ms": 15.0,
    "traced": False, "judged_by": "condition", "slowest_rank": 1,
    "durations_ms": [12.0, 90.0], "evidence": [{"arrive_ms": 2.0}, {"arrive_ms": 80.0}],
    "arrive_median_ms": [2.0, 2.0], "cpu_median_ms": [1.0, 1.0],
}  # fmt: skip
STRAGGLERS = {
    "stragglers": [{"rank": 1, "score": 0.3, "since_step": 5, "evidence": {"late_steps": 9}}],
    "earlier": [{"rank": 0, "since_step": 1, "until_step": 9, "peak_score": 0.1}],
    "drift": {"ratio": 2.0, "first_ms": 1.0, "last_ms": 2.0},
}


def _mutated(base: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    return {**base, key: value}


def _strict_json(obj: Any) -> None:
    json.dumps(obj, allow_nan=False, default=str)


@SETTINGS
@given(key=st.sampled_from(sorted(HANG)), value=values)
def test_a_hang_record_with_any_field_replaced(tmp_path: Path, key: str, value: Any) -> None:
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps(_mutated(HANG, key, value)).replace("Infinity", "1e999"))
    try:
        record = read_hang_record(path)
    except RunDirError as err:
        assert "\n" not in str(err)
        return
    hang = judge_hang(1, [record], 2)
    assert "\n" not in hang.summary() and sorted(hang.ranks) == [0, 1]
    _strict_json(hang.as_json())


@SETTINGS
@given(key=st.sampled_from(sorted(ANOMALY)), value=values)
def test_an_anomaly_line_with_any_field_replaced(key: str, value: Any) -> None:
    try:
        record = AnomalyRecord.from_json(_mutated(ANOMALY, key, value), 2)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
        return  # the reader skips the line (read_anomalies catches exactly these)
    assert 0 <= record.step < 2**53 and len(record.evidence) <= 2
    for anomaly in anomalies_of([record]):
        _strict_json(anomaly.as_json())
        assert math.isfinite(anomaly.step)


@SETTINGS
@given(key=st.sampled_from(sorted(STRAGGLERS)), value=values)
def test_stragglers_json_with_any_field_replaced(tmp_path: Path, key: str, value: Any) -> None:
    run = RunDir(tmp_path)
    text = json.dumps(_mutated(STRAGGLERS, key, value)).replace("Infinity", "1e999")
    stragglers_path(run).write_text(text)
    read = read_stragglers(run)
    _strict_json(read)
    for entry in read.get("stragglers", []):
        assert isinstance(entry["evidence"], dict) and math.isfinite(entry["score"])
