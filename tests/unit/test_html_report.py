"""`distanom report --html`: one self-contained page, checked by parsing it (always) and by
rendering it in headless Chromium (where installed)."""

from __future__ import annotations

import math
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from distanom.analysis.html_report import render_html
from distanom.analysis.report import Report, build_report, rolling_threshold, write_outputs
from distanom.analysis.run import RunData, StepSeries, load_run
from distanom.cli import main as cli_main
from distanom.config import CaptureConfig, DetectConfig
from distanom.detect import Detector
from distanom.rundir import write_json_atomic
from tests.unit.rungen import Capture, make_run
from tests.unit.stepgen import MATMUL, cpu_job, gpu_job

EVIL_HOST = '<script>alert("host")</script>'
EVIL_KERNEL = "<img src=x onerror=alert(1)>gemm"
DETECT = {"multiplier": 1.5, "window_steps": 50, "warmup_steps": 5, "min_steps": 10}


class Page(HTMLParser):
    """Text, tags and every URL-bearing attribute of a page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text: list[str] = []
        self.tags: list[str] = []
        self.urls: list[str] = []
        self.links: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.urls += [v or "" for k, v in attrs if k == "src"]
        self.links += [v or "" for k, v in attrs if k == "href"]

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    @property
    def all_text(self) -> str:
        return " ".join(" ".join(self.text).split())


def run_report(data: RunData) -> Report:
    """The report of a loaded run, its files written, as `distanom report` makes it."""
    return write_outputs(data, build_report(data))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    slow = gpu_job(extra_compute_us={3: 3000.0})
    for event in slow[3]["traceEvents"]:
        if event["name"] == MATMUL:
            event["name"] = EVIL_KERNEL
    make_run(
        tmp_path,
        [
            Capture(20, "reference", gpu_job(), 1.1, 1.2),
            Capture(40, "anomaly", slow, 4.1, 1.2),
        ],
        hosts=["a", "a", EVIL_HOST, EVIL_HOST],
    )
    return tmp_path


def page_of(run_dir: Path, *, use_matplotlib: bool) -> str:
    data = load_run(str(run_dir))
    report = write_outputs(data, build_report(data, step_times=True))
    return render_html(report, use_matplotlib=use_matplotlib).html


def check_content(page: Page) -> None:
    text = page.all_text
    assert "Verdict: rank 3 — compute: rank 3: computation" in text
    for rank in range(4):
        assert f"rank {rank}" in text
    assert "Step 40 (anomaly)" in text and "Step 20 (reference)" in text
    assert "against reference step 20" in text
    # untrusted strings come through as text, never as markup
    assert EVIL_HOST in text and EVIL_KERNEL in text
    assert "script" not in page.tags
    assert page.tags.count("img") == sum(u.startswith("data:image/png;base64,") for u in page.urls)
    assert all(u.startswith("data:") for u in page.urls)  # self-contained: nothing fetched
    # links only within the page, or to the merged traces on disk (never fetched)
    assert all(u.startswith("#step-") or u.startswith("file:///") for u in page.links)
    assert any(u.endswith("/captures/step_40/merged.trace.json.gz") for u in page.links)
    assert "Open it in Perfetto" in text


def test_page_without_matplotlib_draws_svg(run_dir: Path) -> None:
    page = Page(page_of(run_dir, use_matplotlib=False))
    check_content(page)
    assert "img" not in page.tags
    assert page.tags.count("svg") == 3  # the step timeline and one bar chart per capture
    assert page.tags.count("polyline") == 2  # step times and the threshold
    assert page.tags.count("circle") >= 2  # the two captures marked (plus legend swatches)


def test_page_with_matplotlib_embeds_pngs(run_dir: Path) -> None:
    pytest.importorskip("matplotlib")
    page = Page(page_of(run_dir, use_matplotlib=True))
    check_content(page)
    assert page.tags.count("img") == 3 and "svg" not in page.tags


def test_cli_html_writes_the_page_and_pngs_beside_it(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out" / "report.html"
    out.parent.mkdir()
    assert cli_main(["report", str(run_dir), "--html", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {out}")
    check_content(Page(out.read_text(encoding="utf-8")))
    pngs = sorted(p.name for p in out.parent.glob("*.png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert pngs == []
    else:
        assert pngs == ["report_step_20.png", "report_step_40.png", "report_steps.png"]
        assert all((out.parent / p).read_bytes().startswith(b"\x89PNG") for p in pngs)
    assert cli_main(["report", str(run_dir), "--html", str(tmp_path / "no" / "x.html")]) == 2


def test_page_tells_the_text_reports_story(tmp_path: Path) -> None:
    """Same header medians, the time outside the ops as a column, bar part and total, and
    an unreadable trace not counted among the ranks."""
    docs = cpu_job(stall_us={1: 50_000.0}, stall_before_first_op=True)
    run = make_run(tmp_path, [Capture(40, "anomaly", docs, 52.0, 1.5)], hosts=["a"] * 4)
    write_json_atomic(
        run.status_json,
        {"state": "finished", "world_size": 4, "median_ms": 1.8, "threshold_ms": 2.7},
    )
    run.trace_path(40, 3).write_bytes(b"\x1f\x8bnot gzip")
    html = page_of(tmp_path, use_matplotlib=False)
    text = Page(html).all_text
    assert (
        "median 1.5 ms over the run · detector threshold 2.7 ms = 1.5 x its latest rolling "
        "median 1.8 ms" in text
    )
    assert "x rolling median ranks verdict" in text and " 3/4 (1 unreadable) " in text
    assert "Unreadable trace from rank(s) 3 (see problems)" in text
    assert "idle outside ops total" in text
    assert "rank 1 culprit a 0.98 0.33 0.00 0.08 50.06 51.45" in text  # highlighted
    assert "rank 3 a - - - - - -" in text
    assert "outside ops: step window before the rank's first op" in text
    assert "Verdict: rank 1 — host stall: rank 1: idle 50.1 ms (incl. 50.1 ms outside" in text
    assert "<title>rank 1 (a) ◀ culprit: outside ops 50.06 ms</title>" in html  # its bar
    assert '<tr class="culprit"><td>rank 1<span class="tag">culprit</span>' in html


def test_rolling_threshold_is_the_detectors() -> None:
    detect = DetectConfig(multiplier=1.5, window_steps=20, warmup_steps=3, min_steps=8)
    detector = Detector(detect, CaptureConfig())
    steps = list(range(60))
    values = [10.0 + (s * 37 % 11) + (200.0 if s in (6, 30, 45) else 0.0) for s in steps]
    traced = [s % 4 != 0 for s in steps]
    flushed = [s % 7 == 0 for s in steps]
    own = [25.0 if s == 31 else 0.0 for s in steps]
    series = StepSeries(steps, {0: values}, traced, flushed, own)
    ours = rolling_threshold(series, detect.model_dump())
    judged = 0
    for sample, threshold in zip(series.samples(), ours, strict=True):
        fallback = detector.counts.judged_fallback
        decisions = detector.observe(sample)
        by_condition = detector.counts.judged_fallback == fallback
        if sample.condition == (True, False) and by_condition and not math.isnan(threshold):
            assert threshold == pytest.approx(detector.threshold_ms)
            judged += 1
        if decisions and decisions[0].kind == "anomaly":
            assert decisions[0].threshold_ms == pytest.approx(threshold)
    assert judged > 20
    assert all(math.isnan(t) for t in ours[:3])  # warm-up: never judged
    # steps a wider baseline judged (before min_steps) have their threshold too
    anomalies = detector.take_anomalies()
    assert any(a.judged_by != "condition" for a in anomalies)
    for anomaly in anomalies:
        assert ours[anomaly.step] == pytest.approx(anomaly.threshold_ms), anomaly


def test_a_run_from_before_the_slowdown_floor_is_replayed_without_it() -> None:
    """run.json of a run recorded before `detect.min_slowdown_ms` existed has no such key:
    its chart shows the threshold it was judged by (1.5 x a 2 ms median = 3 ms), not
    today's default floor (4 ms)."""
    steps = list(range(40))
    series = StepSeries(steps, {0: [2.0] * 40}, [True] * 40, [False] * 40, [0.0] * 40)
    old = {"multiplier": 1.5, "window_steps": 20, "warmup_steps": 3, "min_steps": 8}
    assert rolling_threshold(series, old)[-1] == pytest.approx(3.0)
    assert rolling_threshold(series, {**old, "min_slowdown_ms": 2.0})[-1] == pytest.approx(4.0)


