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
import io
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distanom.analysis.kernel_diff import top_changes
from distanom.analysis.model import BREAKDOWN_ROWS, Capture, Report, StepTimes
from distanom.analysis.render_json import kernel_diff_json
from distanom.analysis.render_text import (
    OUTSIDE_NOTE,
    breakdown_numbers,
    gc_sentence,
    median_parts,
    ranks_cell,
    straggler_lines,
)
from distanom.rundir import write_bytes_atomic

__all__ = ["HtmlPage", "render_html", "write_html"]

PARTS = BREAKDOWN_ROWS[:4]
# CPU-only traces: the step window outside the ops' span, which the verdict counts as idle
OUTSIDE = "outside_ops"
PART_LABELS = {
    "computation_time": "computation",
    "exposed_comm_time": "exposed comm",
    "exposed_memcpy_time": "exposed memcpy",
    "idle_time": "idle",
    OUTSIDE: "outside ops",
}
PART_COLORS = {
    "computation_time": "#4c72b0",
    "exposed_comm_time": "#dd8452",
    "exposed_memcpy_time": "#8172b3",
    "idle_time": "#b0b0b0",
    OUTSIDE: "#dcdcdc",
}
KIND_COLORS = {"anomaly": "#c0392b", "reference": "#27ae60", "requested": "#2e86c1"}
TOP_KERNELS = 8

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


# --------------------------------------------------------------------------- charts


def _matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def _steps_png(figure_class: Any, chart: _StepChart) -> bytes:
    figure = figure_class(figsize=(11, 3.6))
    ax = figure.add_subplot(1, 1, 1)
    ax.plot(
        chart.steps, chart.values, color="#34495e", linewidth=1, label="step time (slowest rank)"
    )
    ax.plot(
        chart.steps,
        chart.threshold,
        color="#c0392b",
        linestyle="--",
        linewidth=1,
        label="threshold",
    )
    for kind, color in KIND_COLORS.items():
        marks = [(s, v) for s, v, k in chart.marks if k == kind]
        if marks:
            ax.scatter(
                [s for s, _ in marks],
                [v for _, v in marks],
                color=color,
                zorder=3,
                label=f"{kind} capture",
            )
    if chart.log:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    return _png(figure)


