"""Sparse-file time bombs (issue 37): anomalies.jsonl or a steps file of 1 TB apparent
size with no line break costs a few kB on disk; the readers must stop within their caps
instead of reading for as long as the file claims to be."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from distanom.records.anomalies import anomalies_path, read_anomalies
from distanom.records.steps import STEPS_CSV_HEADER, read_steps
from distanom.rundir import RunDir

TERABYTE = 1 << 40


def test_a_sparse_anomalies_file_is_read_only_to_its_cap(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    path = anomalies_path(run)
    path.write_bytes(b"")
    os.truncate(path, TERABYTE)  # a hole: reads as NULs, no line break anywhere
    began = time.monotonic()
    assert read_anomalies(run) == []
    assert time.monotonic() - began < 5  # ~5 MB read, not a terabyte


def test_a_sparse_steps_file_is_read_only_to_its_cap(tmp_path: Path) -> None:
    path = tmp_path / "rank0.csv"
    path.write_text(STEPS_CSV_HEADER + "1,2.5,0,0,0.0\n")
    with open(path, "r+b") as handle:
        handle.truncate(TERABYTE)
    began = time.monotonic()
    read = read_steps(path)
    assert [row.step for row in read.rows] == [1] and read.bad == 1
    assert time.monotonic() - began < 5


def test_anomaly_lines_are_bounded_by_the_runs_world_and_real_step_numbers(
    tmp_path: Path,
) -> None:
    import json

    run = RunDir(tmp_path)
    line = {"v": 1, "step": 40, "step_ms": 90.0, "median_ms": 10.0, "threshold_ms": 15.0,
            "slowest_rank": 300_000, "judged_by": "condition\nforged line",
            "durations_ms": [90] * 100_000, "evidence": [{}] * 150_000}  # fmt: skip
    absurd = [{**line, "step": step, "evidence": [], "durations_ms": []}
              for step in (10**299, -3, True, 2.5, "7")]  # fmt: skip
    text = "\n".join(json.dumps(x, separators=(",", ":")) for x in [line, *absurd]) + "\n"
    assert len(text) < 1 << 20  # under the line cap: read, then bounded by the world
    anomalies_path(run).write_text(text)
    began = time.monotonic()
    (record,) = read_anomalies(run, world_size=2)
    assert time.monotonic() - began < 5
    assert record.step == 40 and len(record.evidence) == 2 and len(record.durations_ms) == 2
    assert record.slowest_rank == -1 and "\n" not in record.judged_by


def test_step_files_of_disjoint_steps_are_aligned_within_a_cell_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: 64 step files of 20k disjoint steps made the report align 64 x 1.28M
    cells (past 60 s and 930 MB). Scaled down here: 4 ranks of 1,000 disjoint steps
    against a budget of 1,000 cells."""
    import distanom.analysis.run as run_module
    from distanom.analysis.run import load_run, load_steps
    from tests.unit.rungen import make_run

    monkeypatch.setattr(run_module, "MAX_ALIGNED_CELLS", 1000)
    run = make_run(tmp_path, [], hosts=["a"] * 4, steps=10)
    for rank in range(4):
        rows = "".join(f"{rank * 1000 + i},2.0,0,0,0.0\n" for i in range(1000))
        run.steps_csv(rank).write_text(STEPS_CSV_HEADER + rows)
    data = load_run(str(run.path))
    series = load_steps(data)
    assert len(series.steps) == 250 and all(len(v) == 250 for v in series.per_rank.values())
    assert any("steps left out of the step series" in p for p in data.problems)
