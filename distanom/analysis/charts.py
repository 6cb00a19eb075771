"""Charts of the HTML report: the step-time chart and each capture's per-rank bars, as a
PNG when matplotlib is installed and as inline SVG otherwise. Pure drawing: takes the
report model (`analysis.model`), returns bytes or markup; `html_report` places them."""

from __future__ import annotations

import html
import io
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distanom.analysis.model import BREAKDOWN_ROWS, Capture, Report, StepTimes
from distanom.analysis.report_order import is_culprit

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
# waiting (exposed comm) is quiet grey; a stall (idle, and the idle outside the ops) is
# red, so the culprit's stall is what the eye finds first
PART_COLORS = {
    "computation_time": "#4c72b0",
    "exposed_comm_time": "#c8c8c8",
    "exposed_memcpy_time": "#8172b3",
    "idle_time": "#c0392b",
    OUTSIDE: "#e8837a",
}
KIND_COLORS = {"anomaly": "#c0392b", "reference": "#27ae60", "requested": "#2e86c1"}


def _escape(value: Any) -> str:
    return html.escape(str(value), quote=True)


def matplotlib_figure() -> Any:
    """matplotlib's Figure class, or None when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def steps_png(figure_class: Any, chart: StepChart) -> bytes:
    """The step-time chart as a PNG drawn with matplotlib."""
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


def bars_png(figure_class: Any, bars: Bars) -> bytes:
    """The per-rank breakdown bars as a PNG drawn with matplotlib."""
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
class StepChart:
    """What the step-time chart shows: each step's time, the threshold, the captures."""

    steps: list[int]
    values: list[float]
    threshold: list[float]
    marks: list[tuple[int, float, str]]
    log: bool


@dataclass(frozen=True)
class Bars:
    """What the per-rank bars show: each rank's breakdown of one captured step."""

    title: str
    labels: list[str]
    values: list[dict[str, float]]
    parts: tuple[str, ...] = PARTS


def step_chart(report: Report, times: StepTimes) -> StepChart | None:
    """The step-time chart of a report, or None without a finite step time."""
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
    return StepChart(list(times.steps), values, list(times.threshold_ms), marks, log)


def rank_bars(capture: Capture) -> Bars | None:
    """The per-rank bars of one capture (culprit marked), or None without tables."""
    labels, values = [], []
    for rank, entry in capture.ranks.items():
        rows = entry.breakdown()
        if rows is None:
            continue
        host = entry.host
        # a `$` would start matplotlib mathtext (a crash on `$\frac{1}{$`): shown as is
        culprit = " ◀ culprit" if is_culprit(capture, rank) else ""
        labels.append(f"rank {rank}" + (f" ({host})" if host else "").replace("$", r"\$") + culprit)
        bar = {part: max(0.0, rows[part]) for part in PARTS}
        bar[OUTSIDE] = entry.outside_ms or 0.0
        values.append(bar)
    title = f"step {capture.step}: time per rank"
    parts = (*PARTS, OUTSIDE) if capture.shows_outside else PARTS
    return Bars(title, labels, values, parts) if labels else None


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
            f'<text x="22" y="4" font-size="11">{_escape(label)}</text></g>'
        )
        x += 40 + 7 * len(label)
    return "".join(parts)


def steps_svg(chart: StepChart) -> str:
    """The step-time chart as inline SVG (no matplotlib needed)."""
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
            f"({_escape(kind)})</title></circle>"
        )
    parts.append("</svg>")
    return "".join(parts)


def bars_svg(bars: Bars) -> str:
    """The per-rank bars as inline SVG (no matplotlib needed)."""
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
            f"{_escape(label)}</text>"
        )
        left = label_w
        for part in bars.parts:
            width = values[part] * scale
            if width > 0:
                parts.append(
                    f'<rect x="{left:.1f}" y="{top + 2}" width="{width:.1f}" height="{row - 6}" '
                    f'fill="{PART_COLORS[part]}"><title>{_escape(label)}: {PART_LABELS[part]} '
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
