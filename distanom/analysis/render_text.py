"""The report as text: what `distanom report RUN_DIR` prints.

Reads only the model (`distanom.analysis.model.Report`); the phrases the HTML page
shares with it (`median_parts`, `ranks_cell`, `gc_sentence`, `breakdown_numbers`,
`OUTSIDE_NOTE`) live here too, so both say the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from distanom.analysis.anomalies import Anomaly, evidence_notes
from distanom.analysis.anomaly_classes import anomaly_classes, recurrence_line, recurring
from distanom.analysis.hangs import hang_lines
from distanom.analysis.kernel_diff import kernel_diff_lines
from distanom.analysis.model import (
    BREAKDOWN_ROWS,
    Capture,
    RankEntry,
    Report,
    RunFacts,
    StepStats,
)
from distanom.analysis.render_json import kernel_diff_json
from distanom.analysis.text import comparisons_words, fmt, ranks_word, table, unmeasured_words
from distanom.analysis.verdict import GC_NOTE_MS
from distanom.run_periods import PERIODIC

__all__ = [
    "OUTSIDE_NOTE",
    "breakdown_numbers",
    "gc_sentence",
    "median_parts",
    "ranks_cell",
    "render_text",
]

# Under the breakdown table of CPU-only traces: what its "outside ops" column holds.
OUTSIDE_NOTE = (
    "outside ops: step window before the rank's first op or after its last "
    "(idle to the verdict; in total)"
)

# own time at or over this share of the median step, on the event clock, with steps
# short enough for the adaptive clock to take the host clock (clock.HOST_BELOW_MS; the
# report does not import the agent's torch modules): the report names that clock
CLOCK_HINT_PCT = 1.0
ADAPTIVE_BELOW_MS = 10.0
MAX_NOTE_CHARS = 160  # a phrase read back from status.json: a damaged one is cut
# anomalies whose evidence sentence the text report prints (the slowest, past this)
EVIDENCE_LINES = 20
OVER_BUDGET_FACTOR = 1.5  # effective tracing cost over budget x this gets explained


def gc_sentence(capture: Capture) -> str | None:
    """The ranks whose Python garbage collection took GC_NOTE_MS or more in the step."""
    parts = [
        f"rank {rank} {pause.ms:.2f} ms (generation {pause.generation})"
        for rank, pause in capture.python_gc.items()
        if pause.ms >= GC_NOTE_MS
    ]
    return "python garbage collection during the step: " + ", ".join(parts) if parts else None


def breakdown_numbers(entry: RankEntry, outside: bool) -> list[float | None] | None:
    """One rank's row of the breakdown table, text or HTML: the four parts, with
    `outside` the time outside its ops (None: unknown), then the total, which includes
    it. None when the rank has no tables."""
    values = entry.breakdown()
    if values is None:
        return None
    numbers: list[float | None] = [values[row] for row in BREAKDOWN_ROWS[:4]]
    total = values["total_time"]
    if outside:
        numbers.append(entry.outside_ms)
        total += entry.outside_ms or 0.0
    return [*numbers, total]


def ranks_cell(capture: Capture) -> str:
    """Ranks whose trace was read, of those expected; unreadable ones are named apart."""
    unreadable = capture.unreadable_ranks
    expected = len(capture.ranks) + len(capture.missing_ranks)
    cell = f"{len(capture.ranks) - len(unreadable)}/{expected}"
    return cell + (f" ({len(unreadable)} unreadable)" if unreadable else "")


def median_parts(steps: StepStats) -> list[str]:
    """The run's median and the detector's threshold with the median it is a multiple
    of: the detector's rolling one, not the run's (they differ), so both are named."""
    parts = [f"median {fmt(steps.median_ms)} ms over the run"]
    if steps.threshold_ms is None:
        return parts
    threshold = f"detector threshold {fmt(steps.threshold_ms)} ms"
    multiplier, rolling = steps.multiplier, steps.detector_median_ms
    if multiplier and rolling is not None:
        product = multiplier * rolling
        if abs(steps.threshold_ms - product) <= 1e-3 * max(product, 1e-9):
            threshold += f" = {multiplier} x its latest rolling median {fmt(rolling)} ms"
        else:  # the spread fence or the slowdown floor was higher (docs/evidence.md)
            threshold += (
                f", over {multiplier} x its latest rolling median {fmt(rolling)} ms"
                " (its spread fence or slowdown floor)"
            )
    elif multiplier:
        threshold += f" ({multiplier} x its rolling median)"
    return [*parts, threshold]


def _breakdown_lines(capture: Capture) -> list[str]:
    outside = capture.shows_outside
    rows = []
    kinds = set()
    for rank, entry in capture.ranks.items():
        numbers = breakdown_numbers(entry, outside)
        if numbers is None:
            continue
        kinds.add(entry.timeline_kind or "gpu")
        cells = ["-" if n is None else f"{n:.2f}" for n in numbers]
        rows.append([str(rank), entry.host or "-", *cells])
    if not rows:
        return []
    what = "GPU time" if kinds == {"gpu"} else "host time (CPU-only trace)"
    header = ["rank", "host", "compute", "exp.comm", "exp.memcpy", "idle"]
    header += ["outside ops", "total"] if outside else ["total"]
    lines = ["", f"step {capture.step} ({','.join(capture.kinds)}): {what}, ms"]
    lines += ["  " + line for line in table(header, rows)]
    return lines + ([f"  {OUTSIDE_NOTE}"] if outside else [])


def _cross_rank_lines(capture: Capture, note: str | None = None) -> list[str]:
    """The verdict line and the top kernel changes of one capture; `note`: what the
    step's evidence verdict adds (`evidence_notes`)."""
    lines = [f"  verdict: {capture.verdict.sentence()}"]
    if note is not None:
        lines.append(f"  {note}")
    culprit = capture.verdict.culprit_rank
    lines += kernel_diff_lines(kernel_diff_json(capture.kernel_diff), culprit, top=5)
    if capture.merged_trace:
        lines.append(f"  all ranks in one trace: {capture.merged_trace}")
    return lines


