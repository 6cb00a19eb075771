"""bench/probes/boundary_cost_probe.py on the CPU with the CUPTI tracer faked: the
default's boundary runs with a tracer and the duty cycle, its parts are metered, and the
boundaries with tracing off are told apart from the traced ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.tests.scripts import BENCH


def amp_blocks(tmp_path: Path, steps: int, *extra: str) -> dict[str, Any]:
    """Run the probe on the CPU AMP loop, detection beside a faked-CUPTI default;
    its blocks by variant."""
    out = tmp_path / "boundary.json"
    done = subprocess.run(
        [
            sys.executable, str(BENCH / "probes" / "boundary_cost_probe.py"),
            "--device", "cpu", "--fake-cupti", "--workloads", "amp", *extra,
            "--steps", str(steps), "--warmup", "10", "--repeats", "1",
            "--define", "default", "tracer.backend=cupti", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    blocks = json.loads(out.read_text())["workloads"]["amp"]["blocks"]
    return {b["variant"]: b for b in blocks}


def test_the_probe_meters_a_faked_cupti_default_beside_detection(tmp_path: Path) -> None:
    blocks = amp_blocks(tmp_path, 60)
    assert set(blocks) == {"clock", "detect", "default"}
    detect, default = blocks["detect"], blocks["default"]
    assert detect["boundary"]["calls"] == default["boundary"]["calls"] == 60
    assert detect["parts"]["tracer_mark"]["calls"] == 0  # detection: no tracer
    assert default["parts"]["tracer_mark"]["calls"] == 60  # every boundary marks
    # the faked tracer starts tracing and the duty cycle turns it off within the block
    assert 0 < default["boundary"]["untraced_calls"] < 60
    assert default["boundary"]["untraced_cpu_median_us"] > 0
    assert blocks["clock"]["clock_mark"]["calls"] == 60


def test_without_part_meters_only_the_boundary_is_metered(tmp_path: Path) -> None:
    blocks = amp_blocks(tmp_path, 40, "--no-parts")
    default = blocks["default"]
    assert default["boundary"]["calls"] == 40
    assert default["boundary"]["untraced_cpu_median_us"] > 0
    # nothing inside the boundary is metered, and what is not metered reads null, not 0
    for block in blocks.values():
        assert block["parts"] is None and block["clock_mark"] is None
    assert default["spikes"]["steps"] > 0  # the census still reads the clock
