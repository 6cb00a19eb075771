"""analyze_trace: engine choice, the TraceLens adapter (against a fake TraceLens), CPU fallback."""

from __future__ import annotations

import gzip
import json
import logging
import math
import sys
import threading
import types
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from distanom.analysis.engine import ENGINES, analyze_trace, tracelens_available
from distanom.analysis.tables import TIMELINE_ROWS, gpu_timeline, kernel_summary
from distanom.analysis.trace_io import load_trace
from distanom.config import AnalysisConfig
from distanom.errors import AnalysisEngineError, DistanomError, TraceFormatError
from tests.unit.tracegen import gpu, host

DATA = Path(__file__).resolve().parents[1] / "data"
H200 = DATA / "h200_resnet18_b5_anomalous_step.json.gz"
CPU = DATA / "cpu_ddp_gloo_rank0.json.gz"
US = "Kernel duration (\u00b5s)"


class FakeFrame:
    """The part of a pandas DataFrame the adapter may use."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records
        self.columns = list(records[0]) if records else []

    def to_dict(self, orient: str = "dict") -> list[dict[str, Any]]:
        assert orient == "records"
        return [dict(r) for r in self.records]


FAKE_TIMELINE = [
    {"type": row, "time ms": float(i + 1), "percent": float(i + 1) / 6 * 100}
    for i, row in enumerate(TIMELINE_ROWS)
]
NAN = float("nan")


def fake_kernel_records() -> list[dict[str, Any]]:
    np = pytest.importorskip("numpy")
    return [
        {
            "Parent op category": "runtime",
            "Kernel name": "k",
            "Kernel stream": np.float64(7.0),
            f"{US}_sum": np.float64(10.0),
            f"{US}_count": np.int64(2),
            f"{US}_mean": 5.0,
            f"{US}_min": 4.0,
            f"{US}_max": 6.0,
            "Percent of kernels time (%)": 62.5,
            "Percent of total time (%)": 50.0,
        },
        {
            "Parent op category": NAN,
            "Kernel name": "unlinked",
            "Kernel stream": NAN,
            f"{US}_sum": 6.0,
            f"{US}_count": 1,
            f"{US}_mean": 6.0,
            f"{US}_min": 6.0,
            f"{US}_max": 6.0,
            "Percent of kernels time (%)": 37.5,
            "Percent of total time (%)": NAN,
        },
    ]


class FakeTraceLens:
    """Stands in for TraceLens.Reporting.generate_perf_report_pytorch."""

    def __init__(self, result: Any = None, error: Exception | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.result = result
        self.error = error
        self.hook: Callable[[], None] | None = None

    def __call__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        out_dir = Path(kwargs["output_csvs_dir"])
        assert out_dir.is_dir()
        assert Path(kwargs["profile_json_path"]).is_file()
        print("Building tree with add_python_func=False")
        (out_dir / "gpu_timeline.csv").write_text("type,time ms,percent\n", encoding="utf-8")
        print(f"DataFrame 'gpu_timeline' written to {out_dir / 'gpu_timeline.csv'}")
        if self.hook is not None:
            self.hook()
        if self.error is not None:
            raise self.error
        if self.result is not None:
            return self.result
        return {
            "gpu_timeline": FakeFrame(FAKE_TIMELINE),
            "kernel_summary": FakeFrame(fake_kernel_records()),
        }


def install(monkeypatch: pytest.MonkeyPatch, fake: Any) -> None:
    package = types.ModuleType("TraceLens")
    reporting = types.ModuleType("TraceLens.Reporting")
    module = types.ModuleType("TraceLens.Reporting.generate_perf_report_pytorch")
    module.generate_perf_report_pytorch = fake  # type: ignore[attr-defined]
    reporting.generate_perf_report_pytorch = fake  # type: ignore[attr-defined]
    package.Reporting = reporting  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "TraceLens", package)
    monkeypatch.setitem(sys.modules, "TraceLens.Reporting", reporting)
    monkeypatch.setitem(sys.modules, module.__name__, module)


@pytest.fixture
def no_tracelens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `import TraceLens` fail, whether or not it is installed here."""
    monkeypatch.setitem(sys.modules, "TraceLens", None)