def _bars_png(figure_class: Any, bars: _Bars) -> bytes:
    figure = figure_class(figsize=(11, 0.45 * len(bars.labels) + 1.2))
    ax = figure.add_subplot(1, 1, 1)
    positions = list(range(len(bars.labels)))
    left = [0.0] * len(bars.labels)
    for part in bars.parts:
        widths = [values[part] for values in bars.values]
        ax.barh(positions, widths, left=left, color=PART_COLORS[part], label=PART_LABELS[part])
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_yticks(positions)
    ax.set_yticklabels(bars.labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(bars.title, fontsize=10, pad=22)
    ax.legend(
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        fontsize=8,
        ncol=len(bars.parts),
        frameon=False,
    )
    ax.grid(axis="x", alpha=0.3)
    return _png(figure)


@dataclass(frozen=True)
class _StepChart:
    steps: list[int]
    values: list[float]
    threshold: list[float]
    marks: list[tuple[int, float, str]]
    log: bool


@dataclass(frozen=True)
class _Bars:
    title: str
    labels: list[str]
    values: list[dict[str, float]]
    parts: tuple[str, ...] = PARTS


def _step_chart(report: Report, times: StepTimes) -> _StepChart | None:
    values = times.step_ms
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    position = {step: i for i, step in enumerate(times.steps)}
    marks = []
    for capture in report.captures:
        index = position.get(capture.step)
        value = values[index] if index is not None else capture.step_ms
        if isinstance(value, (int, float)) and math.isfinite(value):
            kinds = capture.kinds or ["anomaly"]
            kind = "anomaly" if "anomaly" in kinds else str(kinds[0])
            marks.append((capture.step, float(value), kind))
    median = statistics.median(finite)
    log = median > 0 and max(finite) / median > 20
    return _StepChart(list(times.steps), values, list(times.threshold_ms), marks, log)


def _bars(capture: Capture) -> _Bars | None:
    labels, values = [], []
    for rank, entry in capture.ranks.items():
        rows = entry.breakdown()
        if rows is None:
            continue
        host = entry.host
        labels.append(f"rank {rank}" + (f" ({host})" if host else ""))
        bar = {part: max(0.0, rows[part]) for part in PARTS}
        bar[OUTSIDE] = entry.outside_ms or 0.0
        values.append(bar)
    title = f"step {capture.step}: time per rank"
    parts = (*PARTS, OUTSIDE) if capture.shows_outside else PARTS
    return _Bars(title, labels, values, parts) if labels else None


# ---- SVG (no matplotlib)

_W, _H, _PAD_L, _PAD_B, _PAD_T, _PAD_R = 1000.0, 300.0, 60.0, 36.0, 30.0, 16.0


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def _log_ticks(low: float, high: float) -> list[float]:
    """1, 2, 5 x powers of ten between 10**low and 10**high."""
    values = [m * 10.0**e for e in range(math.floor(low), math.ceil(high) + 1) for m in (1, 2, 5)]
    return [v for v in values if 10**low <= v <= 10**high]


def _svg_legend(items: Sequence[tuple[str, str]]) -> str:
    """A row of (swatch markup at 0,0, label) entries along the chart's top edge."""
    parts, x = [], _PAD_L + 10
    for swatch, label in items:
        parts.append(
            f'<g transform="translate({x:.0f},14)">{swatch}'
            f'<text x="22" y="4" font-size="11">{_e(label)}</text></g>'
        )
        x += 40 + 7 * len(label)
    return "".join(parts)


def _steps_svg(chart: _StepChart) -> str:
    finite = [v for v in chart.values + chart.threshold if math.isfinite(v)]
    x0, x1 = min(chart.steps), max(max(chart.steps), min(chart.steps) + 1)
    if chart.log:
        low, high = math.log10(max(min(finite), 1e-6)), math.log10(max(finite))
    else:
        low, high = 0.0, max(finite)
    high = high if high > low else low + 1

    def x(step: float) -> float:
        return _PAD_L + (step - x0) / (x1 - x0) * (_W - _PAD_L - _PAD_R)

    def y(value: float) -> float:
        v = math.log10(max(value, 1e-6)) if chart.log else value
        return _H - _PAD_B - (v - low) / (high - low) * (_H - _PAD_B - _PAD_T)

    def line(values: Sequence[float], style: str) -> str:
        points = " ".join(
            f"{x(s):.1f},{y(v):.1f}"
            for s, v in zip(chart.steps, values, strict=True)
            if math.isfinite(v)
        )
        return f'<polyline fill="none" {style} points="{points}"/>'

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W:.0f} {_H:.0f}" role="img" '
        'aria-label="step time per step">',
        f'<rect x="0" y="0" width="{_W:.0f}" height="{_H:.0f}" fill="#fff"/>',
    ]
    ticks = _log_ticks(low, high) if chart.log else _ticks(low, high)
    for tick in ticks:
        parts.append(
            f'<line x1="{_PAD_L}" x2="{_W - _PAD_R}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" '
            'stroke="#eee"/>'
            f'<text x="{_PAD_L - 6}" y="{y(tick) + 4:.1f}" font-size="11" text-anchor="end">'
            f"{tick:g}</text>"
        )
    for tick in _ticks(x0, x1):
        parts.append(
            f'<text x="{x(tick):.1f}" y="{_H - _PAD_B + 16}" font-size="11" '
            f'text-anchor="middle">{tick:g}</text>'
        )
    parts.append(
        f'<text x="{_W / 2}" y="{_H - 4}" font-size="12" text-anchor="middle">step</text>'
        f'<text x="14" y="{_H / 2}" font-size="12" transform="rotate(-90 14 {_H / 2})">ms</text>'
    )
    parts.append(line(chart.values, 'stroke="#34495e" stroke-width="1"'))
    parts.append(line(chart.threshold, 'stroke="#c0392b" stroke-width="1" stroke-dasharray="5,4"'))
    legend = [
        ('<line x1="0" x2="18" stroke="#34495e"/>', "step time (slowest rank)"),
        ('<line x1="0" x2="18" stroke="#c0392b" stroke-dasharray="5,4"/>', "threshold"),
    ]
    legend += [
        (f'<circle cx="9" cy="0" r="4" fill="{color}"/>', f"{kind} capture")
        for kind, color in KIND_COLORS.items()
        if any(k == kind for _, _, k in chart.marks)
    ]
    parts.append(_svg_legend(legend))
    for step, value, kind in chart.marks:
        parts.append(
            f'<circle cx="{x(step):.1f}" cy="{y(value):.1f}" r="4" '
            f'fill="{KIND_COLORS.get(kind, "#555")}"><title>step {step}: {value:.1f} ms '
            f"({_e(kind)})</title></circle>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _bars_svg(bars: _Bars) -> str:
    row, label_w = 24.0, 180.0
    height = row * len(bars.labels) + 30
    total = max(sum(v[p] for p in bars.parts) for v in bars.values) or 1.0
    scale = (_W - label_w - _PAD_R) / total
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W:.0f} {height:.0f}" '
        'role="img" aria-label="time breakdown per rank">',
        f'<rect x="0" y="0" width="{_W:.0f}" height="{height:.0f}" fill="#fff"/>',
    ]
    for i, (label, values) in enumerate(zip(bars.labels, bars.values, strict=True)):
        top = 4 + i * row
        parts.append(
            f'<text x="{label_w - 8}" y="{top + 15}" font-size="12" text-anchor="end">'
            f"{_e(label)}</text>"
        )
        left = label_w
        for part in bars.parts:
            width = values[part] * scale
            if width > 0:
                parts.append(
                    f'<rect x="{left:.1f}" y="{top + 2}" width="{width:.1f}" height="{row - 6}" '
                    f'fill="{PART_COLORS[part]}"><title>{_e(label)}: {PART_LABELS[part]} '
                    f"{values[part]:.2f} ms</title></rect>"
                )
            left += width
    for tick in _ticks(0, total):
        px = label_w + tick * scale
        parts.append(
            f'<text x="{px:.1f}" y="{height - 6}" font-size="11" text-anchor="middle">'
            f"{tick:g}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


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
        rows.append(f"<tr><td>rank {_e(rank)}</td><td>{_e(entry.host or '-')}</td>{cells}</tr>")
    names = ["rank", "host", *(PART_LABELS[p] for p in PARTS)]
    names += [PART_LABELS[OUTSIDE], "total"] if outside else ["total"]
    head = "".join(f"<th>{h}</th>" for h in names)
    table = f"<table><tr>{head}</tr>{''.join(rows)}</table>"
    return table + (f'<p class="facts">{_e(OUTSIDE_NOTE)}</p>' if outside else "")


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
        + (f", idle {_fmt(idle, 1)} ms change" if isinstance(idle, (int, float)) else "")
        + ":</p>"
    )
    if not changes:
        return title + "<p>nothing grew</p>"
    rows = []
    for change in changes[:TOP_KERNELS]:
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
    return title + f"<table>{head}{''.join(rows)}</table>"