def _agent_cost_lines(
    cost: dict[str, Any], tracer: dict[str, Any], median_ms: float | None
) -> list[str]:
    """distanom's own time beside tracing's (rank 0), and the two together; on short
    steps timed by events, what the adaptive clock would save."""
    pct = cost.get("pct_of_median_step")
    boundary, control = cost.get("boundary_us_per_step"), cost.get("control_us_per_step")
    numbers = (int, float)
    if not (isinstance(pct, numbers) and isinstance(boundary, numbers)):
        return []
    if not isinstance(control, numbers):
        return []
    # CPU time: a launch-bound loop may pay more (GIL hand-overs, caches; docs/agent.md)
    marks = cost.get("phase_marks_us_per_step")
    within = f" + {marks:.1f} us of phase marks" if isinstance(marks, numbers) and marks else ""
    startup = cost.get("startup_ms")
    steady = isinstance(startup, numbers)  # steady steps apart from start-up (own_time)
    where = "each untraced step end" if steady else "each step end"
    line = (
        f"  distanom's own time (rank 0): {boundary:.1f} us at {where}{within} + "
        f"{control:.1f} us of its threads' CPU per step = {pct:.2f}% added to the median step"
    )
    tracing = (tracer.get("duty_cycle") or {}).get("effective_overhead_pct")
    if isinstance(tracing, numbers):
        line += f"; with tracing about {pct + tracing:.2f}% in all"
    lines = [line, *_one_off_lines(cost)] if steady else [line]
    lines += _side_process_lines(cost)
    short = isinstance(median_ms, numbers) and median_ms < ADAPTIVE_BELOW_MS
    if pct >= CLOCK_HINT_PCT and short and cost.get("clock_mode") == "cuda_event":
        # a launch-bound loop pays host time in full; a GPU-bound one hides it (README)
        lines.append(
            "  short launch-bound steps pay this in full; clock.mode: adaptive drops the "
            "CUDA event of each step, ~20-25 us on an H200 (README, Configuration: what "
            "it gives up)"
        )
    return lines


