"""`distanom report RUN_DIR --html OUT.html`: the run report as one self-contained page.

Owns: the HTML page (inline CSS, no script, no external resource) and its charts: the
run's step-time timeline (slowest rank's time per step, the detector's rolling
threshold, captures marked) and, per capture, one stacked bar per rank (computation /
exposed comm / exposed memcpy / idle) beside the verdict sentence and the top kernel
changes. Charts are PNGs drawn with matplotlib when it is importable (the `plots`
extra), embedded as base64 and also handed back so the CLI writes them beside the
page; without matplotlib they are inline SVG drawn here.

Reads: the report's model (`distanom.analysis.model.Report`, built with
`step_times=True` for the step chart's threshold line). Every string that comes from the run
directory (hosts, kernel names, paths, evidence) is escaped: traces are untrusted input.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distanom.analysis.anomalies import evidence_notes
from distanom.analysis.anomaly_classes import anomaly_classes, recurrence_line, recurring
from distanom.analysis.charts import (
    OUTSIDE,
    PART_COLORS,
    PART_LABELS,
    PARTS,
    bars_png,
    bars_svg,
    matplotlib_figure,
    rank_bars,
    step_chart,
    steps_png,
    steps_svg,
)
from distanom.analysis.hangs import hang_lines
from distanom.analysis.kernel_diff import top_changes
from distanom.analysis.model import Capture, Report
from distanom.analysis.render_json import kernel_diff_json
from distanom.analysis.render_text import (
    OUTSIDE_NOTE,
    breakdown_numbers,
    gc_sentence,
    median_parts,
    ranks_cell,
    straggler_lines,
)
from distanom.analysis.report_order import by_severity, is_culprit, trimmed
from distanom.rundir import write_bytes_atomic

__all__ = ["HtmlPage", "render_html", "write_html"]

TOP_KERNELS = 8
# op changes under this share of the step are left out of the table (counted in a note)
MIN_CHANGE_SHARE = 0.01
# when every change is under that share, the largest this many are shown all the same
SMALL_TOP_KERNELS = 5

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;
color:#222;max-width:1200px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}
.facts{color:#555}.verdict{background:#f6f6f0;border-left:4px solid #c0392b;padding:8px 12px}
.verdict.none{border-left-color:#888}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.kernel{font-family:ui-monospace,Menlo,Consolas,monospace;word-break:break-all}
.legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:middle}
img,svg{max-width:100%;height:auto}
.problems{color:#8a4b00}
tr.culprit td{background:#fdecea;font-weight:600}
.tag{background:#c0392b;color:#fff;border-radius:3px;padding:0 5px;font-size:11px;margin-left:6px}
"""


@dataclass(frozen=True)
class HtmlPage:
    """The page's HTML and the PNG charts to write beside it."""

    html: str
    pngs: dict[str, bytes] = field(default_factory=dict)
    """Chart name ("steps", "step_40") → PNG bytes; empty when drawn as SVG."""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, bool) or value is None:
        return "-"
    if isinstance(value, (int, float)) and math.isfinite(value):
        return f"{value:.{digits}f}"
    return _e(value)


# --------------------------------------------------------------------------- page


def _figure(name: str, alt: str, png: bytes | None, svg: str) -> str:
    if png is not None:
        data = base64.b64encode(png).decode("ascii")
        return f'<img alt="{_e(alt)}" data-chart="{_e(name)}" src="data:image/png;base64,{data}">'
    return f'<div class="chart" data-chart="{_e(name)}">{svg}</div>'


def _legend(parts: Sequence[str]) -> str:
    items = "".join(
        f'<span style="background:{PART_COLORS[p]}"></span>{PART_LABELS[p]}' for p in parts
    )
    return f'<p class="legend">{items}</p>'


