"""How often the CPU verdict names the injected cause: repeated real torchrun jobs.

Runs the toy DDP script under `torchrun -m distanom.launch` on CPU (gloo), N times per
scenario, and checks the verdict `distanom report --json` gives for the injected steps:

  stall       rank 2 sleeps 0.6 s before steps 40 and 75   → rank 2, host_stall
  all-slow    every rank sleeps 0.3 s before steps 35 and 55 → no culprit, global

`--parallel K` runs K jobs at once, to see the verdict with the CPU oversubscribed.
Writes bench/results/verdict_robustness.json (every capture's verdict per run) and
prints a summary. Usage:

    PYTHONPATH=. python bench/verdict_robustness.py --runs 8 [--parallel 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "examples" / "toy_train.py"
LAUNCH = [
    "--run-dir",
    "runs",
    "--set",
    "detect.warmup_steps=5",
    "--set",
    "detect.min_steps=15",
    "--set",
    "capture.reference_every_steps=20",
]
SCENARIOS: dict[str, dict[str, Any]] = {
    "stall": {
        "args": [
            "--steps",
            "100",
            "--stall-rank",
            "2",
            "--stall-steps",
            "40,75",
            "--stall-s",
            "0.6",
        ],
        "steps": [40, 75],
        "expect": (2, "host_stall"),
    },
    "all-slow": {
        "args": ["--steps", "70", "--all-slow-steps", "35,55"],
        "steps": [35, 55],
        "expect": (None, "global"),
    },
}


def run_once(name: str) -> dict[str, Any]:
    scenario = SCENARIOS[name]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="distanom-verdict-") as tmp:
        started = time.monotonic()
        job = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=4",
                "-m",
                "distanom.launch",
                *LAUNCH,
                str(TOY),
                *scenario["args"],
            ],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        seconds = time.monotonic() - started
        if job.returncode != 0:
            return {"scenario": name, "error": job.stderr[-2000:]}
        report = json.loads(
            subprocess.run(
                [sys.executable, "-m", "distanom", "report", str(Path(tmp) / "runs"), "--json"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
    captures = {c["step"]: c for c in report["captures"]}
    checked = []
    for step in scenario["steps"]:
        capture = captures.get(step)
        verdict = (capture or {}).get("verdict") or {}
        got = (verdict.get("culprit_rank"), verdict.get("cause"))
        checked.append(
            {
                "step": step,
                "captured": capture is not None,
                "got": list(got),
                "ok": capture is not None and got == scenario["expect"],
                "evidence": verdict.get("evidence"),
            }
        )
    others = [
        {"step": s, "kinds": c["kinds"], "cause": (c.get("verdict") or {}).get("cause")}
        for s, c in sorted(captures.items())
        if s not in scenario["steps"]
    ]
    return {
        "scenario": name,
        "seconds": round(seconds, 1),
        "checked": checked,
        "others": others,
        # why an injected step was not captured, when it was not
        "detector": report.get("detector"),
        "episodes": report.get("episodes"),
        "capture_state": report.get("capture_state"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append")
    parser.add_argument(
        "--out", default=str(REPO / "bench" / "results" / "verdict_robustness.json")
    )
    args = parser.parse_args(argv)
    names = [n for n in (args.scenario or sorted(SCENARIOS)) for _ in range(args.runs)]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = list(pool.map(run_once, names))
    summary: dict[str, dict[str, int]] = {}
    for result in results:
        entry = summary.setdefault(
            result["scenario"], {"captures": 0, "right": 0, "failed_jobs": 0}
        )
        if "error" in result:
            entry["failed_jobs"] += 1
            continue
        for check in result["checked"]:
            entry["captures"] += 1
            entry["right"] += int(check["ok"])
    body = {
        "runs_per_scenario": args.runs,
        "parallel_jobs": args.parallel,
        "cpu_count": os.cpu_count(),
        "summary": summary,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(body, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    for result in results:
        for check in result.get("checked", []):
            if not check["ok"]:
                print(f"MISS {result['scenario']} step {check['step']}: {check}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
