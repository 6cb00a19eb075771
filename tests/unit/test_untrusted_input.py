"""Traces and run directories are untrusted input: property tests of the trace reader and
a report over a damaged run directory."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distanom.analysis.engine import tables_from_trace
from distanom.analysis.report import Report, build_report, render_text, report_json, write_outputs
from distanom.analysis.run import RunData, load_run
from distanom.analysis.trace_io import Trace, load_trace
from distanom.errors import TraceFormatError
from distanom.rundir import RunDir, create_run, write_json_atomic

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
events = st.fixed_dictionaries(
    {},
    optional={
        "ph": st.sampled_from(["X", "M", "s", "f", "i", 3]),
        "cat": st.sampled_from(
            ["kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cpu_op", "ac2g", None, 7]
        ),
        "name": st.one_of(
            st.text(max_size=20), st.sampled_from(["ncclKernel", "cudaLaunchKernel"])
        ),
        "ts": st.one_of(st.floats(allow_nan=True), st.integers(), st.text(max_size=3), st.none()),
        "dur": st.one_of(st.floats(allow_nan=True), st.integers(-5, 100), st.none(), st.text()),
        "pid": json_values,
        "tid": json_values,
        "id": json_values,
        "args": st.one_of(
            json_values,
            st.fixed_dictionaries(
                {},
                optional={
                    "stream": json_values,
                    "correlation": json_values,
                    "device": json_values,
                },
            ),
        ),
    },
)
documents = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {"traceEvents": st.one_of(st.lists(events, max_size=12), json_values)},
        optional={"baseTimeNanoseconds": json_values, "distributedInfo": json_values},
    ),
)


def run_report(data: RunData) -> Report:
    """The report of a loaded run, its files written, as `distanom report` makes it."""
    return write_outputs(data, build_report(data))


def read_or_refuse(path: Path) -> Trace | None:
    try:
        trace = load_trace(path)
    except TraceFormatError as err:
        assert "\n" not in str(err) and str(path) in str(err)
        return None
    try:
        tables_from_trace(trace)
    except TraceFormatError as err:
        assert str(path) in str(err)
    return trace


@SETTINGS
@given(st.binary(max_size=300), st.booleans())
def test_random_bytes_are_refused_cleanly(tmp_path: Path, data: bytes, zipped: bool) -> None:
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(data) if zipped else data)
    read_or_refuse(path)


@SETTINGS
@given(documents)
def test_arbitrary_json_is_read_or_refused_cleanly(tmp_path: Path, document: object) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(document))
    read_or_refuse(path)


def test_truncated_gzip_is_a_format_error(tmp_path: Path) -> None:
    whole = gzip.compress(json.dumps({"traceEvents": [{"ph": "X"}] * 100}).encode())
    path = tmp_path / "t.json.gz"
    path.write_bytes(whole[: len(whole) // 2])
    assert read_or_refuse(path) is None


def test_report_of_a_damaged_run_shows_what_survived(tmp_path: Path) -> None:
    run = RunDir(create_run(tmp_path / "runs", None))
    write_json_atomic(run.run_json, {"world_size": 3, "hosts": ["a", "a", "b"]})
    good = Path(__file__).parent.parent / "data" / "cpu_ddp_gloo_rank0.json.gz"
    for rank in (0, 1):  # rank 2 never wrote its trace
        path = run.trace_path(7, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = good.read_bytes()
        path.write_bytes(data if rank == 0 else data[:200])  # rank 1: truncated
        run.append_index(
            {"event": "written", "step": 7, "rank": rank, "kind": "anomaly",
             "trace": run.relative(path), "step_ms": 30.0, "median_ms": 10.0}
        )  # fmt: skip
    with open(run.index_path, "a") as handle:
        handle.write('{"event": "written", "step": 9, "rank"')  # torn last line
    run.append_index(
        {"event": "written", "step": 8, "rank": 0, "kind": "anomaly", "trace": "../../x"}
    )
    report = run_report(load_run(str(run.path)))
    (capture,) = report_json(report)["captures"]
    assert capture["step"] == 7 and capture["missing_ranks"] == [2]
    assert "host_timeline" in capture["ranks"]["0"]
    assert "host_timeline" not in capture["ranks"]["1"]
    problems = "\n".join(report_json(report)["problems"])
    assert "index.jsonl line 3" in problems  # the torn line
    assert "escapes the run directory" in problems
    assert "step 7 rank 1" in problems  # the truncated trace is named
    text = render_text(report)
    assert "no trace from rank(s) 2" in text and "problems (" in text