def _breakdown_table(capture: Capture) -> str:
    """The text report's table: with the time outside the ops (in the total) when known."""
    outside = capture.shows_outside
    columns = len(PARTS) + 1 + outside
    rows = []
    for rank, entry in capture.ranks.items():
        numbers = breakdown_numbers(entry, outside) or [None] * columns
        cells = "".join(f'<td class="num">{_fmt(v)}</td>' for v in numbers)
        mark, tag = _culprit_mark(capture, rank)
        rows.append(
            f"<tr{mark}><td>rank {_e(rank)}{tag}</td><td>{_e(entry.host or '-')}</td>{cells}</tr>"
        )
    names = ["rank", "host", *(PART_LABELS[p] for p in PARTS)]
    names += [PART_LABELS[OUTSIDE], "total"] if outside else ["total"]
    head = "".join(f"<th>{h}</th>" for h in names)
    table = f"<table><tr>{head}</tr>{''.join(rows)}</table>"
    return table + (f'<p class="facts">{_e(OUTSIDE_NOTE)}</p>' if outside else "")


def _culprit_mark(capture: Capture, rank: int) -> tuple[str, str]:
    """The row attribute and the tag that mark the capture's culprit rank(s)."""
    if is_culprit(capture, rank):
        return ' class="culprit"', '<span class="tag">culprit</span>'
    return "", ""


def _kernel_table(capture: Capture) -> str:
    diff = kernel_diff_json(capture.kernel_diff)
    if diff.get("reference_step") is None:
        note = diff.get("note")
        return f"<p>Kernel diff: {_e(note)}</p>" if note else ""
    rank, changes = top_changes(diff, capture.verdict.culprit_rank)
    if rank is None:
        return ""
    entry = diff["ranks"][rank]
    what = "Kernels" if entry.get("kind") == "gpu" else "CPU ops"
    idle = entry.get("idle_change_ms")
    title = (
        f"<p>{what} of rank {_e(rank)} against reference step {_e(diff['reference_step'])}"
        + (f", idle {idle:+.1f} ms change" if isinstance(idle, (int, float)) else "")
        + ":</p>"
    )
    if not changes:
        return title + "<p>nothing grew</p>"
    every = changes
    changes, left_out, left_us = trimmed(every, capture.step_ms, TOP_KERNELS, MIN_CHANGE_SHARE)
    why = f"each under {MIN_CHANGE_SHARE:.0%} of the step or past the top {TOP_KERNELS}"
    if not changes:  # all small beside the step: the largest few, as the text report lists
        changes, left_out, left_us = trimmed(every, None, SMALL_TOP_KERNELS, 0.0)
        why = f"past the top {SMALL_TOP_KERNELS}"
    note = ""
    if left_out:
        note = (
            f'<p class="facts">{left_out} smaller change(s), {_fmt(left_us / 1000)} ms in all, '
            f"not shown ({why})</p>"
        )
    if not changes:
        return title + note
    rows = []
    for change in changes:
        shape = ""
        if change.get("grid") or change.get("block"):
            shape = f"grid {change.get('grid')} block {change.get('block')}"
        rows.append(
            f'<tr><td class="num">{_fmt(change.get("added_us"), 1)}</td>'
            f"<td>{_e(change.get('status'))}</td>"
            f'<td class="num">{_e(change.get("ref_count"))} → {_e(change.get("count"))}</td>'
            f'<td class="kernel">{_e(change.get("name"))}</td><td>{_e(shape)}</td></tr>'
        )
    head = "<tr><th>added µs</th><th>status</th><th>count</th><th>name</th><th>launch</th></tr>"
    return title + f"<table>{head}{''.join(rows)}</table>" + note


