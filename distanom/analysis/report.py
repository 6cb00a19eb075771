"""The run report: what `distanom report` prints (text) or emits (`--json`).

Builds one JSON-ready dict from `RunData` (run facts, step statistics, detector counts,
episodes, every capture with its ranks' traces and tables, its cross-rank verdict,
kernel diff and merged trace from `distanom.analysis.crossrank`, problems found) and
renders it as text tables. The dict is the contract for machines; the text is for
people. A digest of each capture (per-rank breakdown, verdict, kernel diff, merged
trace path) is also written as its `summary.json`.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Mapping
from typing import Any

from distanom.analysis.crossrank import add_cross_rank, breakdown, outside_ms, verdict_line
from distanom.analysis.kernel_diff import kernel_diff_lines
from distanom.analysis.run import CaptureInfo, RunData, StepSeries, load_steps
from distanom.analysis.tables_io import BREAKDOWN_ROWS, rank_tables, timeline_json
from distanom.analysis.verdict import GC_NOTE_MS
from distanom.errors import DistanomError
from distanom.rundir import json_number, write_json_atomic

# Under the breakdown table of CPU-only traces: what its "outside ops" column holds.
OUTSIDE_NOTE = (
    "outside ops: step window before the rank's first op or after its last "
    "(idle to the verdict; in total)"
)


def build_report(data: RunData, *, engine: str = "auto") -> dict[str, Any]:
    series = load_steps(data)
    captures = [_capture_json(data, info, engine) for info in data.captures]
    for capture in captures:
        _add_gc(capture, series)
    add_cross_rank(data, captures)
    for info, capture in zip(data.captures, captures, strict=True):
        _write_summary(data, info, capture)
    status = data.status or {}
    median = series.median_ms()
    config = data.info.get("config") if isinstance(data.info.get("config"), dict) else {}
    multiplier = (config or {}).get("detect", {}).get("multiplier")
    report: dict[str, Any] = {
        "run_id": data.run.run_id,
        "run_dir": str(data.run.path),
        "world_size": data.world_size,
        "hosts": data.hosts,
        "state": _state(status),
        "started_at": data.info.get("started_at"),
        "torch": data.info.get("torch"),
        "argv": data.info.get("argv"),
        "steps": {
            "count": len(series.steps),
            "last": series.steps[-1] if series.steps else None,
            "median_ms": json_number(median),
            "threshold_ms": status.get("threshold_ms"),
            "multiplier": multiplier,
            # the detector's latest rolling median, the one its threshold multiplies
            "detector_median_ms": status.get("median_ms"),
        },
        "tracer": (status.get("tracer") or {}),
        "detector": status.get("detector") or {},
        "episodes": status.get("episodes") or [],
        "capture_state": {
            "written": (status.get("captures") or {}).get("written"),
            "skipped_disk": (status.get("captures") or {}).get("skipped_disk"),
            "missed": (status.get("captures") or {}).get("missed"),
            "capture_off": status.get("capture_off"),
            "consensus_error": status.get("consensus_error"),
        },
        "captures": captures,
        "capture_cost": capture_cost(data),
        "problems": list(data.problems),
    }
    return report


COST_PARTS = ("locate_ms", "build_ms", "encode_ms", "write_ms")


def capture_cost(data: RunData) -> dict[str, Any] | None:
    """What writing a capture cost one rank's capture worker (median over every rank's
    written files): time the training thread shares the GIL with. None before any
    capture recorded it."""
    costs = [
        held.cost_ms
        for info in data.captures
        for held in info.ranks.values()
        if all(part in held.cost_ms for part in COST_PARTS)
    ]
    if not costs:
        return None
    totals = [sum(c[p] for p in COST_PARTS) for c in costs]
    return {
        "files": len(costs),
        "median_ms": round(statistics.median(totals), 3),
        "max_ms": round(max(totals), 3),
        "parts_median_ms": {
            p: round(statistics.median(c[p] for c in costs), 3) for p in COST_PARTS
        },
    }


def _state(status: dict[str, Any]) -> str:
    from distanom.control import job_alive

    if not status:
        return "unknown"
    if status.get("state") == "running" and not job_alive(status):
        return "stopped (no heartbeat)"
    return str(status.get("state"))


def _capture_json(data: RunData, info: CaptureInfo, engine: str) -> dict[str, Any]:
    capture = {
        "step": info.step,
        "kinds": sorted(info.kinds),
        "step_ms": info.step_ms,
        "median_ms": info.median_ms,
        "threshold_ms": info.threshold_ms,
        "ratio": json_number(info.ratio),
        "slowest_rank": info.slowest_rank,
        "request": info.request,
        "ranks": {
            str(rank): {
                "trace": held.trace,
                "host": held.host,
                "bytes": held.bytes,
                "tracer": held.tracer,
                "tracer_stats": held.tracer_stats,
            }
            for rank, held in sorted(info.ranks.items())
        },
        "missing_ranks": info.missing_ranks,
    }
    _add_tables(data, info, capture, engine)
    for rank, held in sorted(info.ranks.items()):
        gaps = [what for key, what in _INCOMPLETE_IF.items() if held.tracer_stats.get(key)]
        if gaps:
            data.problems.append(
                f"step {info.step} rank {rank}: trace may lack records ({'; '.join(gaps)})"
            )
    return capture


def _add_gc(capture: dict[str, Any], series: StepSeries) -> None:
    """Each rank's Python garbage collection during the captured step (from its step file)."""
    pauses = {
        str(rank): {"ms": round(found[0], 3), "generation": found[1]}
        for rank, by_step in sorted(series.gc.items())
        if (found := by_step.get(capture["step"])) is not None
    }
    if pauses:
        capture["python_gc"] = pauses


