"""Every reader against hostile run files: one line naming the file (or a problem in the
report), bounded time and memory, never a traceback; fuzzed with hypothesis."""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distanom.analysis import trace_io
from distanom.analysis.report import build_report, render_text, report_json
from distanom.analysis.run import load_run
from distanom.analysis.tables import read_kernel_summary_csv, write_kernel_summary_csv
from distanom.cli import main as cli_main
from distanom.errors import RunDirError
from distanom.live import render_status
from distanom.records.index import read_index
from distanom.records.requests import read_request, read_response
from distanom.records.status import read_status, stale_since
from distanom.records.steps import read_steps
from distanom.rundir import RunDir, read_json, write_json_atomic
from distanom.sanitize import terminal_safe
from tests.unit.rungen import Capture, make_run
from tests.unit.stepgen import gpu_job

FUZZ = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12))
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
STATUS_KEYS = ["state", "updated_at", "world_size", "step", "tracer", "captures", "detector",
               "recent_ms", "slowest_ranks", "episodes", "median_ms", "capture_off"]  # fmt: skip
RUN_KEYS = ["world_size", "hosts", "config", "argv", "started_at", "torch"]


def a_run(tmp_path: Path, hosts: tuple[str, ...] = ("a", "b")) -> RunDir:
    return make_run(tmp_path, [Capture(20, "anomaly", gpu_job(len(hosts)), 4.1, 1.2)], hosts=hosts)


def report_of(run: RunDir) -> tuple[str, dict]:
    report = build_report(load_run(str(run.path)))
    return render_text(report), report_json(report)


def replace(path: Path, data: bytes | str) -> None:
    path.unlink()
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli_main(args)
    out, err = capsys.readouterr()
    return code, out, err


# -- damaged run files: the report shows what survived ------------------------------------


@pytest.mark.parametrize(
    "name,data",
    [
        ("status.json", "[" * 100_000 + "]" * 100_000),
        (
            "status.json",
            '{"state": "running", "updated_at": "x", "tracer": [1], "detector": 5,'
            ' "recent_ms": {"x": "y"}, "captures": {"bytes": [1]}, "episodes": 3}',
        ),
        ("status.json", '{"state": "running", "updated_at": 1e999}'),
        ("run.json", '{"world_size": 100000000, "hosts": {"a": 1}, "config": {"detect": []}}'),
        ("run.json", '{"world_size": ' + "9" * 5000 + "}"),
        ("run.json", '{"argv": "x", "started_at": [], "torch": {}}'),
        ("index.jsonl", "[" * 3000 + "\n" + '{"step": ' + "9" * 400 + ', "rank": 0}\n'),
    ],
)
def test_damaged_run_files_are_problems_not_crashes(tmp_path: Path, name: str, data: str) -> None:
    run = a_run(tmp_path)
    path = run.path / name
    if name == "index.jsonl":
        with open(path, "a") as handle:
            handle.write(data)
    else:
        replace(path, data)
    started = time.monotonic()
    text, body = report_of(run)
    assert time.monotonic() - started < 20
    assert body["captures"] and body["captures"][0]["step"] == 20  # what survived
    assert body["problems"] and "problems (" in text


@pytest.mark.parametrize("name", ["status.json", "run.json", "index.jsonl", "steps/rank1.csv"])
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_fifo_or_a_device_link_in_place_of_a_run_file(
    tmp_path: Path, name: str, kind: str
) -> None:
    run = a_run(tmp_path)
    path = run.path / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    result: list[dict] = []
    worker = threading.Thread(target=lambda: result.append(report_of(run)[1]), daemon=True)
    worker.start()
    worker.join(30)
    assert result, "the report blocked"
    problems = "\n".join(result[0]["problems"])
    assert Path(name).name in problems or name == "status.json"


def test_a_huge_csv_field_is_one_damaged_row(tmp_path: Path) -> None:
    run = a_run(tmp_path)
    with open(run.steps_csv(0), "a") as handle:
        handle.write("1" + "9" * 200_000 + ",1.0,1\n")
        handle.write("500,inf,1\n")
    read = read_steps(run.steps_csv(0))
    assert read.bad == 2 and len(read.rows) == 99
    assert "steps/rank0.csv: 2 unreadable" in "\n".join(report_of(run)[1]["problems"])


