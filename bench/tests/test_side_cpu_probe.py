"""bench/probes/side_cpu_probe.py runs end to end on the CPU with a real side process and
reports each of its readings, so it does not rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.tests.scripts import BENCH


def test_the_probe_reads_start_up_rows_and_idle(tmp_path: Path) -> None:
    out = tmp_path / "side_cpu.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / "probes" / "side_cpu_probe.py"),
         "--rounds", "20", "--idle-s", "0.2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["steps_per_pass"] == 20 * 64
    assert result["ready_s"] > 0
    # its interpreter and imports take tens of ms of CPU: /proc counts 10 ms ticks
    assert result["startup_cpu_ms"] >= 10 and result["startup_cpu_ms_as_reported"] >= 10
    assert result["side_threads"] == 1  # no BLAS thread pool: numpy is not imported
    modules = [name.strip() for name, _us in result["slowest_imports_us"]]
    assert "distanom.side_main" in modules
    assert not {"numpy", "torch", "pydantic"} & set(modules)