def render_html(report: Report, *, use_matplotlib: bool = True) -> HtmlPage:
    """The page for a report; PNG charts when matplotlib is importable (and allowed).
    The step chart needs the report built with `step_times=True`."""
    figure_class = _matplotlib() if use_matplotlib else None
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
        "<h2>Step time</h2>",
    ]
    chart = _step_chart(report, report.step_times) if report.step_times else None
    if chart is None:
        body.append("<p>no step times recorded</p>")
    else:
        png = _steps_png(figure_class, chart) if figure_class else None
        if png is not None:
            pngs["steps"] = png
        body.append(_figure("steps", "step time per step", png, "" if png else _steps_svg(chart)))
    captures = report.captures
    body.append(f"<h2>Captures ({len(captures)})</h2>")
    if captures:
        rows = "".join(
            f"<tr><td>{_e(c.step)}</td><td>{_e(','.join(c.kinds))}</td>"
            f'<td class="num">{_fmt(c.step_ms, 1)}</td>'
            f'<td class="num">{_fmt(c.ratio)}</td>'
            f"<td>{_e(ranks_cell(c))}</td>"
            f"<td>{_e(c.verdict.sentence())}</td></tr>"
            for c in captures
        )
        body.append(
            "<table><tr><th>step</th><th>kind</th><th>step ms</th><th>x rolling median</th>"
            f"<th>ranks</th><th>verdict</th></tr>{rows}</table>"
        )
    if report.anomalies or report.stragglers or report.drift:
        body += _slowness_sections(report)
    for capture in captures:
        body += _capture_section(capture, figure_class, pngs)
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


