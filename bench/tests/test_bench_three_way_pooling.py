"""bench/probes/budget_three_way.py --summarize over several saved runs: their rotations
are pooled and kept apart (each run numbers its rotations from 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def saved_run(path: Path, rotations: int, governed_ms: float) -> Path:
    blocks = []
    for triple in range(rotations):
        blocks += [
            {"triple": triple, "kind": "off", "steps": 64, "ms": 640.0, "traced": 0},
            {"triple": triple, "kind": "never", "steps": 64, "ms": 640.0, "traced": 0},
            {"triple": triple, "kind": "governed", "steps": 64, "ms": governed_ms, "traced": 0},
        ]
    path.write_text(json.dumps({"blocks": blocks}))
    return path


def test_several_runs_are_pooled_rotation_by_rotation(tmp_path: Path) -> None:
    first = saved_run(tmp_path / "a.json", 3, 640.0 * 1.02)  # +2% in every rotation
    second = saved_run(tmp_path / "b.json", 5, 640.0)  # +0%
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "probes" / "budget_three_way.py"),
         "--summarize", str(first), str(second)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    summary = json.loads(done.stdout)
    governed = summary["rotation_ratio_vs_off"]["governed"]
    # 8 rotations, not 5 (the second run's rotations 0-2 replacing the first's)
    assert governed["n"] == 8
    assert abs(governed["mean_pct"] - 2.0 * 3 / 8) < 1e-6
    assert abs(summary["overall_pct_vs_off"]["governed"] - 0.75) < 1e-3
