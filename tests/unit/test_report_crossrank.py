"""The report's cross-rank parts on a synthetic run: verdict, kernel diff, merged trace."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import pytest

from distanom.analysis.report import Report, build_report, render_text, report_json, write_outputs
from distanom.analysis.run import RunData, load_run
from distanom.cli import main as cli_main
from tests.unit.rungen import Capture, make_run
from tests.unit.stepgen import MATMUL, NCCL, cpu_job, gpu_job

HOSTS = ["a", "a", "b", "b"]


def run_report(data: RunData) -> Report:
    """The report of a loaded run, its files written, as `distanom report` makes it."""
    return write_outputs(data, build_report(data))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    make_run(
        tmp_path,
        [
            Capture(20, "reference", gpu_job(), 1.1, 1.2),
            Capture(40, "anomaly", gpu_job(extra_compute_us={3: 3000.0}), 4.1, 1.2),
            Capture(60, "anomaly", gpu_job(all_gap_us=3000.0), 4.1, 1.2),
            Capture(70, "anomaly", gpu_job(extra_compute_us={2: 3000.0, 3: 3000.0}), 4.1, 1.2),
        ],
        hosts=HOSTS,
    )
    return tmp_path


def by_step(report: Report) -> dict[int, dict[str, Any]]:
    return {c["step"]: c for c in report_json(report)["captures"]}


def test_every_capture_gets_a_verdict(run_dir: Path) -> None:
    captures = by_step(run_report(load_run(str(run_dir))))
    v40 = captures[40]["verdict"]
    assert (v40["culprit_rank"], v40["culprit_node"], v40["cause"]) == (3, None, "compute")
    assert v40["evidence"].startswith("rank 3: computation")
    v60 = captures[60]["verdict"]
    assert (v60["culprit_rank"], v60["cause"]) == (None, "global")
    v70 = captures[70]["verdict"]
    assert v70["culprit_node"] == "b" and v70["culprit_rank"] in (2, 3)
    assert captures[20]["verdict"]["cause"] == "unknown"  # the healthy reference itself
    assert set(v40) >= {"culprit_rank", "culprit_node", "cause", "evidence"}


def test_kernel_diff_names_the_extra_matmul_against_the_reference(run_dir: Path) -> None:
    captures = by_step(run_report(load_run(str(run_dir))))
    diff = captures[40]["kernel_diff"]
    assert diff["reference_step"] == 20
    top = diff["ranks"]["3"]["changes"][0]
    assert (top["name"], top["status"], top["added_us"]) == (MATMUL, "appeared", 3000.0)
    victim = diff["ranks"]["0"]["changes"]  # the victims only waited longer in NCCL
    assert [(c["name"], c["added_us"]) for c in victim] == [(NCCL, 3000.0)]
    assert captures[20]["kernel_diff"] == {
        "reference_step": None,
        "note": "this is the reference step",
        "ranks": {},
    }


def test_merged_trace_is_written_once_and_holds_every_rank(run_dir: Path) -> None:
    data = load_run(str(run_dir))
    capture = by_step(run_report(data))[40]
    assert capture["merged_trace"] == "captures/step_40/merged.trace.json.gz"
    path = data.run.path / capture["merged_trace"]
    merged = json.loads(gzip.decompress(path.read_bytes()))
    meta = merged["distanom"]
    assert meta["step"] == 40 and sorted(meta["ranks"]) == ["0", "1", "2", "3"]
    assert meta["clock_alignment"]["method"] == "collective ends"
    assert meta["clock_alignment"]["offsets_us"] == {"0": 0.0, "1": 0.0, "2": 0.0, "3": 0.0}
    names = sorted(
        e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"
    )
    assert "rank 3 (b) GPU 0" in names and len(names) == 8
    before = path.stat().st_mtime_ns
    run_report(load_run(str(run_dir)))
    assert path.stat().st_mtime_ns == before  # up to date: not written again
    trace = data.run.trace_path(40, 1)
    os.utime(trace, ns=(before + 10**9, before + 10**9))
    run_report(load_run(str(run_dir)))
    assert path.stat().st_mtime_ns > before  # a newer rank trace: merged again


def test_summary_json_and_text_carry_the_verdict_and_top_changes(run_dir: Path) -> None:
    data = load_run(str(run_dir))
    report = run_report(data)
    summary = json.loads(data.run.summary_json(40).read_text())
    assert summary["verdict"]["culprit_rank"] == 3
    assert summary["kernel_diff"]["reference_step"] == 20
    assert summary["merged_trace"] == "captures/step_40/merged.trace.json.gz"
    text = render_text(report)
    assert "  verdict: rank 3 — compute: rank 3: computation" in text
    assert (
        "  verdict: no single rank — global: all 4 ranks: idle grew over reference step 20" in text
    )
    assert "  verdict: node b (ranks 2-3) — compute" in text
    block = text.split("step 40 (anomaly)")[1].split("step 60")[0]
    assert "kernels vs reference step 20, rank 3" in block
    assert MATMUL in block and "appeared" in block


def test_cli_json_has_the_new_fields(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["report", str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    capture = {c["step"]: c for c in report["captures"]}[40]
    assert capture["verdict"]["cause"] == "compute"
    assert capture["kernel_diff"]["ranks"]["3"]["changes"][0]["name"] == MATMUL
    assert capture["merged_trace"].endswith("merged.trace.json.gz")


def test_a_damaged_rank_trace_leaves_a_verdict_on_the_others(tmp_path: Path) -> None:
    run = make_run(
        tmp_path,
        [Capture(40, "anomaly", gpu_job(gap_us={1: 3000.0}), 4.1, 1.2)],
        hosts=HOSTS,
    )
    run.trace_path(40, 2).write_bytes(b"\x1f\x8bnot gzip")
    data = load_run(str(tmp_path))
    report = run_report(data)
    capture = by_step(report)[40]
    assert (capture["verdict"]["culprit_rank"], capture["verdict"]["cause"]) == (1, "host_stall")
    assert capture["kernel_diff"]["note"] == "no reference step captured in this run"
    rank2 = [p for p in report_json(report)["problems"] if p.startswith("step 40 rank 2")]
    assert len(rank2) == 1  # reported once, by the tables
    assert capture["unreadable_ranks"] == [2]
    text = render_text(report)
    assert "  40    anomaly  4.1      3.42              3/4 (1 unreadable)" in text
    assert "step 40: unreadable trace from rank(s) 2 (see problems)" in text
    merged = json.loads(gzip.decompress((run.path / capture["merged_trace"]).read_bytes()))
    assert sorted(merged["distanom"]["ranks"]) == ["0", "1", "3"]


def test_a_trace_damaged_after_its_tables_were_cached_is_not_counted(tmp_path: Path) -> None:
    """The tables CSV still gives the rank a row, but its trace cannot be read: the
    captures table counts only readable traces."""
    run = make_run(tmp_path, [Capture(40, "anomaly", gpu_job(), 4.1, 1.2)], hosts=HOSTS)
    first = run_report(load_run(str(tmp_path)))
    assert "4/4  " in render_text(first) and by_step(first)[40]["unreadable_ranks"] == []
    trace = run.trace_path(40, 3)
    trace.write_bytes(trace.read_bytes()[:200])  # truncated gzip
    report = run_report(load_run(str(tmp_path)))
    capture = by_step(report)[40]
    assert "gpu_timeline" in capture["ranks"]["3"]  # from the cached CSV
    assert capture["unreadable_ranks"] == [3]
    assert "3/4 (1 unreadable)" in render_text(report)
    summary = json.loads(run.summary_json(40).read_text())
    assert summary["unreadable_ranks"] == [3]


def test_stall_before_the_first_op_shows_in_the_table_as_in_the_verdict(
    tmp_path: Path,
) -> None:
    """On CPU traces the verdict counts the step window outside the ops as idle; the
    table shows it in its own column (and in the total), so both blame the same rank."""
    docs = cpu_job(stall_us={1: 50_000.0}, stall_before_first_op=True)
    run = make_run(tmp_path, [Capture(40, "anomaly", docs, 52.0, 1.5)], hosts=["a"] * 4)
    report = run_report(load_run(str(tmp_path)))
    capture = by_step(report)[40]
    assert (capture["verdict"]["culprit_rank"], capture["verdict"]["cause"]) == (1, "host_stall")
    outside = capture["ranks"]["1"]["outside_ms"]
    assert outside == pytest.approx(50.06, abs=0.001)  # the stall + 60 µs outside the ops
    assert capture["verdict"]["evidence"].startswith(
        "rank 1: idle 50.1 ms (incl. 50.1 ms outside its ops) vs 0.14 ms median of the others"
    )
    lines = render_text(report).splitlines()
    at = lines.index("step 40 (anomaly): host time (CPU-only trace), ms")
    assert lines[at + 1].split() == [
        "rank", "host", "compute", "exp.comm", "exp.memcpy", "idle", "outside", "ops", "total"
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines[at + 2 : at + 6]}
    assert float(rows["1"][6]) == pytest.approx(outside, abs=0.01)
    # every rank's total is its step window: rank 1's no longer looks 50 ms shorter
    assert {float(row[7]) for row in rows.values()} == {51.45}
    stalled = {rank: float(row[5]) + float(row[6]) for rank, row in rows.items()}
    assert max(stalled, key=lambda r: stalled[r]) == "1"
    assert lines[at + 6].startswith("  outside ops: step window before the rank's first op")
    summary = json.loads(run.summary_json(40).read_text())
    assert summary["ranks"]["1"]["outside_ms"] == outside


def test_a_planted_link_in_place_of_the_merged_trace_is_written_over_not_shown(
    tmp_path: Path,
) -> None:
    """Issue 37: a link named merged.trace.json.gz, newer than the rank traces and
    pointing outside the run, was shown as the run's merged trace."""
    run = make_run(tmp_path, [Capture(40, "anomaly", gpu_job(), 4.1, 1.2)], hosts=HOSTS)
    outside = tmp_path / "outside.json.gz"
    outside.write_bytes(gzip.compress(b'{"traceEvents": [], "planted": true}'))
    link = run.capture_dir(40) / "merged.trace.json.gz"
    link.symlink_to(outside)
    newer = max(run.trace_path(40, r).stat().st_mtime_ns for r in range(4)) + 10**9
    os.utime(link, ns=(newer, newer), follow_symlinks=False)
    run_report(load_run(str(tmp_path)))
    assert not link.is_symlink()  # replaced by the report's own merged trace
    merged = json.loads(gzip.decompress(link.read_bytes()))
    assert merged["distanom"]["step"] == 40 and "planted" not in merged
    assert json.loads(gzip.decompress(outside.read_bytes())) == {"traceEvents": [], "planted": True}


def test_report_html_through_latest_is_written_where_latest_pointed_at_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: `report runs/latest --html runs/latest/report.html` resolved `latest`
    again after loading: a link swapped meanwhile sent the page into another folder."""
    import distanom.analysis.run as run_module

    make_run(tmp_path, [Capture(40, "anomaly", gpu_job(), 4.1, 1.2)], hosts=HOSTS)
    other = tmp_path / "other"
    other.mkdir()
    latest = tmp_path / "current"  # a link as runs/latest is
    latest.symlink_to(tmp_path / "run1")
    original = run_module.load_run

    def load_then_swap(path: str) -> RunData:
        data = original(path)
        latest.unlink()
        latest.symlink_to(other)  # swapped while the report is built
        return data

    monkeypatch.setattr(run_module, "load_run", load_then_swap)
    assert cli_main(["report", str(latest), "--html", str(latest / "report.html")]) == 0
    assert (tmp_path / "run1" / "report.html").exists()
    assert not list(other.iterdir())
