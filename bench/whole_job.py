"""What distanom costs as users pay it: the whole job under `torchrun -m distanom.launch`
against the same script under plain `torchrun`, on loops users run.

    python3 bench/whole_job.py --out $OUT [--workloads resnet18,amp,hf,lightning]
        [--variants default,none] [--pairs 3] [--budget-s 540] [--steps-scale 1.0]

Workloads (bench/workloads/): `resnet18` (the seed's ResNet18, bf16, batch 5, SGD),
`resnet18_b64` (the same at batch 64: GPU-bound steps),
`amp` (a 6-layer encoder, fp16 autocast + GradScaler, AdamW), `compile` and
`compile_ro` (`amp` under torch.compile, default and reduce-overhead modes), `hf` (a
Hugging Face Trainer on a 4-layer GPT-2 built from a config), `lightning` (a Lightning
Trainer on an MLP). Variants: `plain` (no distanom) is the baseline of every pair;
`default` (distanom's defaults), `none` (`tracer.backend: none`: detection alone),
`budget` (`tracer.overhead_budget_pct: 1`, the default since 2026-12), `trace_all`
(`tracer.overhead_budget_pct: null`: every step traced, the default before).

Metric: each script's own steady-state time per step (StepTimer: synchronized chunks
of 100 steps after a warm-up), not process wall time, which start-up noise dominates.
Runs are interleaved: for each workload, each round runs plain and every variant once,
in an order that rotates from round to round, and each variant's ratio to that round's
plain run is one pair. Results: `<out>/whole_job.json` with every run's figures (device,
torch version, per-pair ratios, per-chunk times) and the median and range of the ratios.
Starts no new round once `--budget-s` has passed, so one device call stays bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORKLOADS: dict[str, tuple[list[str], int]] = {
    "resnet18": (["bench/workloads/loops.py", "resnet18"], 1500),
    "resnet18_b64": (["bench/workloads/loops.py", "resnet18", "--batch", "64"], 300),
    "amp": (["bench/workloads/loops.py", "amp"], 1000),
    "compile": (["bench/workloads/loops.py", "amp", "--compile", "default"], 1000),
    "compile_ro": (["bench/workloads/loops.py", "amp", "--compile", "reduce-overhead"], 1000),
    "hf": (["bench/workloads/frameworks.py", "hf"], 1000),
    "lightning": (["bench/workloads/frameworks.py", "lightning"], 2000),
}
VARIANTS: dict[str, list[str]] = {
    "plain": [],
    "default": [],
    "none": ["--set", "tracer.backend=none"],
    # the default without the step phases' marks (their cost, side by side with "default")
    "default_nophases": ["--set", "step.phases=false"],
    # the default with the steps file written in the control thread, not the side process
    "default_inthread": ["--set", "control.side_process=false"],
    "none_adaptive": ["--set", "tracer.backend=none", "--set", "clock.mode=adaptive"],
    # bisecting detection's cost: no CUDA event per step (host clock); rounds ~8x rarer
    "none_host": ["--set", "tracer.backend=none", "--set", "clock.mode=host"],
    # detection with a tracer's round length (16 steps at the default history_steps)
    "none16": ["--set", "tracer.backend=none", "--set", "consensus.batch_steps=16"],
    "none_rare": [
        "--set",
        "tracer.backend=none",
        "--set",
        "consensus.interval_ms=4000",
        "--set",
        "consensus.batch_steps=1000",
        "--set",
        "tracer.history_steps=2000",
    ],
    "default_adaptive": ["--set", "clock.mode=adaptive"],
    "budget": ["--set", "tracer.overhead_budget_pct=1"],
    "trace_all": ["--set", "tracer.overhead_budget_pct=null"],
}


def command(workload: str, variant: str, steps: int, run_dir: Path) -> list[str]:
    """The torchrun command line of one run."""
    script, _ = WORKLOADS[workload]
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    if variant != "plain":
        head += ["-m", "distanom.launch", "--run-dir", str(run_dir), *VARIANTS[variant]]
    return [*head, str(REPO / script[0]), *script[1:], "--steps", str(steps)]


def run_once(workload: str, variant: str, steps: int, scratch: Path) -> dict[str, Any]:
    """One job; its StepTimer result plus wall time and exit status."""
    result_path = scratch / f"{workload}-{variant}-{time.monotonic_ns()}.json"
    env = dict(os.environ, WHOLE_JOB_RESULT=str(result_path), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    started = time.monotonic()
    done = subprocess.run(
        command(workload, variant, steps, scratch / "runs"),
        cwd=scratch, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    record: dict[str, Any] = {"variant": variant, "rc": done.returncode}
    record["wall_s"] = round(time.monotonic() - started, 2)
    if done.returncode != 0 or not result_path.exists():
        record["stderr_tail"] = done.stderr[-2000:]
        return record
    record.update(json.loads(result_path.read_text()))
    distanom_lines = [line for line in done.stderr.splitlines() if "distanom" in line]
    record["distanom_stderr_lines"] = len(distanom_lines)
    return record


def summarize(rounds: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Per variant: the ratio to the same round's plain run, its median and range."""
    out: dict[str, Any] = {}
    for variant in variants:
        ratios = []
        for one in rounds:
            base = one["runs"].get("plain", {}).get("ms_per_step")
            mine = one["runs"].get(variant, {}).get("ms_per_step")
            if base and mine:
                ratios.append(mine / base)
        out[variant] = {
            "pairs": len(ratios),
            "ratios": [round(r, 4) for r in ratios],
            "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
            "min_ratio": round(min(ratios), 4) if ratios else None,
            "max_ratio": round(max(ratios), 4) if ratios else None,
        }
    return out


