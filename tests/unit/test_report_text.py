"""The text report's run-level lines: tracing cost and capture state from status.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distanom.analysis.report import Report, build_report, render_text, report_json, write_outputs
from distanom.analysis.run import RunData, load_run
from distanom.cli import main as cli_main
from distanom.rundir import write_json_atomic
from tests.unit.rungen import Capture, make_run
from tests.unit.stepgen import gpu_job


def run_report(data: RunData) -> Report:
    """The report of a loaded run, its files written, as `distanom report` makes it."""
    return write_outputs(data, build_report(data))


def test_measured_overhead_and_budget_states_are_reported(tmp_path: Path) -> None:
    run = make_run(tmp_path, [], hosts=["a", "a"])
    write_json_atomic(
        run.status_json,
        {
            "state": "finished",
            "world_size": 2,
            "tracer": {
                "backend": "cupti",
                "note": "tracer: cupti (auto)",
                "duty_cycle": {
                    "budget_pct": 1.0,
                    "traced_fraction": 0.0775,
                    "measured_overhead_pct": 12.9,
                    "effective_overhead_pct": 0.98,
                    "switches_off": 40,
                    "switch_excess_ms": 3.46,
                    "switches_on": 41,
                    "switch_on_excess_ms": 9.62,
                    "tracing_starts": 55,
                    "tracing_stops": 40,
                },
            },
            "captures": {"written": 3, "skipped_disk": 2, "missed": 1},
            "detector": {
                "judged": 90,
                "anomalous": 5,
                "captured": 3,
                "skipped_budget": 2,
                "disturbed": 4,
            },
            "agent_cost": {
                "boundary_us_per_step": 33.5,
                "control_us_per_step": 25.2,
                "pct_of_median_step": 0.92,
            },
        },
    )
    text = render_text(run_report(load_run(str(run.path))))
    assert "tracer: cupti (auto)" in text
    assert (
        "distanom's own time (rank 0): 33.5 us at each step end + 25.2 us of its threads' CPU "
        "per step = 0.92% added to the median step; with tracing about 1.90% in all" in text
    )
    assert (
        "measured overhead 12.9% of step time while tracing, 7.8% of steps traced: 0.98% "
        "added to the run's time (budget 1%)" in text
    )
    assert (
        "switched on 55 time(s), 41 by the duty cycle (the others for planned or requested "
        "captures); the step after a duty-cycle switch ran 9.6 ms longer" in text
    )
    assert "switched off 40 time(s); the step after a duty-cycle switch ran 3.5 ms longer" in text
    assert "disk budget (capture.max_disk_mb) reached: 2 capture(s)" in text
    assert "1 capture(s) decided after the tracer had dropped the step" in text
    assert "2 over budget" in text
    assert "; 4 held distanom's own work (captures, heavy rounds), judged without it" in text


def test_own_time_over_one_percent_on_short_event_timed_steps_names_the_cheaper_clock(
    tmp_path: Path,
) -> None:
    """Only the event clock has an event to drop, only from 1% of a step is it said, and
    only on steps short enough for the adaptive clock to switch (make_run's are 1.5 ms)."""
    cases = [
        (2.17, "cuda_event", True),
        (1.00, "cuda_event", True),
        (0.99, "cuda_event", False),
        (2.17, "adaptive", False),
        (2.17, None, False),
    ]
    for index, (pct, mode, hinted) in enumerate(cases):
        run = make_run(tmp_path / str(index), [], hosts=["a"])
        cost = {"boundary_us_per_step": 36.0, "control_us_per_step": 26.0}
        cost |= {"pct_of_median_step": pct, "clock_mode": mode}
        write_json_atomic(
            run.status_json, {"state": "finished", "world_size": 1, "agent_cost": cost}
        )
        report = run_report(load_run(str(run.path)))
        assert report.steps.median_ms is not None and report.steps.median_ms < 10
        text = render_text(report)
        assert f"= {pct:.2f}% added to the median step" in text
        assert ("clock.mode: adaptive drops the CUDA event" in text) is hinted, (pct, mode)


def test_no_clock_hint_where_steps_are_too_long_for_the_adaptive_clock(tmp_path: Path) -> None:
    run = make_run(tmp_path, [], hosts=["a"], step_ms=12.0)
    cost = {"boundary_us_per_step": 62.0, "control_us_per_step": 53.0}
    cost |= {"pct_of_median_step": 1.5, "clock_mode": "cuda_event"}
    write_json_atomic(run.status_json, {"state": "finished", "world_size": 1, "agent_cost": cost})
    report = run_report(load_run(str(run.path)))
    assert report.steps.median_ms is not None and report.steps.median_ms >= 10
    text = render_text(report)
    assert "= 1.50% added to the median step" in text
    assert "clock.mode: adaptive" not in text


def test_start_up_is_said_once_in_ms_and_the_step_end_by_part(tmp_path: Path) -> None:
    """A status with the steady figure (`own_time`): the per-step figure is the untraced
    step end's; start-up, the end and tracer switches are said once, apart."""
    run = make_run(tmp_path, [], hosts=["a"])
    cost = {
        "boundary_us_per_step": 21.5,
        "phase_marks_us_per_step": 4.0,
        "control_us_per_step": 30.0,
        "pct_of_median_step": 0.37,
        "boundary_parts_us": {"stamp": 2.0, "clock": 9.5, "phases": 3.0, "bookkeeping": 2.0,
                              "tracer": 3.0, "handoff": 2.0},
        "startup_ms": 412.25,
        "teardown_ms": 3.1,
        "tracer_switches": 14,
        "tracer_switch_ms": 35.2,
        "boundary_cpu_share": 0.8,
        "phase_marks_cpu_share": 0.25,
        "phase_marks_wait_us_per_step": 61.25,
        "record_floor_us": 2.4,
    }  # fmt: skip
    write_json_atomic(run.status_json, {"state": "finished", "world_size": 1, "agent_cost": cost})
    text = render_text(run_report(load_run(str(run.path))))
    assert (
        "of the phase marks' time, 61.2 us a step was their CUDA event records beyond "
        "their median 2.4 us (waits for a full launch queue or the GIL, and jitter)" in text
    )
    # no wait, or no record sampled (host-only phases): no such line
    for quiet in ({"phase_marks_wait_us_per_step": 0.0}, {"record_floor_us": None}):
        write_json_atomic(
            run.status_json,
            {"state": "finished", "world_size": 1, "agent_cost": {**cost, **quiet}},
        )
        assert "beyond their median" not in render_text(run_report(load_run(str(run.path))))
    assert (
        "distanom's own time (rank 0): 21.5 us at each untraced step end + 4.0 us of phase "
        "marks + 30.0 us of its threads' CPU per step = 0.37% added to the median step" in text
    )
    assert (
        "a step end, by part: stamp 2.0, clock 9.5, phases 3.0, bookkeeping 2.0, tracer 3.0, "
        "handoff 2.0" in text
    )
    assert (
        "once, not per step: start-up 412.2 ms, the end 3.1 ms; 14 tracer switch(es) at step "
        "ends, 35.2 ms (tracing's cost)" in text
    )


def test_the_report_says_where_the_steps_file_was_written(tmp_path: Path) -> None:
    """With its side process's CPU (another core's); a phrase read back is cut short."""
    run = make_run(tmp_path, [], hosts=["a"])
    cost = {"boundary_us_per_step": 21.5, "control_us_per_step": 30.0, "pct_of_median_step": 0.4}

    def text_for(extra: dict[str, object]) -> str:
        body = {"state": "finished", "world_size": 1, "agent_cost": {**cost, **extra}}
        write_json_atomic(run.status_json, body)
        return render_text(run_report(load_run(str(run.path))))

    side = {"steps_written_by": "side process", "side_process_cpu_us_per_step": 3.25}
    assert (
        "its steps file written by: side process; the side process used 3.2 us of CPU a "
        "step, on another core\n" in text_for(side)
    )
    started = text_for(side | {"side_process_startup_cpu_ms": 60.0})
    assert "used 3.2 us of CPU a step, on another core (60 ms to start)\n" in started
    for hostile in ("60", 10**400, 1e300, -5.0, True):  # a hostile status: not shown
        odd = text_for(side | {"side_process_startup_cpu_ms": hostile})
        assert "on another core\n" in odd, hostile
    huge = text_for({"steps_written_by": "side process", "side_process_cpu_us_per_step": 10**400})
    assert "its steps file written by: side process\n" in huge
    here = text_for({"steps_written_by": "control thread (side process: it ended)",
                     "side_process_cpu_us_per_step": None})  # fmt: skip
    assert "its steps file written by: control thread (side process: it ended)\n" in here
    long = text_for({"steps_written_by": "x" * 10_000, "side_process_cpu_us_per_step": "7"})
    assert "x" * 160 + "\n" in long and "x" * 161 not in long
    assert "its steps file" not in text_for({})  # an older status: nothing said


def test_the_reports_adaptive_threshold_is_the_clocks() -> None:
    from distanom.analysis.render_text import ADAPTIVE_BELOW_MS
    from distanom.clock import HOST_BELOW_MS

    assert ADAPTIVE_BELOW_MS == HOST_BELOW_MS


def test_no_overhead_line_before_any_untraced_window(tmp_path: Path) -> None:
    run = make_run(tmp_path, [], hosts=["a"])
    write_json_atomic(
        run.status_json,
        {"state": "finished", "world_size": 1, "tracer": {"duty_cycle": {"traced_fraction": 1.0}}},
    )
    text = render_text(run_report(load_run(str(run.path))))
    # a status.json written before the window counts: no claim about why
    assert "overhead not measured (no traced window compared with an untraced one)" in text


def test_an_unmeasured_overhead_says_the_run_was_too_short_and_a_measured_one_its_basis(
    tmp_path: Path,
) -> None:
    run = make_run(tmp_path, [], hosts=["a"])
    duty = {"traced_fraction": 1.0, "window_steps": 16, "overhead_comparisons": 0}
    duty |= {"complete_traced_windows": 7, "complete_untraced_windows": 0}
    status = {"state": "finished", "world_size": 1, "tracer": {"duty_cycle": duty}}
    write_json_atomic(run.status_json, status)
    text = render_text(run_report(load_run(str(run.path))))
    assert "overhead not measured yet" not in text  # said of finished runs that had it
    assert (
        "tracing: run too short to measure tracing overhead: 7 whole traced and 0 untraced "
        "windows of 16 steps so far, needs an untraced window after a whole traced one" in text
    )
    duty |= {"measured_overhead_pct": 27.0, "overhead_comparisons": 1}
    duty |= {"complete_traced_windows": 25, "complete_untraced_windows": 1}
    write_json_atomic(run.status_json, status)
    text = render_text(run_report(load_run(str(run.path))))
    assert (
        "measured overhead 27.0% of step time while tracing (from 1 comparison with an "
        "untraced window: rough)" in text
    )
    assert "too short" not in text
    duty["overhead_comparisons"] = 4
    write_json_atomic(run.status_json, status)
    text = render_text(run_report(load_run(str(run.path))))
    assert "27.0% of step time while tracing (from 4 comparisons with untraced windows)" in text


def test_no_tracing_line_when_no_tracer_started(tmp_path: Path) -> None:
    # a script that failed before its first step: the duty cycle's first window was
    # decided, but nothing was traced, and "100% of steps traced" would say otherwise
    run = make_run(tmp_path, [], hosts=["a"])
    tracer = {"backend": None, "note": "tracer: not started"}
    tracer["duty_cycle"] = {"traced_fraction": 1.0, "budget_pct": 1.0}
    write_json_atomic(run.status_json, {"state": "failed", "world_size": 1, "tracer": tracer})
    text = render_text(run_report(load_run(str(run.path))))
    assert "tracer: not started" in text and "tracing:" not in text


def test_header_names_which_median_the_threshold_multiplies(tmp_path: Path) -> None:
    """The run's median and the detector's rolling median differ: both are labelled, and
    the threshold is shown as the multiple of the one it comes from."""
    run = make_run(tmp_path, [], hosts=["a", "a"])
    write_json_atomic(
        run.status_json,
        {"state": "finished", "world_size": 2, "median_ms": 1.8, "threshold_ms": 2.7},
    )
    report = run_report(load_run(str(run.path)))
    assert report_json(report)["steps"]["detector_median_ms"] == 1.8
    text = render_text(report)
    assert (
        "  steps: 99   median 1.5 ms over the run   detector threshold 2.7 ms = 1.5 x its "
        "latest rolling median 1.8 ms\n" in text
    )


def test_a_threshold_set_by_the_floor_is_not_called_a_multiple(tmp_path: Path) -> None:
    """A 1.8 ms median with the 2 ms slowdown floor: the threshold is 3.8 ms, not 1.5 x."""
    run = make_run(tmp_path, [], hosts=["a", "a"])
    write_json_atomic(
        run.status_json,
        {"state": "finished", "world_size": 2, "median_ms": 1.8, "threshold_ms": 3.8},
    )
    text = render_text(run_report(load_run(str(run.path))))
    assert (
        "detector threshold 3.8 ms, over 1.5 x its latest rolling median 1.8 ms (its spread "
        "fence or slowdown floor)\n" in text
    )
    assert "= 1.5 x" not in text


def test_header_without_the_detectors_median_still_names_it(tmp_path: Path) -> None:
    run = make_run(tmp_path, [], hosts=["a"])  # status.json from before median_ms was kept
    text = render_text(run_report(load_run(str(run.path))))
    header = "median 1.5 ms over the run   detector threshold 2.2 ms (1.5 x its rolling median)"
    assert header in text


def test_a_trace_that_may_lack_records_is_named_among_the_problems(tmp_path: Path) -> None:
    stats = {0: {"held_buffers_at_serve": 0}, 1: {"held_buffers_at_serve": 1}}
    run = make_run(tmp_path, [Capture(40, "anomaly", gpu_job(), 4.1, 1.2, stats)], hosts=["a"] * 4)
    report = run_report(load_run(str(run.path)))
    assert report_json(report)["problems"] == [
        "step 40 rank 1: trace may lack records (a CUPTI buffer was not handed back in time)"
    ]
    assert "step 40 rank 1: trace may lack records" in render_text(report)


def test_the_capture_workers_cost_is_summarised(tmp_path: Path) -> None:
    def cost(locate: float) -> dict[str, float]:
        return {"locate_ms": locate, "lookups": 2, "build_ms": 8.0, "encode_ms": 6.0,
                "write_ms": 1.0}  # fmt: skip

    costs = {0: cost(5.0), 1: cost(9.0), 2: {"locate_ms": "x"}}  # rank 2: an older line
    run = make_run(
        tmp_path, [Capture(40, "anomaly", gpu_job(), 4.1, 1.2, None, costs)], hosts=["a"] * 4
    )
    report = run_report(load_run(str(run.path)))
    assert report_json(report)["capture_cost"] == {
        "files": 2,
        "median_ms": 22.0,
        "max_ms": 24.0,
        "parts_median_ms": {"locate_ms": 7.0, "build_ms": 8.0, "encode_ms": 6.0, "write_ms": 1.0},
    }
    assert (
        "capture work: 22.0 ms per rank and capture (median of 2 files; locate 7.0, build 8.0, "
        "encode 6.0, write 1.0; max 24.0)" in render_text(report)
    )


def test_no_capture_cost_line_without_recorded_costs(tmp_path: Path) -> None:
    run = make_run(tmp_path, [Capture(40, "anomaly", gpu_job(), 4.1, 1.2)], hosts=["a"] * 4)
    report = run_report(load_run(str(run.path)))
    assert report_json(report)["capture_cost"] is None
    assert "capture work" not in render_text(report)


def test_damaged_costs_in_the_index_are_left_out(tmp_path: Path) -> None:
    good = {"locate_ms": 5.0, "build_ms": 8.0, "encode_ms": 6.0, "write_ms": 1.0}
    costs = {
        0: good,
        1: {**good, "build_ms": 10**400},  # too large for a float
        2: {**good, "locate_ms": -3.0},
        3: {**good, "encode_ms": 1e308, "write_ms": 1e308},  # would sum to inf
    }
    run = make_run(
        tmp_path, [Capture(40, "anomaly", gpu_job(), 4.1, 1.2, None, costs)], hosts=["a"] * 4
    )
    report = run_report(load_run(str(run.path)))
    assert report_json(report)["capture_cost"]["files"] == 1
    assert report_json(report)["capture_cost"]["median_ms"] == 20.0
    json.dumps(report_json(report), allow_nan=False)  # what `distanom report --json` does


def _budgeted_run(tmp_path: Path, **duty: float) -> str:
    run = make_run(tmp_path, [], hosts=["a", "a"])
    body = {"budget_pct": 1.0, "traced_fraction": 0.08, "window_steps": 16}
    body.update(min_fraction=1 / 256, **duty)
    write_json_atomic(
        run.status_json,
        {"state": "finished", "world_size": 2, "tracer": {"backend": "kineto", "duty_cycle": body}},
    )
    return render_text(run_report(load_run(str(run.path))))


def test_tracing_far_over_its_budget_is_explained(tmp_path: Path) -> None:
    # a short run of ms-long CPU steps: the measuring window alone is 16 x 90% / 300
    short = _budgeted_run(
        tmp_path / "a", measured_overhead_pct=90.1, effective_overhead_pct=7.53, steps_recorded=300
    )
    assert "7.53% added to the run's time (budget 1%)" in short
    assert (
        "over budget: tracing costs 90% of a traced step, so the window traced at the start "
        "to measure that (4.81% of this run) and captures traced whatever the budget" in short
    )
    assert "300 steps were too few" in short
    # tracing at 3x the step: even the 1-in-256 floor is over a 1% budget
    floor = _budgeted_run(
        tmp_path / "b", measured_overhead_pct=300.0, effective_overhead_pct=1.6,
        steps_recorded=90_000,
    )  # fmt: skip
    assert "even the 0.39% of windows always traced (to keep measuring it)" in floor
    # within 1.5x the budget: nothing to explain
    fine = _budgeted_run(
        tmp_path / "c", measured_overhead_pct=90.0, effective_overhead_pct=1.4, steps_recorded=300
    )
    assert "over budget" not in fine


def test_report_and_status_default_to_the_runs_folder_where_the_job_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    make_run(tmp_path / "runs", [], hosts=["h0", "h1"], run_id="20261203-000000")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli_main(["report"]) == 0
    assert "20261203-000000" in capsys.readouterr().out
    assert cli_main(["status"]) == 0
    assert "finished" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path / "runs")  # no runs/ here: the error names the folder
    assert cli_main(["report"]) == 2
    assert capsys.readouterr().err.strip() == "distanom: runs: no such run directory"


