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
    for key in ("startup_cpu_ms", "rows_back_to_back_us_per_step", "rows_paced_us_per_step"):
        assert result[key] >= 0, key
    assert result["side_threads"] >= 1
    modules = [name.strip() for name, _us in result["slowest_imports_us"]]
    assert "distanom.side_main" in modules
    assert "numpy" not in modules and "torch" not in modules