def _side_process_lines(cost: dict[str, Any]) -> list[str]:
    """Where rank 0's steps file was written, and the side process's CPU (another core's,
    not in the own-time figure)."""
    written_by = cost.get("steps_written_by")
    if not isinstance(written_by, str) or not written_by:
        return []
    line = f"  its steps file written by: {written_by[:MAX_NOTE_CHARS]}"
    cpu = _plausible(cost.get("side_process_cpu_us_per_step"))
    if cpu is not None:
        line += f"; the side process used {cpu:.1f} us of CPU a step, on another core"
        startup = _plausible(cost.get("side_process_startup_cpu_ms"))
        if startup is not None:
            line += f" ({startup:.0f} ms to start)"
    return [line]


def _plausible(value: Any, limit: float = 1e9) -> float | None:
    """A status file's figure as a float in [0, limit), None for anything else (a
    string, a bool, NaN, an integer too large for a float: the file may be hostile)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if 0.0 <= number < limit else None


def _one_off_lines(cost: dict[str, Any]) -> list[str]:
    """What the per-step figure leaves out, once: start-up, the end, tracer switches (the
    duty cycle charges those to tracing); and the step end's parts."""
    numbers = (int, float)
    parts = cost.get("boundary_parts_us")
    lines = []
    if isinstance(parts, dict) and all(isinstance(v, numbers) for v in parts.values()):
        lines.append(
            "  a step end, by part: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
        )
    wait, floor = cost.get("phase_marks_wait_us_per_step"), cost.get("record_floor_us")
    if isinstance(wait, numbers) and wait >= 0.05 and isinstance(floor, numbers):
        # inside the marks' figure (own_time): how much of it was waiting
        lines.append(
            f"  of the phase marks' time, {wait:.1f} us a step was their CUDA event records "
            f"beyond their median {floor:.1f} us (waits for a full launch queue or the "
            "GIL, and jitter)"
        )
    once = f"  once, not per step: start-up {cost['startup_ms']:.1f} ms"
    teardown = cost.get("teardown_ms")
    if isinstance(teardown, numbers):
        once += f", the end {teardown:.1f} ms"
    switches, switch_ms = cost.get("tracer_switches"), cost.get("tracer_switch_ms")
    if isinstance(switches, int) and switches and isinstance(switch_ms, numbers):
        once += f"; {switches} tracer switch(es) at step ends, {switch_ms:.1f} ms (tracing's cost)"
    return [*lines, once]


def _overhead_lines(tracer: dict[str, Any]) -> list[str]:
    """The run's own measure of what tracing cost (traced vs untraced windows)."""
    duty = tracer.get("duty_cycle") or {}
    overhead = duty.get("measured_overhead_pct")
    fraction = duty.get("traced_fraction")
    if not isinstance(fraction, (int, float)):
        return []
    if "backend" in tracer and tracer["backend"] is None:
        return []  # no tracer ever started (a run that failed first): nothing was traced
    budget = duty.get("budget_pct")
    if isinstance(overhead, (int, float)):
        measured = f"measured overhead {overhead:.1f}% of step time while tracing"
        measured += comparisons_words(duty.get("overhead_comparisons"))
    else:
        measured = unmeasured_words(duty)
    line = f"  tracing: {measured}, {100 * fraction:.1f}% of steps traced"
    effective = duty.get("effective_overhead_pct")
    if isinstance(effective, (int, float)):
        line += f": {effective:.2f}% added to the run's time"
    if isinstance(budget, (int, float)):
        line += f" (budget {budget:g}%)"
    lines = [line, *_over_budget_lines(duty)]
    for direction, count_key, excess_key, all_key in (
        ("on", "switches_on", "switch_on_excess_ms", "tracing_starts"),
        ("off", "switches_off", "switch_excess_ms", "tracing_stops"),
    ):
        switch_ms, switches = duty.get(excess_key), duty.get(count_key)
        if isinstance(switch_ms, (int, float)) and isinstance(switches, int) and switches:
            every = duty.get(all_key)
            # the duty cycle's switches are costed; planned and requested ones are charged
            head = f"  tracing switched {direction} {switches} time(s)"
            if isinstance(every, int) and every > switches:
                head = (
                    f"  tracing switched {direction} {every} time(s), {switches} by the duty "
                    "cycle (the others for planned or requested captures)"
                )
            lines.append(
                f"{head}; the step after a duty-cycle switch ran {switch_ms:.1f} ms longer "
                "(median of the recent ones), counted in the overhead"
            )
    return lines