def _slowness_sections(report: Report) -> list[str]:
    """The anomalies table (every judged step, traced or not) and the stragglers."""
    body = [f"<h2>Anomalies ({len(report.anomalies)})</h2>"]
    if report.anomalies:
        rows = "".join(
            f"<tr><td>{_e(a.step)}</td>"
            f'<td class="num">{_fmt(a.step_ms, 1)}</td><td class="num">{_fmt(a.ratio)}</td>'
            f"<td>{_e('yes' if a.traced else 'no')}</td><td>{_e(a.judged_by)}</td>"
            f"<td>{_e(a.verdict.culprit_rank)}</td><td>{_e(a.verdict.cause)}</td>"
            f"<td>{_e(a.verdict.evidence)}</td></tr>"
            for a in report.anomalies[:500]
        )
        body.append(
            "<table><tr><th>step</th><th>step ms</th><th>x median</th><th>traced</th>"
            "<th>judged by</th><th>culprit</th><th>cause</th><th>evidence</th></tr>"
            f"{rows}</table>"
        )
    body.append(f"<h2>Stragglers ({len(report.stragglers)})</h2>")
    for line in straggler_lines(report):
        body.append(f"<p>{_e(line)}</p>")
    return body


def _capture_section(capture: Capture, figure_class: Any, pngs: dict[str, bytes]) -> list[str]:
    """One capture's heading, verdict, collections, bars, tables and notes."""
    step = capture.step
    body = [f'<h2 id="step-{_e(step)}">Step {_e(step)} ({_e(", ".join(capture.kinds))})</h2>']
    css = "verdict" if capture.verdict.culprit_rank is not None else "verdict none"
    body.append(f'<p class="{css}">Verdict: {_e(capture.verdict.sentence())}</p>')
    collections = gc_sentence(capture)
    if collections:
        body.append(f'<p class="facts">{_e(collections[0].upper() + collections[1:])}</p>')
    bars = _bars(capture)
    if bars is not None:
        png = _bars_png(figure_class, bars) if figure_class else None
        if png is not None:
            pngs[f"step_{step}"] = png
        body.append(_legend(bars.parts))
        alt = f"time breakdown per rank, step {step}"
        body.append(_figure(f"step_{step}", alt, png, "" if png else _bars_svg(bars)))
    body.append(_breakdown_table(capture))
    body.append(_kernel_table(capture))
    if capture.merged_trace:
        body.append(
            f"<p>All ranks in one trace (Perfetto): <code>{_e(capture.merged_trace)}</code></p>"
        )
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
