"""False anomalies on a healthy job: the loop of tests/e2e/scripts/phases_train.py with no
fault, under `torchrun -m distanom.launch` at the default config, once with the spread
fence (`detect.spread_sigmas`, default) and once without (`spread_sigmas=0`: the
multiplier alone), alternating `--pairs` times. Reports the anomalies per 1,000 judged
steps of each, with each anomaly's step and ratio.

    python3 bench/noise_rate.py [--cuda] [--nproc 1] [--steps 2000] [--pairs 2] --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "e2e" / "scripts" / "phases_train.py"


def one_job(nproc: int, steps: int, cuda: bool, sets: list[str], scratch: Path) -> dict:
    run_dir = scratch / f"runs-{time.monotonic_ns()}"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "-m", "distanom.launch", "--run-dir", str(run_dir),
        *[a for s in sets for a in ("--set", s)], str(SCRIPT), "--steps", str(steps),
        *(["--cuda"] if cuda else []),
    ]  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    report = subprocess.run(
        [sys.executable, "-m", "distanom", "report", str(run_dir), "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    found = json.loads(report.stdout) if report.returncode == 0 else {}
    anomalies = found.get("anomalies", [])
    return {
        "rc": done.returncode,
        "steps": found.get("steps", {}).get("count"),
        "median_ms": found.get("steps", {}).get("median_ms"),
        "threshold_ms": found.get("steps", {}).get("threshold_ms"),
        "anomalies": [[a["step"], a["ratio"], a["traced"]] for a in anomalies],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    variants = {"fence": [], "multiplier_only": ["detect.spread_sigmas=0"]}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as scratch:
        for pair in range(args.pairs):
            order = list(variants) if pair % 2 == 0 else list(reversed(variants))
            for name in order:
                result = one_job(args.nproc, args.steps, args.cuda, variants[name], Path(scratch))
                runs[name].append(result)
                print(name, json.dumps({k: v for k, v in result.items() if k != "anomalies"}),
                      len(result["anomalies"]), "anomalies", flush=True)  # fmt: skip
    import torch

    summary = {
        name: {
            "anomalies": sum(len(r["anomalies"]) for r in results),
            "steps": sum(r["steps"] or 0 for r in results),
        }
        for name, results in runs.items()
    }
    for entry in summary.values():
        entry["per_1000_steps"] = round(entry["anomalies"] / max(entry["steps"], 1) * 1000, 2)
    result = {
        "bench": "noise_rate",
        "device": torch.cuda.get_device_name() if args.cuda else "cpu",
        "torch": torch.__version__,
        "nproc": args.nproc,
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