def _over_budget_lines(duty: dict[str, Any]) -> list[str]:
    """Why tracing cost the run more than OVER_BUDGET_FACTOR x its budget: what the
    governor cannot hold back (its always-traced floor, the window that measures the
    cost, captures traced whatever the budget; docs/budget.md)."""
    numbers = (int, float)
    keys = ("budget_pct", "effective_overhead_pct", "measured_overhead_pct", "steps_recorded")
    values = [duty.get(key) for key in keys]
    if not all(isinstance(v, numbers) for v in values):
        return []
    budget, effective, overhead, steps = (float(v) for v in values)  # type: ignore[arg-type]
    if budget <= 0 or steps <= 0 or effective <= OVER_BUDGET_FACTOR * budget:
        return []
    head = f"  over budget: tracing costs {overhead:.0f}% of a traced step, so"
    floor = duty.get("min_fraction")
    if isinstance(floor, numbers) and floor * overhead > budget:
        return [
            f"{head} even the {floor:.2%} of windows always traced (to keep measuring it) "
            "costs more than the budget"
        ]
    window = duty.get("window_steps")
    start = window * overhead / steps if isinstance(window, int) else None
    return [
        f"{head} the window traced at the start to measure that"
        + (f" ({start:.2f}% of this run)" if start is not None else "")
        + " and captures traced whatever the budget (requests, stragglers) are paid before"
        f" tracing less can make up for them; {steps:.0f} steps were too few, a longer run"
        " comes back to the budget"
    ]


def _node_lines(facts: RunFacts) -> list[str]:
    """The nodes of a run on several (and the copies read), nothing on one."""
    if not facts.several_nodes:
        return []
    nodes = [
        f"node {node}"
        + (f" ({facts.node_hosts[node]})" if node in facts.node_hosts else "")
        + f" {ranks_word(ranks)}"
        for node, ranks in facts.node_ranks().items()
    ]
    lines = ["  nodes: " + "; ".join(nodes)]
    if facts.copies:
        lines.append(f"  read from {len(facts.copies)} copies: " + ", ".join(facts.copies))
    return lines


def _culprit_cell(facts: RunFacts, rank: int | None) -> str:
    """A culprit rank as a table shows it, with its node on a run of several nodes."""
    if rank is None:
        return "-"
    node = facts.node_of.get(rank)
    return f"{rank} (node {node})" if facts.several_nodes and node is not None else str(rank)


def _run_lines(report: Report) -> list[str]:
    """The header: the run, its steps, tracing cost, detector and capture counters."""
    facts, steps = report.facts, report.steps
    hosts = facts.hosts
    lines = [
        f"run {facts.run_id}  ({facts.run_dir})",
        f"  world size {facts.world_size}"
        + (f" on {len(set(hosts))} host(s): {', '.join(sorted(set(hosts)))}" if hosts else "")
        + f"   state: {facts.state}",
        f"  steps: {steps.count}   " + "   ".join(median_parts(steps)),
    ]
    lines[2:2] = _node_lines(facts)
    if steps.optimizer_skipped:
        lines.append(
            f"  optimizer step skipped (inf/nan gradients) in {steps.optimizer_skipped} steps"
        )
    tracer = report.tracer
    if tracer.get("note"):
        lines.append(f"  {tracer['note']}")
    lines += _overhead_lines(tracer)
    lines += _agent_cost_lines(report.agent_cost, tracer, steps.median_ms)
    detector = report.detector
    if detector:
        lines.append(
            f"  detector: {detector.get('judged', 0)} steps judged, "
            f"{detector.get('anomalous', 0)} anomalous in {len(report.episodes)} "
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
            + (
                f"; {detector['disturbed']} held distanom's own work (captures, heavy "
                "rounds), judged without it"
                if detector.get("disturbed")
                else ""
            )
        )
    cost = report.capture_cost
    if cost:
        parts = ", ".join(
            f"{p.removesuffix('_ms')} {v:.1f}" for p, v in cost.parts_median_ms.items()
        )
        lines.append(
            f"  capture work: {cost.median_ms:.1f} ms per rank and capture (median of "
            f"{cost.files} files; {parts}; max {cost.max_ms:.1f}), on each rank's "
            "capture thread"
        )
    state = report.capture_state
    if state.skipped_disk:
        lines.append(
            f"  disk budget (capture.max_disk_mb) reached: {state.skipped_disk} capture(s) "
            "counted but not written on rank 0"
        )
    if state.missed:
        lines.append(
            f"  {state.missed} capture(s) decided after the tracer had dropped the step "
            "(raise tracer.history_steps)"
        )
    for reason in (state.capture_off, state.consensus_error):
        if reason:
            lines.append(f"  capture stepped aside: {reason}")
    return lines


