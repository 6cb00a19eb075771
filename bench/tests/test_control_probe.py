"""bench/probes/control_cost_probe.py on the CPU: the control thread's sections are
metered, nested ones within their round, and a faked-CUPTI default runs beside
detection (so the probe does not rot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.tests.scripts import BENCH


def test_the_probe_meters_the_control_threads_sections(tmp_path: Path) -> None:
    out = tmp_path / "control.json"
    done = subprocess.run(
        [
            sys.executable, str(BENCH / "probes" / "control_cost_probe.py"),
            "--steps", "400", "--step-ms", "1", "--repeats", "1", "--fake-cupti", "--unpaced",
            "--define", "default", "tracer.backend=cupti", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["blocks"]) == {"detect", "default", "detect_unpaced"}
    for name, (block,) in result["blocks"].items():
        sections = block["sections"]
        rounds = sections["ControlLoop._run_round"]
        assert block["rounds"] == rounds["calls"] > 0, name
        # a round holds the detector: nested sections never exceed their round
        assert sections["Detector.observe_many"]["calls"] == rounds["calls"], name
        assert 0 < sections["Detector.observe_many"]["us_per_step"] <= rounds["us_per_step"]
        # the whole thread's CPU (the agent's own figure) holds its metered rounds
        assert block["control_us_per_step"] >= rounds["us_per_step"] > 0, name
        # the control thread drains the inbox, every round or wake-up
        assert sections["StepInbox.take"]["calls"] > 0, name
        # blocks: the whole thread's (its loop, metered once) hold each section's
        whole = sections["ControlLoop._round_loop"]
        assert whole["calls"] == 1, name
        assert whole["blocks"] >= sections["StepInbox.take"]["blocks"] > 0, name  # it waits
        assert whole["blocks"] >= sections["RoundPacer.pause"]["blocks"] >= 0, name
        assert block["training_blocks_per_step"] >= 0, name
    assert result["median"]["default"]["control_us_per_step"] > 0
    # unpaced: the pacer is still asked, but never sleeps, so it never blocks
    (unpaced,) = result["blocks"]["detect_unpaced"]
    assert unpaced["sections"]["RoundPacer.pause"]["calls"] > 0
    assert unpaced["sections"]["RoundPacer.pause"]["blocks"] == 0