# ------------------------------------------------------------------ built-in


def test_builtin_matches_the_tables(no_tracelens: None) -> None:
    tables = analyze_trace(H200, "builtin")
    trace = load_trace(H200)
    timeline = gpu_timeline(trace)
    assert (tables.engine, tables.kind, tables.source) == ("builtin", "gpu", str(H200))
    assert tables.timeline == timeline
    assert tables.kernel_summary == kernel_summary(trace, timeline.total_time_us)


def test_auto_without_tracelens_is_builtin(no_tracelens: None) -> None:
    assert not tracelens_available()
    assert analyze_trace(H200).engine == "builtin"


def test_tracelens_required_but_missing(no_tracelens: None) -> None:
    with pytest.raises(AnalysisEngineError, match="TraceLens cannot be imported") as info:
        analyze_trace(H200, "tracelens")
    assert isinstance(info.value, DistanomError)
    assert "\n" not in str(info.value)


def test_unknown_engine() -> None:
    with pytest.raises(AnalysisEngineError, match="unknown analysis engine 'pandas'"):
        analyze_trace(H200, "pandas")


def test_engines_match_the_config_choices() -> None:
    annotation = AnalysisConfig.model_fields["engine"].annotation
    assert typing.get_args(annotation) == ENGINES


# ------------------------------------------------------------------ fake TraceLens


@pytest.mark.parametrize("engine", ["auto", "tracelens"])
def test_fake_tracelens_is_called_safely_and_converted(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    engine: str,
) -> None:
    fake = FakeTraceLens()
    install(monkeypatch, fake)
    trace_path = tmp_path / "rank0.trace.json.gz"
    trace_path.write_bytes(H200.read_bytes())
    assert tracelens_available()
    with caplog.at_level(logging.DEBUG, logger="distanom.analysis.engine"):
        tables = analyze_trace(trace_path, engine)

    (call,) = fake.calls
    assert call["include_unlinked_kernels"] is True and call["kernel_summary"] is True
    assert call["profile_json_path"] == str(trace_path)
    out_dir = Path(call["output_csvs_dir"])
    assert out_dir.parent.parent != tmp_path and not out_dir.exists()  # temp dir, removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.trace.json.gz"]
    assert capsys.readouterr().out == ""
    assert "Building tree" in caplog.text

    assert (tables.engine, tables.kind) == ("tracelens", "gpu")
    for i, row in enumerate(TIMELINE_ROWS):
        assert tables.timeline.ms(row) == pytest.approx(i + 1, rel=1e-15)
    first, second = tables.kernel_summary
    assert first["Kernel stream"] == 7 and type(first["Kernel stream"]) is int
    assert first[f"{US}_count"] == 2 and type(first[f"{US}_count"]) is int
    assert type(first[f"{US}_sum"]) is float
    assert second["Parent op category"] is None and second["Kernel stream"] is None
    assert math.isnan(second["Percent of total time (%)"])
    text = json.dumps(tables.to_jsonable(), allow_nan=False)
    assert json.loads(text)["kernel_summary"][1]["Percent of total time (%)"] is None


def test_fake_tracelens_gets_a_path_with_the_right_suffix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = FakeTraceLens()
    install(monkeypatch, fake)
    received: list[bytes] = []
    fake.hook = lambda: received.append(Path(fake.calls[-1]["profile_json_path"]).read_bytes())
    odd = tmp_path / "rank0.trace"  # gzip content, no .json.gz suffix
    odd.write_bytes(H200.read_bytes())
    analyze_trace(odd, "tracelens")
    assert fake.calls[-1]["profile_json_path"].endswith(".json.gz")
    assert received == [H200.read_bytes()]
    plain = tmp_path / "plain.json.gz"  # plain JSON named .json.gz
    plain.write_bytes(gzip.decompress(H200.read_bytes()))
    analyze_trace(plain, "tracelens")
    assert fake.calls[-1]["profile_json_path"].endswith("trace.json")


