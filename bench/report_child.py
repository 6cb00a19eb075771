"""`distanom report --json` of a run directory in a child process, for the benches that
judge a run by what the report says (noise_rate, discount_replay, probes/stall_map).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def report_json(run_dir: Path, env: dict[str, str]) -> dict:
    """`distanom report --json` of a run, in a child process ({} where it failed)."""
    report = subprocess.run(
        [sys.executable, "-m", "distanom", "report", str(run_dir), "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    return json.loads(report.stdout) if report.returncode == 0 else {}