def _capture_lines(
    captures: list[Capture], anomalies: Sequence[Anomaly] = (), facts: RunFacts | None = None
) -> list[str]:
    """The captures table, then each capture's breakdown, collections and verdict (and
    the culprit's node, on a run of several nodes)."""
    notes = evidence_notes(anomalies)
    if not captures:
        return ["no captures"]
    rows = []
    for capture in captures:
        first = next(iter(capture.ranks.values())).trace if capture.ranks else "-"
        rows.append(
            [
                str(capture.step),
                ",".join(capture.kinds) + (" (opt. skipped)" if capture.optimizer_skipped else ""),
                fmt(capture.step_ms),
                fmt(capture.ratio, 2),
                ranks_cell(capture),
                first,
            ]
        )
    lines = [f"captures ({len(captures)}):"]
    header = ["step", "kind", "step ms", "x rolling median", "ranks", "trace"]
    lines += ["  " + line for line in table(header, rows)]
    for capture in captures:
        lines += _breakdown_lines(capture)
        sentence = gc_sentence(capture)
        lines += [f"  {sentence}"] if sentence else []
        lines += _cross_rank_lines(capture, notes.get(capture.step))
        culprit = capture.verdict.culprit_rank
        if facts is not None and facts.several_nodes and culprit is not None:
            lines += (
                [f"  rank {culprit} ran on {facts.where(culprit)}"]
                if culprit in facts.node_of
                else []
            )
    for capture in captures:
        if capture.missing_ranks:
            missing = ",".join(str(r) for r in capture.missing_ranks)
            lines.append(f"  step {capture.step}: no trace from rank(s) {missing}")
        if capture.unreadable_ranks:
            unreadable = ",".join(str(r) for r in capture.unreadable_ranks)
            lines.append(
                f"  step {capture.step}: unreadable trace from rank(s) {unreadable} (see problems)"
            )
    return lines


def straggler_lines(report: Report) -> list[str]:
    """One line per straggler (most severe first), per earlier straggler that kept up
    later, and one for drift, if any."""
    lines = []
    for entry in report.stragglers:
        evidence = entry.get("evidence") or {}
        lines.append(
            f"rank {entry.get('rank')}: the typical rank waited for it "
            f"{fmt(entry.get('score'), 2)} of its step time since step "
            f"{entry.get('since_step')} (late at "
            f"{evidence.get('late_steps')} of the last {evidence.get('window_steps')} steps, "
            f"{fmt(evidence.get('mean_late_ms'))} ms each; run score "
            f"{fmt(evidence.get('run_score'), 2)}){_phase_words(entry)}"
        )
    for entry in report.earlier_stragglers:
        lines.append(
            f"rank {entry.get('rank')}: a straggler from step {entry.get('since_step')} to "
            f"step {entry.get('until_step')}, then it kept up (at most "
            f"{fmt(entry.get('peak_score'), 2)} of the step time waited for it)"
            f"{_phase_words(entry)}"
        )
    drift = report.drift
    if drift:
        lines.append(
            f"drift: the median step went from {fmt(drift.get('first_ms'))} ms to "
            f"{fmt(drift.get('last_ms'))} ms ({fmt(drift.get('ratio'), 2)}x) over the run"
        )
    return lines or ["no straggler and no drift"]