def test_the_live_status_says_what_the_tracing_overhead_rests_on(tmp_path: Path) -> None:
    from distanom.live import render_status
    from distanom.rundir import RunDir

    # one traced run against one untraced window: on a busy host such a figure swung
    # from -15% to 74% between two looks, with nothing to say it was one comparison
    duty = {"traced_fraction": 0.96, "window_steps": 16, "overhead_comparisons": 1}
    tracer = {"overhead_pct": 74.0, "duty_cycle": duty}
    text = render_status(RunDir(tmp_path), {"state": "running", "tracer": tracer})
    assert "measured tracing overhead: 74.00% of step time (from 1 comparison with an " in text
    assert "untraced window: rough)" in text
    tracer["overhead_pct"] = None
    duty |= {"overhead_comparisons": 0, "complete_traced_windows": 5}
    duty |= {"complete_untraced_windows": 0}
    text = render_status(RunDir(tmp_path), {"state": "running", "tracer": tracer})
    assert "run too short to measure tracing overhead: 5 whole traced and 0 untraced" in text


def test_the_governor_counts_what_its_overhead_rests_on() -> None:
    from distanom.governor import OverheadGovernor

    gov = OverheadGovernor(None)
    gov.seed_probes("2")  # the first untraced window: window 8
    for step in range(8 * 16):
        gov.record(step, 0.011 if gov.tracing_on(step) else 0.010, gov.tracing_on(step))
    report = gov.report()
    assert report["measured_overhead_pct"] is None
    assert (report["complete_traced_windows"], report["complete_untraced_windows"]) == (8, 0)
    for step in range(8 * 16, 10 * 16):
        gov.record(step, 0.011 if gov.tracing_on(step) else 0.010, gov.tracing_on(step))
    report = gov.report()
    assert report["measured_overhead_pct"] == pytest.approx(10.0, abs=0.5)
    assert report["overhead_comparisons"] == 1 and report["complete_untraced_windows"] == 1
