"""bench/probes/side_process_probe.py: the frame a relay would send a side process holds
every field of the step records it packs (the phase marks' events aside), and the probe
runs end to end on the CPU (both arrangements, a real side process), so it does not rot."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from bench.tests.scripts import BENCH, load_bench_script


def test_a_round_survives_the_frame() -> None:
    """The probe's frame: the product's steps payload (tested in tests/unit), then the
    evidence marks."""
    probe = load_bench_script("probes/side_process_probe")
    records = [
        (7, 3.25, 9, 0.5, 1.25, 0, ([(0, 100, None), (1, 250, object())], 90, 400, 12, (0.1,) * 3)),
        (8, 4.0, 0, 0.0, 0.0, -1, (None, 0, 0, 0, (math.nan,) * 3)),
    ]  # fmt: skip
    evidence = [(7, 1_700_000_000_000_000_000, 123), (8, 1_700_000_000_004_000_000, 456)]
    back, back_evidence = probe.unpack_round(probe.pack_round(records, evidence))
    assert back_evidence == evidence
    assert [r[:6] for r in back] == [r[:6] for r in records]
    assert back[0][6][0] == [(0, 100, None), (1, 250, None)]
    assert back[1][6][0] is None


def test_the_probe_runs_both_arrangements(tmp_path: Path) -> None:
    out = tmp_path / "side.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / "probes" / "side_process_probe.py"),
         "--steps", "300", "--step-ms", "1", "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    (thread,) = result["blocks"]["thread"]
    (relay,) = result["blocks"]["relay"]
    assert thread["in_process_us_per_step"] > 0
    assert relay["in_process_us_per_step"] > 0
    # every step the training loop made reached the side process, and it worked on them
    assert relay["side_steps"] >= 290
    assert relay["side_cpu_us_per_step"] > 0
    assert relay["side_startup_ms"] >= relay["side_ready_ms"] > 0
    assert relay["side_vm_hwm_mb"] > 0