def test_other_threads_keep_their_stdout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeTraceLens()
    install(monkeypatch, fake)

    def other_thread_prints() -> None:
        worker = threading.Thread(target=print, args=("training says hi",))
        worker.start()
        worker.join()

    fake.hook = other_thread_prints
    analyze_trace(H200, "tracelens")
    out = capsys.readouterr().out
    assert "training says hi" in out
    assert "Building tree" not in out


def test_tracelens_warnings_go_to_the_log_not_stderr(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The real TraceLens raises dozens of UserWarnings per call ("Input list of events is
    # empty...", whole events pretty-printed); a training job must not get them on stderr.
    fake = FakeTraceLens()
    install(monkeypatch, fake)
    original = warnings.showwarning

    def warn_here_and_in_another_thread() -> None:
        warnings.warn("Input list of events is empty.", UserWarning, stacklevel=1)
        worker = threading.Thread(target=warnings.warn, args=("training warns too", RuntimeWarning))
        worker.start()
        worker.join()

    fake.hook = warn_here_and_in_another_thread
    with (
        warnings.catch_warnings(record=True) as shown,
        caplog.at_level(logging.DEBUG, logger="distanom.analysis.engine"),
    ):
        warnings.simplefilter("always")
        tables = analyze_trace(H200, "tracelens")
    assert tables.engine == "tracelens"
    assert [str(w.message) for w in shown] == ["training warns too"]
    assert "Input list of events is empty" not in capsys.readouterr().err
    assert "UserWarning: Input list of events is empty." in caplog.text
    assert warnings.showwarning is original


def test_tracelens_failure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    install(monkeypatch, FakeTraceLens(error=ValueError("boom")))
    with caplog.at_level(logging.WARNING, logger="distanom.analysis.engine"):
        tables = analyze_trace(H200, "auto")
    assert tables.engine == "builtin"
    assert "TraceLens failed" in caplog.text and "boom" in caplog.text
    with pytest.raises(AnalysisEngineError, match="TraceLens failed: ValueError: boom"):
        analyze_trace(H200, "tracelens")


def test_tracelens_without_kernel_sheet(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeTraceLens(result={"gpu_timeline": FakeFrame(FAKE_TIMELINE)}))
    tables = analyze_trace(H200, "tracelens")
    assert tables.engine == "tracelens" and tables.kernel_summary == []


def test_tracelens_result_missing_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeTraceLens(result={"gpu_timeline": FakeFrame(FAKE_TIMELINE[:3])}))
    with pytest.raises(AnalysisEngineError, match="lacks rows"):
        analyze_trace(H200, "tracelens")


# ------------------------------------------------------------------ CPU-only and empty traces


@pytest.mark.parametrize("engine", ENGINES)
def test_cpu_trace_gets_host_timeline(monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    fake = FakeTraceLens()
    install(monkeypatch, fake)
    tables = analyze_trace(CPU, engine)
    assert fake.calls == []
    assert (tables.engine, tables.kind, tables.kernel_summary) == ("builtin", "cpu", [])
    assert tables.timeline.total_comm_time_us > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_trace_without_gpu_or_cpu_events(no_tracelens: None, tmp_path: Path, engine: str) -> None:
    path = tmp_path / "empty.json"
    path.write_text('{"traceEvents": []}', encoding="utf-8")
    with pytest.raises(TraceFormatError, match=r"no GPU events .* and no CPU spans") as info:
        analyze_trace(path, engine)
    assert str(path) in str(info.value)


def test_bad_file_is_a_trace_format_error_before_tracelens(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = FakeTraceLens()
    install(monkeypatch, fake)
    path = tmp_path / "t.json"
    path.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(TraceFormatError, match="not an object"):
        analyze_trace(path, "tracelens")
    assert fake.calls == []


def test_gpu_trace_from_memory_file(no_tracelens: None, tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [gpu("k", 0.0, 4.0)]}), encoding="utf-8")
    tables = analyze_trace(path)
    assert tables.timeline.computation_time_us == 4.0
    assert [r["Kernel name"] for r in tables.kernel_summary] == ["k"]


# ------------------------------------------------------------------ real TraceLens (opt-in)

GPU_FIXTURES = sorted(p for p in DATA.glob("*.json.gz") if not p.name.startswith("cpu_"))


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def _collapse(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], list[float]]:
    """Per (linked?, name, stream): sum, count, max, -min, percent sums; comparable across
    TraceLens's CPU-op path (rows split per parent cpu_op, op-classifier categories)."""
    out: dict[tuple[Any, ...], list[float]] = {}
    for r in rows:
        key = (r["Parent op category"] is not None, r["Kernel name"], r["Kernel stream"])
        acc = out.setdefault(key, [0.0, 0, -math.inf, -math.inf, 0.0, 0.0])
        acc[0] += r[f"{US}_sum"]
        acc[1] += r[f"{US}_count"]
        acc[2] = max(acc[2], r[f"{US}_max"])
        acc[3] = max(acc[3], -r[f"{US}_min"])
        acc[4] += r["Percent of kernels time (%)"]
        acc[5] += r["Percent of total time (%)"]
    return out