def gc_sentence(capture: Mapping[str, Any]) -> str | None:
    """The ranks whose Python garbage collection took GC_NOTE_MS or more in the step."""
    parts = [
        f"rank {rank} {pause['ms']:.2f} ms (generation {pause['generation']})"
        for rank, pause in (capture.get("python_gc") or {}).items()
        if pause["ms"] >= GC_NOTE_MS
    ]
    return "python garbage collection during the step: " + ", ".join(parts) if parts else None


def _gc_lines(capture: Mapping[str, Any]) -> list[str]:
    sentence = gc_sentence(capture)
    return [f"  {sentence}"] if sentence else []


# Tracer stats of a served step that mean records of it may be missing from its trace.
_INCOMPLETE_IF = {
    "held_buffers_at_serve": "a CUPTI buffer was not handed back in time",
    "zero_timestamp_dropped": "records without timestamps were dropped",
}


def _add_tables(data: RunData, info: CaptureInfo, capture: dict[str, Any], engine: str) -> None:
    """Each rank's gpu_timeline (or host breakdown on CPU-only runs) into the capture."""
    for rank, held in sorted(info.ranks.items()):
        entry = capture["ranks"][str(rank)]
        trace = data.run.path / held.trace
        if not trace.is_file():
            continue
        try:
            tables = rank_tables(data.run, info.step, rank, trace, engine)
        except DistanomError as err:
            data.problems.append(f"step {info.step} rank {rank}: {err}")
            continue
        key = "gpu_timeline" if tables.kind == "gpu" else "host_timeline"
        entry[key] = timeline_json(tables.timeline)
        entry["timeline_kind"] = tables.kind


