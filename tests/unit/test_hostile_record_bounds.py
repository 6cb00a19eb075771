"""Issue 37's bounds held as a whole: `distanom report` on each planted directory
(`tests.unit.hostile_plants`) in its own process within 300 MB, hang folders and missing
ranks bounded, the columnar steps reader equal to a row-at-a-time read, and the HTML
linking only files inside the run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from distanom.analysis.hangs import hang_lines, judge_hang, read_hangs
from distanom.analysis.html_report import render_html
from distanom.analysis.report import build_report
from distanom.analysis.run import load_run, load_steps
from distanom.live import render_status, status_json
from distanom.records import steps as steps_module
from distanom.records.hangs import hang_dirs, hang_numbers, hang_ranks, write_hang_record
from distanom.records.steps import STEPS_CSV_HEADER, read_step_columns, read_steps
from tests.unit import hostile_plants as plants

PEAK_MB = 300  # the bound on the report's memory


@pytest.mark.parametrize("name", sorted(plants.PROBES))
def test_report_on_a_planted_directory_stays_within_its_memory(tmp_path: Path, name: str) -> None:
    """Each probe in a fresh child process: a clean exit and a peak RSS under 300 MB
    (time is measured by `python -m tests.unit.hostile_plants`, not asserted here: the
    bound is 5 s, a loaded CI host is not a timer)."""
    run = plants.a_run(tmp_path)
    plants.PROBES[name](run)
    code, seconds, peak_mb, tail = plants.measure_report(run, "--json")
    assert code == 0, tail
    assert peak_mb < PEAK_MB, (name, peak_mb, seconds)
    assert seconds < 120, (name, seconds)


def test_only_the_latest_hang_folders_are_read(tmp_path: Path) -> None:
    run = plants.a_run(tmp_path)
    for number in range(1, 101):
        write_hang_record(run, plants.hang_record(0, number=number))
    assert hang_numbers(run) == list(range(37, 101))  # the latest 64
    assert list(hang_dirs(run)) == list(range(37, 101))
    assert list(hang_ranks(run, 5)) == [0]  # the live watch lists its own folder only
    hangs, problems = read_hangs(run, 2)
    assert [h.number for h in hangs] == list(range(37, 101)) and problems == []


def test_ranks_without_a_record_are_counted_past_the_first_32() -> None:
    hang = judge_hang(1, [plants.hang_record(0, world_size=131072)], 131072)
    assert len(hang.ranks) == 33 and hang.unlisted == 131071 - 32
    assert hang.culprit_rank == 1
    assert f"{131071 - 32} more rank(s): no hang record" in "\n".join(hang_lines(hang))
    assert hang.as_json()["ranks_unlisted"] == 131071 - 32
    small = judge_hang(1, [plants.hang_record(0)], 2)
    assert small.unlisted == 0 and set(small.ranks) == {0, 1}


def test_status_with_non_finite_fields_renders_and_writes_strict_json(tmp_path: Path) -> None:
    run = plants.a_run(tmp_path)
    status = {
        "state": "running", "world_size": 2, "updated_at": 1e999,
        "stragglers": {"stragglers": [{"rank": 1, "score": 10**400, "evidence": "x"}]},
        "agent_cost": {"x": 1e999}, "extra": [float("inf")],
    }  # fmt: skip
    text = render_status(run, status)
    body = json.dumps(status_json(run, status), allow_nan=False, default=str)
    assert "Traceback" not in text and "inf" not in body.lower().replace("info", "")


def _rows_key(path: Path) -> list[tuple[object, ...]]:
    return [
        (r.step, r.duration_ms, r.traced, r.after_flush, r.self_ms, r.gc_pause, r.skipped,
         tuple(round(v, 3) if v == v else None for v in r.phases))
        for r in read_steps(path).rows
    ]  # fmt: skip


CELLS = ["1", "0", "-1", "2.5", "nan", "inf", "x", "", "  ", "\t", "12", "9" * 30, "1e3", "-2.5"]


def test_the_columnar_reader_equals_reading_each_row_alone(tmp_path: Path) -> None:
    """Rows of mixed widths and damaged cells, read in runs of equal width with a
    vectorised parse (halved down to single rows where a cell is not a number), give the
    rows and the damage count of reading each row as a file of its own."""
    rng = random.Random(7)
    lines = []
    for i in range(3000):
        width = rng.choice([3, 5, 7, 8, 17, 18])
        row = [str(i), f"{rng.random() * 5:.4f}"] + [
            rng.choice(["0", "1"]) for _ in range(width - 2)
        ]
        if rng.random() < 0.05:
            row[rng.randrange(width)] = rng.choice(CELLS)
        lines.append(",".join(row))
        if rng.random() < 0.01:
            lines.append(",".join(rng.choice(CELLS) for _ in range(rng.randint(1, 18))))
    whole = tmp_path / "whole.csv"
    whole.write_text(STEPS_CSV_HEADER + "\n".join(lines) + "\n")
    expected, bad = [], 0
    for number, line in enumerate(lines):
        alone = tmp_path / f"alone{number % 7}.csv"
        alone.write_text(STEPS_CSV_HEADER + line + "\n")
        expected += _rows_key(alone)
        bad += read_steps(alone).bad
    assert _rows_key(whole) == expected and read_steps(whole).bad == bad
    assert 0 < bad < 200


def test_rows_cut_across_blocks_read_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rank0.csv"
    rows = "".join(f"{s},{1 + s % 5}.25,{s % 2},0,0.000,0.000,-1,0\n" for s in range(500))
    path.write_text(STEPS_CSV_HEADER + rows + "x" * 5000 + "\n" + "500,3.0,1")
    whole = read_step_columns(path)
    monkeypatch.setattr(steps_module, "BLOCK_CHARS", 37)  # rows cut mid-cell, many times
    cut = read_step_columns(path)
    assert len(whole) == len(cut) == 501 and whole.bad == cut.bad == 1
    assert np.array_equal(whole.step, cut.step) and np.array_equal(whole.traced, cut.traced)
    assert np.array_equal(whole.duration_ms, cut.duration_ms)


def test_rows_of_alternating_widths_are_one_array_per_block() -> None:
    """A planted file whose rows alternate widths: parsed one width at a time and put back
    in file order, not one array per row (that cost 740 MB for 1M rows)."""
    reader = steps_module._BlockReader()
    rows = [f"{s},1.5,0" if s % 2 else f"{s},2.5,1,0,0.5" for s in range(1, 20_001)]
    reader.feed(STEPS_CSV_HEADER + "\n".join(rows) + "\n")
    reader.end()
    assert len(reader.parsed) == 1 and len(reader.parsed[0]) == 20_000
    columns = steps_module._joined(reader.parsed, reader.bad)
    assert columns.step.tolist() == list(range(1, 20_001)) and columns.bad == 0
    assert columns.duration_ms[:2].tolist() == [1.5, 2.5] and columns.self_ms[1] == 0.5


def test_a_blank_cell_reads_as_unreadable_whatever_its_neighbours(tmp_path: Path) -> None:
    """np.fromstring reads a cell of blanks as -1: such rows take the row-at-a-time parse,
    so a blank generation is no collection, alone or among other rows."""
    path = tmp_path / "rank0.csv"
    good = "".join(f"{s},1.0,0,0,0,0,-1,0\n" for s in range(2, 200))
    path.write_text(STEPS_CSV_HEADER + "1,0.558,0,0,0,2.5,  ,0\n" + good)
    assert read_steps(path).rows[0].gc_pause is None and read_steps(path).bad == 0


def test_an_absurd_collection_generation_reads_as_no_collection(tmp_path: Path) -> None:
    path = tmp_path / "rank0.csv"
    path.write_text(
        STEPS_CSV_HEADER + "1,2.0,0,0,0,5.0,99999999999999999999,0\n2,2.0,0,0,0,5.0,2,0\n"
    )
    assert [r.gc_pause for r in read_steps(path).rows] == [None, (5.0, 2)]


def test_a_long_run_is_held_in_arrays(tmp_path: Path) -> None:
    """8 ranks x 50k steps: the series holds one float64 array per rank, not lists."""
    run = plants.a_run(tmp_path)
    info = json.loads(run.run_json.read_text())
    run.run_json.write_text(json.dumps({**info, "world_size": 8, "hosts": ["a"] * 8}))
    body = "".join(f"{s},1.5,0,0,0.000,0.000,-1,0\n" for s in range(1, 50_001))
    for rank in range(8):
        run.steps_csv(rank).write_text(STEPS_CSV_HEADER + body)
    series = load_steps(load_run(str(run.path)))
    assert len(series.steps) == 50_000 and all(
        v.nbytes == 400_000 for v in series.per_rank.values()
    )
    assert sum(1 for _ in series.samples()) == 50_000


def test_the_page_links_a_merged_trace_only_inside_the_run(tmp_path: Path) -> None:
    run = plants.a_run(tmp_path / "base")
    report = build_report(load_run(str(run.path)))
    merged = report.captures[0].merged
    assert merged is not None
    merged.path.parent.mkdir(parents=True, exist_ok=True)
    merged.path.write_bytes(b"x")
    assert merged.path.resolve().as_uri() in render_html(report, use_matplotlib=False).html
    outside = tmp_path / "outside.json.gz"
    outside.write_bytes(b"secret")
    merged.path.unlink()
    merged.path.symlink_to(outside)
    page = render_html(report, use_matplotlib=False).html
    assert outside.as_uri() not in page and "not a file of the run" in page
