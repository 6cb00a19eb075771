"""Python garbage-collection pauses: measured per step, written to the step file, shown
beside a captured step by the report."""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import torch

from distanom.analysis.html_report import render_html
from distanom.analysis.report import Report, build_report, render_text, report_json, write_outputs
from distanom.analysis.run import RunData, load_run, load_steps
from distanom.gc_pauses import GcPauses
from tests.conftest import Ticks
from tests.unit.rungen import Capture, make_run
from tests.unit.stepgen import gpu_job
from tests.unit.test_agent_steps import make_agent


def run_report(data: RunData) -> Report:
    """The report of a loaded run, its files written, as `distanom report` makes it."""
    return write_outputs(data, build_report(data))


def test_collections_are_added_up_until_taken() -> None:
    pauses = GcPauses(Ticks(1_000_000))
    pauses.install()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(1)
        spent, generation = pauses.take()
        assert spent == 3.0 and generation == 2  # 1 ms each, the highest generation
        assert pauses.take() == (0.0, -1)
    finally:
        pauses.uninstall()
    gc.collect()
    assert pauses.take() == (0.0, -1)  # uninstalled: no longer called
    assert pauses._on_collection not in gc.callbacks


def test_a_malformed_callback_never_raises() -> None:
    pauses = GcPauses(Ticks(1_000_000))
    pauses._on_collection("stop", {})  # a stop without its start
    pauses._on_collection("start", {"generation": "2"})  # not an int: ignored
    pauses._on_collection("stop", {})
    assert pauses.take() == (1.0, -1)


def test_a_collection_in_progress_at_a_boundary_counts_in_the_step_it_ends() -> None:
    pauses = GcPauses(Ticks(1_000_000))
    pauses._on_collection("start", {"generation": 2})  # on another thread, say
    assert pauses.take() == (0.0, -1)  # the boundary: nothing has ended yet
    pauses._on_collection("stop", {"generation": 2})
    assert pauses.take() == (1.0, 2)  # whole, with its generation


def test_the_agent_writes_each_steps_collections(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    model = torch.nn.Linear(8, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    gc.disable()  # no automatic collection: only the one planted below
    try:
        for step in range(8):
            model(torch.randn(4, 8)).sum().backward()
            if step == 5:  # during step 5 (between boundaries 4 and 5), on another thread
                collector = threading.Thread(target=gc.collect, args=(2,))
                collector.start()
                collector.join()
            sgd.step()
        agent.close()
    finally:
        gc.enable()
    assert agent.run is not None
    rows = agent.run.steps_csv(0).read_text().splitlines()
    assert rows[0].startswith("step,duration_ms,traced,after_flush,self_ms,gc_ms,gc_gen,skipped,")
    fields = {int(r.split(",")[0]): r.split(",") for r in rows[1:]}
    assert sorted(fields) == list(range(1, 8))
    assert [s for s, f in fields.items() if f[6] != "-1"] == [5]
    assert float(fields[5][5]) > 0 and fields[5][6] == "2"
    assert all(float(f[5]) == 0 for s, f in fields.items() if s != 5)
    collections = load_steps(load_run(str(agent.run.path))).gc[0]
    assert list(collections) == [5] and collections[5][1] == 2


def with_gc_columns(path: Path, pauses: dict[int, tuple[float, int]], damaged: int) -> None:
    """Rewrite a step file of make_run in the current format, with these collections."""
    rows = path.read_text().splitlines()
    out = [rows[0] + ",after_flush,self_ms,gc_ms,gc_gen"]
    for row in rows[1:]:
        step = int(row.split(",")[0])
        spent, generation = pauses.get(step, (0.0, -1))
        tail = "x,y" if step == damaged else f"{spent:.3f},{generation}"
        out.append(f"{row},0,0.000,{tail}")
    path.write_text("\n".join(out) + "\n")


def test_the_report_names_a_long_collection_in_a_captured_step(tmp_path: Path) -> None:
    run = make_run(tmp_path, [Capture(40, "anomaly", gpu_job(), 4.1, 1.2)], hosts=["a"] * 4)
    with_gc_columns(run.steps_csv(0), {40: (0.2, 0), 41: (30.0, 2)}, damaged=12)
    with_gc_columns(run.steps_csv(1), {40: (22.5, 2)}, damaged=-1)
    data = load_run(str(run.path))
    report = run_report(data)
    capture = report_json(report)["captures"][0]
    assert capture["python_gc"] == {
        "0": {"ms": 0.2, "generation": 0},
        "1": {"ms": 22.5, "generation": 2},
    }
    summary = json.loads(run.summary_json(40).read_text())
    assert summary["python_gc"] == capture["python_gc"]
    text = render_text(report)
    # rank 0's young collection is below the line's threshold; step 41 was not captured
    assert "python garbage collection during the step: rank 1 22.50 ms (generation 2)" in text
    assert "rank 0 0.20" not in text and "30.00" not in text
    page = render_html(run_report(data), use_matplotlib=False).html
    assert "Python garbage collection during the step: rank 1 22.50 ms (generation 2)" in page
    # a damaged collection cell loses the collection, not the step; ranks 2-3 have the
    # older format
    assert not any("unreadable row" in p for p in report_json(report)["problems"])
    assert report_json(report)["steps"]["count"] == 99


def test_runs_written_before_the_gc_columns_still_load(tmp_path: Path) -> None:
    run = make_run(tmp_path, [Capture(40, "anomaly", gpu_job(), 4.1, 1.2)], hosts=["a"] * 4)
    report = run_report(load_run(str(run.path)))
    assert "python_gc" not in report_json(report)["captures"][0]
    assert "python garbage collection" not in render_text(report)


def test_a_repeated_step_row_replaces_that_steps_collection(tmp_path: Path) -> None:
    run = make_run(tmp_path, [], hosts=["a"])
    with_gc_columns(run.steps_csv(0), {41: (30.0, 2)}, damaged=-1)
    with open(run.steps_csv(0), "a") as handle:
        handle.write("41,1.5000,1,0,0.000,0.000,-1\n")  # written again, without one
    assert load_steps(load_run(str(run.path))).gc[0] == {}


def test_a_host_stall_verdict_names_the_culprits_collection(tmp_path: Path) -> None:
    stalled = gpu_job(gap_us={1: 3000.0})  # rank 1's host stalls 3 ms
    run = make_run(tmp_path, [Capture(40, "anomaly", stalled, 4.1, 1.2)], hosts=["a"] * 4)
    with_gc_columns(run.steps_csv(0), {40: (2.5, 2)}, damaged=-1)  # not the culprit
    with_gc_columns(run.steps_csv(1), {40: (2.9, 2)}, damaged=-1)
    report = run_report(load_run(str(run.path)))
    verdict = report_json(report)["captures"][0]["verdict"]
    assert (verdict["culprit_rank"], verdict["cause"]) == (1, "host_stall")
    assert verdict["evidence"].endswith(
        "; Python garbage collection ran 2.90 ms on rank 1 during the step (generation 2)"
    )
    assert verdict["details"]["python_gc_ms"] == 2.9
