"""The report's user-facing outputs stay byte-for-byte what they were.

Each scenario builds a synthetic run (`tests.unit.rungen`), runs `distanom report` on it
(JSON, text and the SVG HTML page) and reads back what the report wrote into the run
directory (every capture's summary.json, a digest of every merged trace). The result
must equal the golden file in tests/data/golden/report/. Regenerate the files only for
an intended change of the output: `DISTANOM_REGEN_GOLDEN=1 pytest tests/unit/test_report_golden.py`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from distanom.cli import main as cli_main
from distanom.rundir import RunDir, write_json_atomic
from tests.unit.rungen import Capture, make_run
from tests.unit.stepgen import cpu_job, gpu_job

GOLDEN = Path(__file__).parents[1] / "data" / "golden" / "report"


def _gc_columns(path: Path, pauses: dict[int, tuple[float, int]]) -> None:
    rows = path.read_text().splitlines()
    out = [rows[0] + ",after_flush,self_ms,gc_ms,gc_gen"]
    for row in rows[1:]:
        spent, generation = pauses.get(int(row.split(",")[0]), (0.0, -1))
        out.append(f"{row},0,0.000,{spent:.3f},{generation}")
    path.write_text("\n".join(out) + "\n")


def _gpu_four_ranks(base: Path) -> RunDir:
    return make_run(
        base,
        [
            Capture(20, "reference", gpu_job(), 1.1, 1.2),
            Capture(40, "anomaly", gpu_job(extra_compute_us={3: 3000.0}), 4.1, 1.2),
            Capture(60, "anomaly", gpu_job(all_gap_us=3000.0), 4.1, 1.2),
            Capture(70, "anomaly", gpu_job(extra_compute_us={2: 3000.0, 3: 3000.0}), 4.1, 1.2),
        ],
        hosts=["a", "a", "b", "b"],
    )


def _cpu_stall(base: Path) -> RunDir:
    docs = cpu_job(stall_us={1: 50_000.0}, stall_before_first_op=True)
    return make_run(base, [Capture(40, "anomaly", docs, 52.0, 1.5)], hosts=["a"] * 4)


def _damaged_with_gc_and_status(base: Path) -> RunDir:
    run = make_run(
        base,
        [
            Capture(
                40,
                "anomaly",
                gpu_job(gap_us={1: 3000.0}),
                4.1,
                1.2,
                tracer_stats={0: {"held_buffers_at_serve": 1}},
                cost_ms={
                    r: {"locate_ms": 1.0 + r, "build_ms": 2.0, "encode_ms": 3.5, "write_ms": 0.25}
                    for r in range(4)
                },
            ),
            Capture(50, "requested", gpu_job(), 1.2, 1.2),
        ],
        hosts=["a", "a", "b", "b"],
    )
    run.trace_path(40, 2).write_bytes(b"\x1f\x8bnot gzip")
    for rank in range(4):
        _gc_columns(run.steps_csv(rank), {40: (2.9, 2)} if rank == 1 else {40: (0.4, 0)})
    write_json_atomic(
        run.status_json,
        {
            "state": "finished",
            "world_size": 4,
            "threshold_ms": 2.25,
            "median_ms": 1.5,
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
                },
            },
            "captures": {"written": 3, "skipped_disk": 2, "missed": 1},
            "detector": {"judged": 90, "anomalous": 5, "captured": 3, "anomalous_untraced": 1},
            "episodes": [{"first": 40, "last": 41}],
            "capture_off": "disk full",
        },
    )
    return run


def _cpu_two_hosts(base: Path) -> RunDir:
    return make_run(
        base,
        [
            Capture(10, "reference", cpu_job(world=2, step=10), 1.5, 1.5),
            Capture(30, "anomaly", cpu_job(world=2, stall_us={0: 20_000.0}, step=30), 22.0, 1.5),
        ],
        hosts=["a", "b"],
    )


SCENARIOS: dict[str, Callable[[Path], RunDir]] = {
    "gpu_four_ranks": _gpu_four_ranks,
    "cpu_stall": _cpu_stall,
    "damaged_with_gc_and_status": _damaged_with_gc_and_status,
    "cpu_two_hosts": _cpu_two_hosts,
}


def _cli(args: list[str]) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(args) == 0
    return out.getvalue()


def outputs(base: Path, make: Callable[[Path], RunDir]) -> dict[str, Any]:
    """Everything the report shows or writes for one scenario, run paths made relative."""
    run = make(base)
    root = str(run.path)
    json_text = _cli(["report", root, "--json"])
    text = _cli(["report", root])
    summaries = {
        path.parent.name: json.loads(path.read_text())
        for path in sorted(run.path.glob("captures/step_*/summary.json"))
    }
    merged = {
        path.parent.name: hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest()
        for path in sorted(run.path.glob("captures/step_*/merged.trace.json.gz"))
    }
    from dataclasses import replace

    from distanom.analysis.html_report import render_html
    from distanom.analysis.model import StepTimes
    from distanom.analysis.report import build_report, rolling_threshold
    from distanom.analysis.run import load_run, load_steps

    data = load_run(root)
    series = load_steps(data)
    times = StepTimes(
        series.steps, series.step_ms(), rolling_threshold(series, {"multiplier": 1.5})
    )
    html = render_html(replace(build_report(data), step_times=times), use_matplotlib=False).html
    return {
        "json_text": json_text.replace(root, "<RUN>"),
        "json": json.loads(json_text.replace(root, "<RUN>")),
        "text": text.replace(root, "<RUN>"),
        "summaries": summaries,
        "merged_sha256": merged,
        "html": html.replace(root, "<RUN>"),
    }


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_report_outputs_equal_the_golden_files(name: str, tmp_path: Path) -> None:
    got = outputs(tmp_path, SCENARIOS[name])
    golden = GOLDEN / f"{name}.json"
    if os.environ.get("DISTANOM_REGEN_GOLDEN"):
        golden.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    expected = json.loads(golden.read_text())
    for key in ("json", "json_text", "summaries", "merged_sha256", "text", "html"):
        assert got[key] == expected[key], key