def _write_summary(data: RunData, info: CaptureInfo, capture: dict[str, Any]) -> None:
    """captures/step_<N>/summary.json: all ranks side by side (refreshed by each report)."""
    summary = {
        "step": info.step,
        "kinds": capture["kinds"],
        "step_ms": capture["step_ms"],
        "ratio": capture["ratio"],
        "missing_ranks": capture["missing_ranks"],
        "unreadable_ranks": capture.get("unreadable_ranks", []),
        "ranks": {
            rank: {
                "host": entry.get("host"),
                "breakdown_ms": breakdown(entry),
                "outside_ms": outside_ms(entry),
            }
            for rank, entry in capture["ranks"].items()
        },
        "verdict": capture.get("verdict"),
        "kernel_diff": capture.get("kernel_diff"),
        "merged_trace": capture.get("merged_trace"),
        "python_gc": capture.get("python_gc", {}),
    }
    with contextlib.suppress(OSError):  # a read-only run directory still gets its report
        write_json_atomic(data.run.summary_json(info.step), summary)


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=False)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(header, widths, strict=True))]
    lines += [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    return [line.rstrip() for line in lines]


def shows_outside(capture: Mapping[str, Any]) -> bool:
    """Whether a capture's breakdown table gets the "outside ops" column: the verdict
    counts time outside the ops' span as idle, so the table shows it too."""
    return any(outside_ms(entry) is not None for entry in capture["ranks"].values())


def breakdown_numbers(entry: Mapping[str, Any], outside: bool) -> list[float | None] | None:
    """One rank's row of the breakdown table, text or HTML: the four parts, with
    `outside` the time outside its ops (None: unknown), then the total, which includes
    it. None when the rank has no tables."""
    values = breakdown(entry)
    if values is None:
        return None
    numbers: list[float | None] = [values[row] for row in BREAKDOWN_ROWS[:4]]
    total = values["total_time"]
    if outside:
        extra = outside_ms(entry)
        numbers.append(extra)
        total += extra or 0.0
    return [*numbers, total]


def _breakdown_lines(capture: dict[str, Any]) -> list[str]:
    outside = shows_outside(capture)
    rows = []
    kinds = set()
    for rank, entry in capture["ranks"].items():
        numbers = breakdown_numbers(entry, outside)
        if numbers is None:
            continue
        kinds.add(entry.get("timeline_kind", "gpu"))
        cells = ["-" if n is None else f"{n:.2f}" for n in numbers]
        rows.append([rank, entry.get("host") or "-", *cells])
    if not rows:
        return []
    what = "GPU time" if kinds == {"gpu"} else "host time (CPU-only trace)"
    header = ["rank", "host", "compute", "exp.comm", "exp.memcpy", "idle"]
    header += ["outside ops", "total"] if outside else ["total"]
    lines = ["", f"step {capture['step']} ({','.join(capture['kinds'])}): {what}, ms"]
    lines += ["  " + line for line in table(header, rows)]
    return lines + ([f"  {OUTSIDE_NOTE}"] if outside else [])


def ranks_cell(capture: Mapping[str, Any]) -> str:
    """Ranks whose trace was read, of those expected; unreadable ones are named apart."""
    ranks = capture["ranks"]
    unreadable = capture.get("unreadable_ranks") or []
    expected = len(ranks) + len(capture["missing_ranks"])
    cell = f"{len(ranks) - len(unreadable)}/{expected}"
    return cell + (f" ({len(unreadable)} unreadable)" if unreadable else "")


def median_parts(steps: Mapping[str, Any]) -> list[str]:
    """The run's median and the detector's threshold with the median it is a multiple
    of: the detector's rolling one, not the run's (they differ), so both are named."""
    parts = [f"median {_fmt(steps['median_ms'])} ms over the run"]
    if steps.get("threshold_ms") is None:
        return parts
    threshold = f"detector threshold {_fmt(steps['threshold_ms'])} ms"
    multiplier, rolling = steps.get("multiplier"), steps.get("detector_median_ms")
    if multiplier and rolling is not None:
        threshold += f" = {multiplier} x its latest rolling median {_fmt(rolling)} ms"
    elif multiplier:
        threshold += f" ({multiplier} x its rolling median)"
    return [*parts, threshold]


def _cross_rank_lines(capture: dict[str, Any]) -> list[str]:
    """The verdict line and the top kernel changes of one capture."""
    lines = []
    sentence = verdict_line(capture)
    if sentence:
        lines.append(f"  verdict: {sentence}")
    culprit = (capture.get("verdict") or {}).get("culprit_rank")
    lines += kernel_diff_lines(capture.get("kernel_diff"), culprit, top=5)
    if capture.get("merged_trace"):
        lines.append(f"  all ranks in one trace: {capture['merged_trace']}")
    return lines


def _overhead_lines(tracer: dict[str, Any]) -> list[str]:
    """The run's own measure of what tracing cost (traced vs untraced windows)."""
    duty = tracer.get("duty_cycle") or {}
    overhead = duty.get("measured_overhead_pct")
    fraction = duty.get("traced_fraction")
    if not isinstance(fraction, (int, float)):
        return []
    budget = duty.get("budget_pct")
    measured = (
        f"measured overhead {overhead:.1f}% of step time while tracing"
        if isinstance(overhead, (int, float))
        else "overhead not measured yet (no untraced window so far)"
    )
    line = f"  tracing: {measured}, {100 * fraction:.1f}% of steps traced"
    effective = duty.get("effective_overhead_pct")
    if isinstance(effective, (int, float)):
        line += f": {effective:.2f}% of the run"
    if isinstance(budget, (int, float)):
        line += f" (budget {budget:g}%)"
    lines = [line]
    for direction, count_key, excess_key in (
        ("on", "switches_on", "switch_on_excess_ms"),
        ("off", "switches_off", "switch_excess_ms"),
    ):
        switch_ms, switches = duty.get(excess_key), duty.get(count_key)
        if isinstance(switch_ms, (int, float)) and isinstance(switches, int) and switches:
            lines.append(
                f"  tracing switched {direction} {switches} time(s); the step after a switch "
                f"ran {switch_ms:.1f} ms longer (median of the recent ones), counted in the "
                "overhead"
            )
    return lines


def render_text(report: dict[str, Any]) -> str:
    steps = report["steps"]
    hosts = report["hosts"]
    lines = [
        f"run {report['run_id']}  ({report['run_dir']})",
        f"  world size {report['world_size']}"
        + (f" on {len(set(hosts))} host(s): {', '.join(sorted(set(hosts)))}" if hosts else "")
        + f"   state: {report['state']}",
        f"  steps: {steps['count']}   " + "   ".join(median_parts(steps)),
    ]
    tracer = report.get("tracer") or {}
    if tracer.get("note"):
        lines.append(f"  {tracer['note']}")
    lines += _overhead_lines(tracer)
    detector = report.get("detector") or {}
    if detector:
        lines.append(
            f"  detector: {detector.get('judged', 0)} steps judged, "
            f"{detector.get('anomalous', 0)} anomalous in {len(report.get('episodes') or [])} "
            f"episode(s), {detector.get('captured', 0)} captured"
            + (
                f", {detector['skipped_budget']} over budget"
                if detector.get("skipped_budget")
                else ""
            )
            + (
                f", {detector['anomalous_untraced']} while tracing was off"
                if detector.get("anomalous_untraced")
                else ""
            )
        )
    cost = report.get("capture_cost")
    if cost:
        parts = ", ".join(
            f"{p.removesuffix('_ms')} {v:.1f}" for p, v in cost["parts_median_ms"].items()
        )
        lines.append(
            f"  capture work: {cost['median_ms']:.1f} ms per rank and capture (median of "
            f"{cost['files']} files; {parts}; max {cost['max_ms']:.1f}), on each rank's "
            "capture thread"
        )
    state = report.get("capture_state") or {}
    if state.get("skipped_disk"):
        lines.append(
            f"  disk budget (capture.max_disk_mb) reached: {state['skipped_disk']} capture(s) "
            "counted but not written on rank 0"
        )
    if state.get("missed"):
        lines.append(
            f"  {state['missed']} capture(s) decided after the tracer had dropped the step "
            "(raise tracer.history_steps)"
        )
    for key in ("capture_off", "consensus_error"):
        if state.get(key):
            lines.append(f"  capture stepped aside: {state[key]}")
    lines.append("")
    captures = report["captures"]
    if not captures:
        lines.append("no captures")
    else:
        rows = []
        for capture in captures:
            ranks = capture["ranks"]
            first = next(iter(ranks.values()))["trace"] if ranks else "-"
            rows.append(
                [
                    str(capture["step"]),
                    ",".join(capture["kinds"]),
                    _fmt(capture["step_ms"]),
                    _fmt(capture["ratio"], 2),
                    ranks_cell(capture),
                    first,
                ]
            )
        lines.append(f"captures ({len(captures)}):")
        lines += [
            "  " + line
            for line in table(
                ["step", "kind", "step ms", "x rolling median", "ranks", "trace"], rows
            )
        ]
        for capture in captures:
            lines += _breakdown_lines(capture)
            lines += _gc_lines(capture)
            lines += _cross_rank_lines(capture)
        for capture in captures:
            if capture["missing_ranks"]:
                missing = ",".join(str(r) for r in capture["missing_ranks"])
                lines.append(f"  step {capture['step']}: no trace from rank(s) {missing}")
            if capture.get("unreadable_ranks"):
                unreadable = ",".join(str(r) for r in capture["unreadable_ranks"])
                lines.append(
                    f"  step {capture['step']}: unreadable trace from rank(s) {unreadable} "
                    "(see problems)"
                )
    if report["problems"]:
        lines.append("")
        lines.append(f"problems ({len(report['problems'])}):")
        lines += [f"  {problem}" for problem in report["problems"][:50]]
        if len(report["problems"]) > 50:
            lines.append(f"  ... {len(report['problems']) - 50} more")
    return "\n".join(lines) + "\n"