def _phase_words(entry: dict[str, Any]) -> str:
    """`; slow in its data phase` for a straggler whose phase is known."""
    phase = entry.get("phase")
    return f"; slow in its {phase} phase" if isinstance(phase, str) else ""


def _evidence_lines(anomalies: Sequence[Anomaly]) -> list[str]:
    """Each anomaly's evidence sentence; past `EVIDENCE_LINES` anomalies, those of the
    slowest (by ratio to the median), in step order, and a line saying so: a run's worst
    step must not be cut for its first few jitters."""
    shown = list(anomalies)
    if len(shown) > EVIDENCE_LINES:
        worst = sorted(shown, key=lambda a: -a.ratio if math.isfinite(a.ratio) else math.inf)
        shown = sorted(worst[:EVIDENCE_LINES], key=lambda a: a.step)
    lines = [f"  step {a.step}: {a.verdict.evidence}" for a in shown]
    if len(shown) < len(anomalies):
        lines.append(
            f"  (evidence of the {len(shown)} slowest of {len(anomalies)} shown; all in --json)"
        )
    return lines


def _anomaly_lines(report: Report) -> list[str]:
    """Every judged anomalous step with its verdict, then the stragglers."""
    anomalies = report.anomalies
    lines = [f"anomalies ({len(anomalies)}):"]
    if anomalies:
        rows = [
            [
                str(a.step),
                fmt(a.step_ms),
                fmt(a.ratio, 2),
                "yes" if a.traced else "no",
                a.judged_by,
                _culprit_cell(report.facts, a.verdict.culprit_rank),
                a.verdict.cause,
                a.verdict.phase or "-",
            ]
            for a in anomalies[:200]
        ]
        header = [
            "step", "step ms", "x median", "traced", "judged by", "culprit", "cause", "phase"
        ]  # fmt: skip
        lines += _class_lines(report)
        lines += ["  " + line for line in table(header, rows)]
        if len(anomalies) > 200:
            lines.append(f"  ... {len(anomalies) - 200} more (see --json)")
        lines += _evidence_lines(anomalies)
    lines.append("stragglers:")
    lines += ["  " + line for line in straggler_lines(report)]
    return lines


RECURRENCE_LINES = 3  # periods named in the text; --json has them all


def _class_lines(report: Report) -> list[str]:
    """Per anomaly class, its episodes detected, traced and explained."""
    found = recurring(report.anomalies, report.detect_config)
    counts = anomaly_classes(report.anomalies, report.detect_config, found)
    lines = ["  by class (episodes):"]
    for c in counts:
        if c.detected:
            lines.append(
                f"    {c.label}: {c.detected} detected, {c.traced} traced, {c.explained} explained"
            )
        if c.name == PERIODIC and c.detected:
            # the best-supported first; a cadence detected only now and then can show as
            # several multiples of its period
            best = sorted(found, key=lambda r: -len(r.starts))
            lines += [f"      {recurrence_line(r)}" for r in best[:RECURRENCE_LINES]]
            if len(best) > RECURRENCE_LINES:
                lines.append(f"      and {len(best) - RECURRENCE_LINES} more (--json)")
    return lines


def render_text(report: Report) -> str:
    """The report for people: run facts, captures with their tables and verdicts, problems."""
    lines = [*_run_lines(report), ""]
    if report.lost_time is not None and report.anomalies:
        lines[1:1] = [report.lost_time.line()]  # first, under the run's name
    if report.has_slowness:
        lines += [*_anomaly_lines(report), ""]
    lines += _capture_lines(report.captures, report.anomalies, report.facts)
    for hang in report.hangs:
        lines += ["", *hang_lines(hang)]
    problems = report.problems
    if problems:
        lines.append("")
        lines.append(f"problems ({len(problems)}):")
        lines += [f"  {problem}" for problem in problems[:50]]
        if len(problems) > 50:
            lines.append(f"  ... {len(problems) - 50} more")
    return "\n".join(lines) + "\n"