# --------------------------------------------------------------------------- Chromium

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
)


def chromium(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    profile = tmp_path / "chromium-profile"
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def png_pixels(path: Path) -> tuple[int, int, bytes]:
    """Width, height and the unfiltered-or-not pixel rows of an 8-bit PNG (enough to
    tell a blank page from a drawn one)."""
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, zlib.decompress(idat)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
@pytest.mark.parametrize("use_matplotlib", [False, True])
def test_page_renders_in_headless_chromium(
    run_dir: Path, tmp_path: Path, use_matplotlib: bool
) -> None:
    if use_matplotlib:
        pytest.importorskip("matplotlib")
    html_path = tmp_path / "page.html"
    html_path.write_text(page_of(run_dir, use_matplotlib=use_matplotlib), encoding="utf-8")
    dom = chromium(["--dump-dom", html_path.as_uri()], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = Page(dom.stdout)
    assert "Verdict: rank 3 — compute" in page.all_text
    assert all(f"rank {r}" in page.all_text for r in range(4))
    assert "script" not in page.tags  # the hostile host name stayed text in the live DOM
    shot = tmp_path / "shot.png"
    done = chromium(
        ["--window-size=1200,1600", f"--screenshot={shot}", html_path.as_uri()], tmp_path
    )
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    width, height, pixels = png_pixels(shot)
    assert (width, height) == (1200, 1600)
    assert len(set(pixels)) > 50  # a blank page compresses to a handful of distinct bytes


def test_captures_are_listed_most_severe_first_and_op_changes_are_trimmed(
    tmp_path: Path,
) -> None:
    from distanom.analysis.html_report import PART_COLORS
    from distanom.analysis.report_order import by_severity, trimmed

    make_run(
        tmp_path,
        [
            Capture(20, "reference", gpu_job(), 1.1, 1.2),
            Capture(30, "anomaly", gpu_job(extra_compute_us={1: 600.0}), 1.8, 1.2),
            Capture(40, "anomaly", gpu_job(extra_compute_us={3: 3000.0}), 4.1, 1.2),
        ],
        hosts=["a"] * 4,
    )
    report = build_report(load_run(str(tmp_path)))
    assert [c.step for c in by_severity(report.captures)] == [40, 30, 20]
    html = render_html(report, use_matplotlib=False).html
    table = html[html.index("Most severe first") :]
    assert (
        table.index('href="#step-40"')
        < table.index('href="#step-30"')
        < table.index('href="#step-20"')
    )
    changes = [{"added_us": v, "name": str(v)} for v in (2.0, -900.0, 5000.0, 30.0)]
    shown, left_out, left_us = trimmed(changes, 300.0, 8, 0.01)  # 1% of the step: 3 ms
    assert [c["added_us"] for c in shown] == [5000.0]
    assert (left_out, left_us) == (3, -868.0)
    assert PART_COLORS["idle_time"] != PART_COLORS["exposed_comm_time"]  # a stall stands out


def test_an_op_table_of_only_small_changes_still_lists_the_largest_and_signs_idle(
    tmp_path: Path,
) -> None:
    # a step slowed by idle time (a stall) whose ops barely changed: the text report
    # lists its top op changes, so the page must not show an empty table
    from distanom.analysis.kernel_diff import kernel_diff_lines
    from distanom.analysis.render_json import kernel_diff_json

    make_run(
        tmp_path,
        [
            Capture(20, "reference", gpu_job(), 1.1, 1.2),
            Capture(
                40, "anomaly", gpu_job(all_gap_us=200_000.0, extra_compute_us={1: 30.0}), 200.0
            ),
        ],
        hosts=["a"] * 4,
    )
    report = build_report(load_run(str(tmp_path)))
    capture = next(c for c in report.captures if c.step == 40)
    diff = kernel_diff_json(capture.kernel_diff)
    text = "\n".join(kernel_diff_lines(diff, capture.verdict.culprit_rank))
    assert "(idle +" in text
    html = render_html(report, use_matplotlib=False).html
    section = html[html.index('id="step-40"') :]
    assert "idle +" in section  # signed, as the text report prints it
    title = section.index("against reference step")
    table = section[title : section.index("</table>", title)]
    assert "<tr><td" in table  # at least one change listed, though all are under 1%