@pytest.mark.parametrize("path", GPU_FIXTURES, ids=lambda p: p.name.split(".")[0])
def test_real_tracelens_equals_builtin(path: Path) -> None:
    """Runs only where TraceLens is installed (pip install from github.com/AMD-AGI/TraceLens)."""
    pytest.importorskip("TraceLens.Reporting.generate_perf_report_pytorch")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        theirs = analyze_trace(path, "tracelens")
    assert [str(w.message) for w in shown] == []  # TraceLens's went to the DEBUG log
    mine = analyze_trace(path, "builtin")
    assert (theirs.engine, theirs.kind) == ("tracelens", "gpu")
    for row in TIMELINE_ROWS:
        assert _close(theirs.timeline.us(row), mine.timeline.us(row)), row
    if all("Parent cpu_op" not in r for r in theirs.kernel_summary):
        keyed = {
            (r["Parent op category"], r["Kernel name"], r["Kernel stream"]): r
            for r in theirs.kernel_summary
        }
        assert len(keyed) == len(theirs.kernel_summary) == len(mine.kernel_summary)
        for r in mine.kernel_summary:
            other = keyed[(r["Parent op category"], r["Kernel name"], r["Kernel stream"])]
            assert list(other) == list(r)
            assert all(
                other[c] == r[c] if not isinstance(r[c], float) else _close(other[c], r[c])
                for c in r
            ), r["Kernel name"]
    else:  # CPU ops in the trace: TraceLens's tree path; compare what is comparable
        ours, real = _collapse(mine.kernel_summary), _collapse(theirs.kernel_summary)
        assert ours.keys() == real.keys()
        for key, values in real.items():
            assert all(_close(a, b) for a, b in zip(ours[key], values, strict=True)), key


# ------------------------------------------------------------------ explicit engine, step window


def cpu_step_trace(tmp_path: Path) -> Path:
    """A CPU-only trace of step 7: a 300 ms stall before its first op, 2 ms of ops."""
    events = [
        host("distanom step 7", 0.0, 302_000.0, cat="user_annotation"),
        host("aten::mm", 300_000.0, 1_000.0),
        host("aten::add", 301_000.0, 1_000.0),
    ]
    path = tmp_path / "rank0.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_explicit_tracelens_fails_on_a_cpu_trace_too(no_tracelens: None, tmp_path: Path) -> None:
    with pytest.raises(AnalysisEngineError, match="TraceLens cannot be imported"):
        analyze_trace(cpu_step_trace(tmp_path), "tracelens")
    assert analyze_trace(cpu_step_trace(tmp_path), "auto").engine == "builtin"


def test_the_time_outside_the_ops_is_shown(no_tracelens: None, tmp_path: Path) -> None:
    from distanom.analysis.tables_io import AnalyzeOutput

    tables = analyze_trace(cpu_step_trace(tmp_path), "builtin")
    assert tables.step_window_us == 302_000.0
    assert tables.outside_ops_ms == pytest.approx(300.0)
    text = AnalyzeOutput(tables).as_text()
    assert "step window 302.000 ms; outside the trace's ops 300.000 ms" in text
    assert AnalyzeOutput(tables).as_json()["outside_ops_ms"] == pytest.approx(300.0)