def device_facts() -> dict[str, Any]:
    """Device name, torch and CUDA versions, host."""
    import torch

    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    facts["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    facts["host"] = platform.node()
    return facts


def git_commit() -> str | None:
    """The checkout's commit (with `+dirty` when it has changes); where there is no git
    checkout (a copied tree), $DISTANOM_COMMIT, else None."""
    fallback = os.environ.get("DISTANOM_COMMIT") or None
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return fallback
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return fallback


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "whole_job_out")))
    parser.add_argument("--workloads", default="resnet18,amp,hf,lightning")
    parser.add_argument("--variants", default="default,none")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--steps-scale", type=float, default=1.0)
    args = parser.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    variants = [v for v in args.variants.split(",") if v and v != "plain"]
    unknown = [w for w in workloads if w not in WORKLOADS] + [
        v for v in variants if v not in VARIANTS
    ]
    if unknown:
        print(f"whole_job: unknown workload or variant: {', '.join(unknown)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report: dict[str, Any] = {"facts": device_facts(), "workloads": {}, "args": dict(vars(args))}
    report["args"]["out"] = str(args.out)
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        for pair in range(args.pairs):
            for workload in workloads:
                if time.monotonic() - started > args.budget_s:
                    break
                steps = max(50, int(WORKLOADS[workload][1] * args.steps_scale))
                order = ["plain", *variants]
                shift = pair % len(order)
                order = order[shift:] + order[:shift]
                runs = {v: run_once(workload, v, steps, scratch) for v in order}
                entry = report["workloads"].setdefault(workload, {"steps": steps, "rounds": []})
                entry["rounds"].append({"order": order, "runs": runs})
                entry["summary"] = summarize(entry["rounds"], variants)
                line = ", ".join(f"{v} {r.get('ms_per_step')}" for v, r in runs.items())
                print(f"[{workload} round {pair}] ms/step: {line}", flush=True)
                (args.out / "whole_job.json").write_text(json.dumps(report, indent=1))
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    (args.out / "whole_job.json").write_text(json.dumps(report, indent=1))
    for workload, entry in report["workloads"].items():
        print(workload, json.dumps(entry["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