def test_world_size_out_of_range_is_a_problem_and_bounded(tmp_path: Path) -> None:
    run = a_run(tmp_path)
    info = json.loads(run.run_json.read_text())
    write_json_atomic(run.run_json, {**info, "world_size": 10**8})
    started = time.monotonic()
    _, body = report_of(run)
    assert time.monotonic() - started < 20
    assert any("world_size 100000000" in p for p in body["problems"])


# -- traces ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        '{"cat": "kernel", "name": "k", "ph": "X", "ts": 1%s, "dur": 5}' % ("0" * 400),
        '{"cat": "kernel", "name": "k", "ph": "X", "ts": 1e308, "dur": 1e308}',
        '{"cat": "cpu_op", "name": "c", "ph": "X", "ts": 1e308, "dur": 1e308, "pid": 1, "tid": 1}',
        '{"cat": "cpu_op", "name": "c", "ph": "X", "ts": 1%s, "dur": 1, "pid": 1, "tid": 1}'
        % ("0" * 400),
    ],
)
def test_absurd_timestamps_never_crash_analyze_or_report(
    tmp_path: Path, event: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = '{{"baseTimeNanoseconds": 1{}, "traceEvents": [{}]}}'.format("0" * 400, event)
    trace = tmp_path / "t.json"
    trace.write_text(text)
    code, out, err = cli(["analyze", str(trace), "--json"], capsys)
    assert code in (0, 2) and "Traceback" not in err and len(err.splitlines()) <= 1
    run = a_run(tmp_path / "r")
    run.trace_path(20, 1).write_bytes(gzip.compress(text.encode()))
    code, out, err = cli(["report", str(run.path), "--json"], capsys)
    assert code == 0 and json.loads(out)["captures"]
    code, out, err = cli(["report", str(run.path)], capsys)
    assert code == 0


def test_a_trace_too_large_for_memory_is_refused_before_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "bomb.json.gz"
    padding = " " * 4_000_000
    trace.write_bytes(gzip.compress(('{"traceEvents": []' + padding + "}").encode()))
    monkeypatch.setattr(trace_io, "available_memory", lambda: 30 * 1_000_000)
    with pytest.raises(trace_io.TraceFormatError, match="too large to parse here"):
        trace_io.load_trace(trace)
    monkeypatch.setattr(trace_io, "available_memory", lambda: 30 * 10_000_000)
    assert trace_io.load_trace(trace).gpu_events == ()


# -- what reaches a terminal or a spreadsheet ---------------------------------------------


def test_terminal_output_carries_no_escape_sequences(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = a_run(tmp_path, hosts=("a\x1b]0;owned\x07", "b\x1b[2J"))
    status = json.loads(run.status_json.read_text())
    write_json_atomic(run.status_json, {**status, "capture_off": "off\x1b[31m", "tracer": {
        "note": "note\x9b2J\u202e"}})  # fmt: skip
    code, out, _ = cli(["report", str(run.path)], capsys)
    assert code == 0 and "\x1b" not in out and "\\x1b" in out
    code, out, _ = cli(["status", str(run.path)], capsys)
    assert code == 0 and "\x1b" not in out and "\x9b" not in out and "\u202e" not in out
    trace = tmp_path / "k.json"
    trace.write_text(json.dumps({"traceEvents": [{"cat": "kernel", "name": "k\x1b[31m",
        "ph": "X", "ts": 1, "dur": 2, "args": {"stream": 7}}]}))  # fmt: skip
    code, out, _ = cli(["analyze", str(trace)], capsys)
    assert code == 0 and "\x1b" not in out and "k\\x1b[31m" in out
    assert terminal_safe("a\tb\nc\x00\x7f") == "a\tb\nc\\x00\\x7f"


def test_formula_cells_are_escaped_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "k.csv"
    names = ['=HYPERLINK("x")', "+1", "-cmd", "@SUM(A1)", "void gemm<float>(...)"]
    rows = [{"Kernel name": n, "Kernel stream": -1 if i == 0 else 7,
             "Kernel duration (µs)_count": 1} for i, n in enumerate(names)]  # fmt: skip
    write_kernel_summary_csv(path, rows)
    text = path.read_text()
    assert "'=HYPERLINK" in text and "'+1" in text and "'-cmd" in text and "'@SUM" in text
    assert ",-1," in text and "void gemm<float>(...)" in text  # numbers and names as ever
    assert [r["Kernel name"] for r in read_kernel_summary_csv(path)] == names


def test_html_report_survives_mathtext_in_a_host_name(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = a_run(tmp_path, hosts=("$\\frac{1}{$", "b$"))
    assert cli_main(["report", str(run.path), "--html", str(tmp_path / "r.html")]) == 0


# -- liveness, orphans, unindexed traces --------------------------------------------------


def test_a_stale_heartbeat_says_since_when(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = a_run(tmp_path)
    status = json.loads(run.status_json.read_text())
    write_json_atomic(run.status_json, {**status, "state": "running", "updated_at": 1.7e9})
    assert stale_since(read_status(run)) == "stale since 2023-11-14 22:13:20 UTC"
    assert "stale since 2023-11-14 22:13:20 UTC" in render_status(run, read_status(run) or {})
    _code, out, _ = cli(["report", str(run.path)], capsys)
    assert "stale since 2023-11-14" in out
    write_json_atomic(run.status_json, {**status, "state": "running", "updated_at": time.time()})
    assert stale_since(read_status(run)) is None


def test_orphans_of_a_killed_job_go_and_unindexed_traces_are_flagged(tmp_path: Path) -> None:
    run = a_run(tmp_path, hosts=("a", "b", "c"))
    index = run.index_path.read_text().splitlines()
    run.index_path.write_text("\n".join(index[:2]) + "\n")  # rank 2 wrote, never indexed
    old = time.time() - 3600
    orphans = [run.path / ".status.json.ab12.tmp", run.capture_dir(20) / ".rank2.x.tmp"]
    fresh = run.requests_dir / ".r.json.cd34.tmp"
    run.requests_dir.mkdir()
    for path in [*orphans, fresh]:
        path.write_text("half")
    for path in orphans:
        os.utime(path, (old, old))
    problems = "\n".join(report_of(run)[1]["problems"])
    assert "step 20 rank 2: trace file on disk but not in the index" in problems
    assert "removed 2 temporary file(s)" in problems
    assert not any(p.exists() for p in orphans) and fresh.exists()


# -- distanom capture against a crafted job ----------------------------------------------


@pytest.mark.parametrize("timeout", ["nan", "inf", "-1", "0"])
def test_capture_timeout_must_be_positive_and_finite(
    tmp_path: Path, timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(["capture", str(tmp_path), "--timeout", timeout], capsys)
    assert code == 2 and "--timeout" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "response",
    [
        {"status": "accepted", "steps": [], "ranks": "all", "request": "1"},
        {"status": "accepted", "steps": ["x"], "ranks": "all", "request": "1"},
        {"status": "accepted", "steps": [1], "ranks": [10**9], "request": "1"},
        {"status": "accepted", "steps": [1], "ranks": "all", "request": ["1"]},
        {"status": "accepted", "steps": 5},
        {"status": "refused", "reason": {"a": [1]}},
        "[" * 5000,
    ],
)
def test_capture_never_tracebacks_on_a_crafted_response(
    tmp_path: Path, response: object, capsys: pytest.CaptureFixture[str]
) -> None:
    run = a_run(tmp_path)
    write_json_atomic(run.status_json, {"state": "running", "world_size": 2,
                                        "updated_at": time.time()})  # fmt: skip
    stop = threading.Event()

    def job() -> None:
        while not stop.is_set():
            for path in run.requests_dir.glob("*T*-*.json"):
                if not path.name.endswith(".response.json"):
                    body = response if isinstance(response, str) else json.dumps(response)
                    out = path.with_name(path.name[:-5] + ".response.json")
                    out.write_text(body)
                    if isinstance(response, str):
                        stop.set()
            time.sleep(0.02)

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    try:
        code, _, err = cli(["capture", str(run.path), "--timeout", "2"], capsys)
    finally:
        stop.set()
        thread.join(5)
    assert code == 2 and len(err.splitlines()) == 1, err


# -- fuzz: every reader answers anything with a value or one error -----------------------


@FUZZ
@given(data=st.binary(max_size=400) | json_values.map(lambda v: json.dumps(v).encode()))
def test_fuzz_index_steps_json_and_request_readers(tmp_path: Path, data: bytes) -> None:
    run = RunDir(tmp_path)
    (tmp_path / "steps").mkdir(exist_ok=True)
    for path in (run.index_path, run.steps_csv(0), run.status_json):
        path.write_bytes(data)
    read_index(run)
    read_steps(run.steps_csv(0))
    read_status(run)
    try:
        read_json(run.status_json)
    except RunDirError as err:
        assert str(run.status_json) in str(err)
    assert isinstance(read_request(run.status_json, "x"), (str, object))
    run.requests_dir.mkdir(exist_ok=True)
    (run.requests_dir / "r.response.json").write_bytes(data)
    assert read_response(run, "r") is None or isinstance(read_response(run, "r"), dict)


@FUZZ
@given(
    steps=json_values,
    ranks=json_values | st.lists(st.lists(st.integers() | st.floats(), max_size=3), max_size=12),
    extra=st.dictionaries(st.text(max_size=5), json_values, max_size=3),
)
def test_fuzz_request_files(tmp_path: Path, steps: object, ranks: object, extra: dict) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**extra, "steps": steps, "ranks": ranks}))
    request = read_request(path, "r")
    if not isinstance(request, str):  # accepted: every field is in range
        assert isinstance(request.n_steps, int)
        assert len(request.ranges) <= 8 and all(0 <= lo <= hi for lo, hi in request.ranges)


@FUZZ
@given(
    status=st.fixed_dictionaries({}, optional={k: json_values for k in STATUS_KEYS}),
    info=st.fixed_dictionaries({}, optional={k: json_values for k in RUN_KEYS}),
)
def test_fuzz_status_and_run_json_in_status_and_report(
    tmp_path_factory: pytest.TempPathFactory, status: dict, info: dict
) -> None:
    base = tmp_path_factory.mktemp("fuzz")
    run = RunDir(base)
    (base / "steps").mkdir()
    run.steps_csv(0).write_text("step,duration_ms,traced\n1,1.0,1\n")
    run.run_json.write_text(json.dumps(info))  # NaN/Infinity included: refused as damage
    run.status_json.write_text(json.dumps(status))
    loaded = read_status(run)
    if loaded is not None:
        render_status(run, loaded)
    report = build_report(load_run(str(base)))
    render_text(report)
    json.dumps(report_json(report), allow_nan=False, default=str)


def test_a_rank_named_by_a_non_ascii_digit_is_left_out(tmp_path: Path) -> None:
    """'²'.isdigit() is true but int('²') fails: such a rank key must not break status."""
    run = a_run(tmp_path)
    status = {"recent_ms": {"²": [1.0], "1": [2.0]}, "slowest_ranks": [1]}
    text = render_status(run, status)
    assert "²" not in text and "2.0" in text


def test_digits_int_refuses_are_not_read_as_numbers() -> None:
    """str.isdigit() accepts '²'; int() does not: a port or a library version like that
    is no number, never a crash."""
    from distanom.tracers.cupti.library import _version_key
    from distanom.world import WorldInfo

    assert WorldInfo.from_env({"MASTER_PORT": "²"}).master_port is None
    assert WorldInfo.from_env({"MASTER_PORT": "29500"}).master_port == 29500
    assert _version_key("/lib/libcupti.so.13.²") == (13,)
    assert _version_key("/lib/libcupti.so.13.0.85") == (13, 0, 85)