def render_html(report: Report, *, use_matplotlib: bool = True) -> HtmlPage:
    """The page for a report; PNG charts when matplotlib is importable (and allowed).
    The step chart needs the report built with `step_times=True`."""
    figure_class = matplotlib_figure() if use_matplotlib else None
    pngs: dict[str, bytes] = {}
    facts = report.facts
    hosts = sorted(set(facts.hosts))
    body = [
        f"<h1>distanom run {_e(facts.run_id)}</h1>",
        f'<p class="facts">{_e(facts.run_dir)}<br>world size {_e(facts.world_size)}'
        + (f" on {len(hosts)} host(s): {_e(', '.join(hosts))}" if hosts else "")
        + f" · state {_e(facts.state)} · {_e(report.steps.count)} steps · "
        + " · ".join(_e(part) for part in median_parts(report.steps))
        + "</p>",
        *(
            [f'<p class="lost">{_e(report.lost_time.line())}</p>']
            if report.lost_time is not None and report.anomalies
            else []
        ),
        "<h2>Step time</h2>",
    ]
    chart = step_chart(report, report.step_times) if report.step_times else None
    if chart is None:
        body.append("<p>no step times recorded</p>")
    else:
        png = steps_png(figure_class, chart) if figure_class else None
        if png is not None:
            pngs["steps"] = png
        body.append(_figure("steps", "step time per step", png, "" if png else steps_svg(chart)))
    captures = report.captures
    body.append(f"<h2>Captures ({len(captures)})</h2>")
    if captures:
        rows = "".join(
            f'<tr><td><a href="#step-{_e(c.step)}">{_e(c.step)}</a></td>'
            f"<td>{_e(','.join(c.kinds))}</td>"
            f'<td class="num">{_fmt(c.step_ms, 1)}</td>'
            f'<td class="num">{_fmt(c.ratio)}</td>'
            f"<td>{_e(ranks_cell(c))}</td>"
            f"<td>{_culprit_cell(c)}{_e(c.verdict.sentence())}</td></tr>"
            for c in by_severity(captures)
        )
        body.append(
            '<p class="facts">Most severe first (x rolling median, anomalies before other '
            "kinds); the sections below follow the steps in order. Terms: docs/glossary.md.</p>"
            "<table><tr><th>step</th><th>kind</th><th>step ms</th><th>x rolling median</th>"
            f"<th>ranks</th><th>verdict</th></tr>{rows}</table>"
        )
    if report.has_slowness:
        body += _slowness_sections(report)
    notes = evidence_notes(report.anomalies)
    for capture in captures:
        body += _capture_section(capture, figure_class, pngs, notes.get(capture.step))
    if report.hangs:
        body.append(f"<h2>Hangs ({len(report.hangs)})</h2>")
        body += ["<pre>" + _e("\n".join(hang_lines(hang))) + "</pre>" for hang in report.hangs]
    problems = report.problems
    if problems:
        items = "".join(f"<li>{_e(p)}</li>" for p in problems[:200])
        body.append(f'<h2>Problems ({len(problems)})</h2><ul class="problems">{items}</ul>')
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>distanom {_e(facts.run_id)}</title><style>{_CSS}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )
    return HtmlPage(page, pngs)


def _culprit_cell(capture: Capture) -> str:
    rank = capture.verdict.culprit_rank
    return "" if rank is None else f'<span class="tag">rank {_e(rank)}</span> '


def _merged_link(capture: Capture) -> str:
    """A link to the merged trace, and how to open it (Perfetto loads local files); a
    link only to a file inside the run, never through a planted link."""
    merged = capture.merged
    if merged is None:
        return ""
    path = Path(merged.path)
    run = path.parents[len(Path(merged.relative).parts) - 1]
    if path.is_symlink() or not path.resolve().is_relative_to(run.resolve()):
        return f"<p>All ranks in one trace: {_e(merged.relative)} (not a file of the run).</p>"
    uri = path.resolve().as_uri()
    return (
        f'<p>All ranks in one trace: <a href="{_e(uri)}">{_e(merged.relative)}</a>. '
        "Open it in Perfetto (https://ui.perfetto.dev, <i>Open trace file</i>; the "
        "file never leaves the browser) or chrome://tracing; a link cannot open it there "
        "directly.</p>"
    )


