"""Which anomalies of a finished run a larger own-time discount would not have raised.

    python3 bench/discount_replay.py RUN_DIR [RUN_DIR ...] [--allowances 0,0.5,1,2] [--out FILE]

The detector judges a step on its time minus distanom's own work during it (`self_ms`,
capped). That work is a lower bound of what it stalls: the training thread also waits
to take the GIL back, so a step with own time can stay over the threshold by a margin
of the same size, and the report then names it `distanom` (docs/measurements.md, "A
capture's encoding, paced", and the session notes). This replays each run's detector,
with its own config, over its recorded steps (as the report does for its thresholds),
once per allowance: a step with own time is judged with `allowance` ms more discounted.
Allowance 0 should give the run's own anomalies: `matches_run` says whether it did
(it did on the runs tried by hand; one bench-test run on a loaded CI host did not, cause
not found, so read the figures of a run where it is false with care). Per allowance:
the anomalies raised, and which of the run's anomalies it would not have raised, with
the report's cause for each, so that hidden faults (a run with injected faults) and
hidden `distanom` noise (a healthy run) are counted side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from distanom.analysis.build import run_detect_config
from distanom.analysis.run import load_run, load_steps
from distanom.config import CaptureConfig
from distanom.detect import Detector
from distanom.records.anomalies import read_anomalies

REPO = Path(__file__).resolve().parents[1]


def replay(series: Any, detect: dict[str, Any], allowance_ms: float) -> list[int]:
    """The anomalous steps the run's detector raises with `allowance_ms` more discounted
    on every step that has own time."""
    detector = Detector(run_detect_config(detect), CaptureConfig())
    steps: list[int] = []
    for sample in series.samples():
        if allowance_ms and sample.self_ms > 0:
            sample = dataclasses.replace(sample, self_ms=sample.self_ms + allowance_ms)
        detector.observe(sample)
        steps.extend(j.step for j in detector.take_anomalies())
    return steps


def causes(run_dir: Path, report: dict[str, Any] | None = None) -> dict[int, str]:
    """The report's cause for each anomaly: from `report` (`distanom report --json`'s
    output) where the caller has it, else from running it."""
    if report is None:
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))  # run as a file: the repository is not on the path
        from bench.report_child import report_json

        report = report_json(run_dir, dict(os.environ))
    return {a["step"]: str(a["verdict"].get("cause")) for a in report.get("anomalies", [])}


def one_run(
    run_dir: Path, allowances: list[float], report: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The replay of one finished run per allowance (`report`: its `distanom report
    --json` output, where the caller ran it already)."""
    data = load_run(run_dir)
    series = load_steps(data)
    config = data.info.get("config") if isinstance(data.info.get("config"), dict) else {}
    detect = dict((config or {}).get("detect", {}))
    recorded = sorted(r.step for r in read_anomalies(data.run, world_size=data.world_size))
    cause = causes(run_dir, report)
    out: dict[str, Any] = {"run": run_dir.name, "steps": len(series.steps)}
    out["recorded"] = len(recorded)
    by_allowance = {}
    for allowance in allowances:
        raised = replay(series, detect, allowance)
        gone = sorted(set(recorded) - set(raised))
        by_allowance[str(allowance)] = {
            "raised": len(raised),
            "not_raised": [[step, cause.get(step, "?")] for step in gone],
        }
        if allowance == 0:
            out["matches_run"] = raised == recorded
    out["allowances"] = by_allowance
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--allowances", default="0,0.5,1,2")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    allowances = [float(a) for a in args.allowances.split(",")]
    if 0.0 not in allowances:
        allowances.insert(0, 0.0)
    results = [one_run(run, allowances) for run in args.runs]
    text = json.dumps({"bench": "discount_replay", "runs": results}, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