def _slowness_sections(report: Report) -> list[str]:
    """The anomalies table (every judged step, traced or not) and the stragglers."""
    body = [f"<h2>Anomalies ({len(report.anomalies)})</h2>"]
    if report.anomalies:
        body.append(_class_table(report))
        rows = "".join(
            f"<tr><td>{_e(a.step)}</td>"
            f'<td class="num">{_fmt(a.step_ms, 1)}</td><td class="num">{_fmt(a.ratio)}</td>'
            f"<td>{_e('yes' if a.traced else 'no')}</td><td>{_e(a.judged_by)}</td>"
            f"<td>{_fmt(a.verdict.culprit_rank, 0)}</td><td>{_e(a.verdict.cause)}</td>"
            f"<td>{_e(a.verdict.phase or '-')}</td><td>{_e(a.verdict.evidence)}</td></tr>"
            for a in report.anomalies[:500]
        )
        body.append(
            "<table><tr><th>step</th><th>step ms</th><th>x median</th><th>traced</th>"
            "<th>judged by</th><th>culprit</th><th>cause</th><th>phase</th><th>evidence</th></tr>"
            f"{rows}</table>"
        )
    earlier = len(report.earlier_stragglers)
    count = f"{len(report.stragglers)}" + (f", {earlier} earlier" if earlier else "")
    body.append(f"<h2>Stragglers ({count})</h2>")
    for line in straggler_lines(report):
        body.append(f"<p>{_e(line)}</p>")
    return body


def _class_table(report: Report) -> str:
    """Per anomaly class, its episodes detected, traced and explained; the periods."""
    found = recurring(report.anomalies, report.detect_config)
    rows = "".join(
        f'<tr><td>{_e(c.label)}</td><td class="num">{c.detected}</td>'
        f'<td class="num">{c.traced}</td><td class="num">{c.explained}</td>'
        f'<td class="num">{c.steps}</td></tr>'
        for c in anomaly_classes(report.anomalies, report.detect_config, found)
    )
    periods = "".join(f"<p>Recurring: {_e(recurrence_line(r))}</p>" for r in found)
    return (
        "<table><tr><th>class (episodes)</th><th>detected</th><th>traced</th>"
        f"<th>explained</th><th>steps</th></tr>{rows}</table>{periods}"
    )


def _capture_section(
    capture: Capture,
    figure_class: Any,
    pngs: dict[str, bytes],
    note: str | None = None,
) -> list[str]:
    """One capture's heading, verdict, collections, bars, tables and notes; `note`:
    what the step's evidence verdict adds (`evidence_notes`)."""
    step = capture.step
    body = [f'<h2 id="step-{_e(step)}">Step {_e(step)} ({_e(", ".join(capture.kinds))})</h2>']
    css = "verdict" if capture.verdict.culprit_rank is not None else "verdict none"
    body.append(f'<p class="{css}">Verdict: {_e(capture.verdict.sentence())}</p>')
    if note is not None:
        body.append(f'<p class="facts">{_e(note[0].upper() + note[1:])}</p>')
    collections = gc_sentence(capture)
    if collections:
        body.append(f'<p class="facts">{_e(collections[0].upper() + collections[1:])}</p>')
    bars = rank_bars(capture)
    if bars is not None:
        png = bars_png(figure_class, bars) if figure_class else None
        if png is not None:
            pngs[f"step_{step}"] = png
        body.append(_legend(bars.parts))
        alt = f"time breakdown per rank, step {step}"
        body.append(_figure(f"step_{step}", alt, png, "" if png else bars_svg(bars)))
    body.append(_breakdown_table(capture))
    body.append(_kernel_table(capture))
    if capture.merged_trace:
        body.append(_merged_link(capture))
    if capture.missing_ranks:
        body.append(
            f"<p>No trace from rank(s) {_e(', '.join(map(str, capture.missing_ranks)))}</p>"
        )
    if capture.unreadable_ranks:
        unreadable = ", ".join(map(str, capture.unreadable_ranks))
        body.append(f"<p>Unreadable trace from rank(s) {_e(unreadable)} (see problems)</p>")
    return body


def write_html(page: HtmlPage, out: Path) -> list[Path]:
    """Write the page and its PNGs beside it (`<stem>_<chart>.png`); the paths written."""
    written = []
    write_bytes_atomic(out, page.html.encode("utf-8"))
    written.append(out)
    for name, png in page.pngs.items():
        path = out.with_name(f"{out.stem}_{name}.png")
        write_bytes_atomic(path, png)
        written.append(path)
    return written
