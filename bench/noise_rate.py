"""False anomalies on a healthy job: the loop of tests/e2e/scripts/phases_train.py with no
fault, under `torchrun -m distanom.launch` at the default config, once with the spread
fence (`detect.spread_sigmas`, default) and once without it and the slowdown floor
(`spread_sigmas=0`, `min_slowdown_ms=0`: the multiplier alone), and (`--plain`) under
plain `torchrun` with no distanom, alternating `--pairs` times. Reports the anomalies
per 1,000 judged steps of each, with each anomaly's step and ratio, and for every run,
from the script's own step times (the same clock with or without distanom), how many
steps took over 1.5x and over 3x its median: slow steps that are there without
distanom are the loop's own, not distanom's noise.

    python3 bench/noise_rate.py [--cuda] [--nproc 1] [--steps 2000] [--pairs 2] [--plain] --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report_child import report_json

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "e2e" / "scripts" / "phases_train.py"


def own_times(prefix: Path, nproc: int) -> dict:
    """Steps over 1.5x and 3x their rank's median in the script's own step times (the
    first 20 steps, warm-up, left out), per 1,000 steps over all ranks, and the Python
    collections of generation 1 or 2 or over 1 ms ([rank, step, generation, ms])."""
    over_1_5, over_3, count, spikes, collections = 0, 0, 0, [], []
    for rank in range(nproc):
        path = Path(f"{prefix}.rank{rank}.json")
        found = json.loads(path.read_text()) if path.exists() else {}
        times = found.get("times", [])[20:]
        collections += [[rank, *c] for c in found.get("gc", []) if c[1] >= 1 or c[2] >= 1.0]
        if not times:
            continue
        median = statistics.median(times)
        count += len(times)
        over_1_5 += sum(t > 1.5 * median for t in times)
        over_3 += sum(t > 3 * median for t in times)
        spikes += [
            [rank, i + 21, round(t / median, 2)] for i, t in enumerate(times) if t > 3 * median
        ]
    per = 1000 / max(count, 1)
    return {"steps": count, "over_1.5x_per_1000": round(over_1_5 * per, 2),
            "over_3x_per_1000": round(over_3 * per, 2), "over_3x": spikes[:200],
            "gc_gen1_or_2_or_over_1ms": collections[:500]}  # fmt: skip


def one_job(
    nproc: int, steps: int, cuda: bool, sets: list[str] | None, scratch: Path,
    extra_env: dict[str, str] | None = None, allowances: list[float] | None = None,
) -> dict:  # fmt: skip
    """One run: under distanom with `sets`, or under plain torchrun when `sets` is None."""
    run_dir = scratch / f"runs-{time.monotonic_ns()}"
    prefix = scratch / f"times-{time.monotonic_ns()}"
    launch = (
        [] if sets is None
        else ["-m", "distanom.launch", "--run-dir", str(run_dir),
              *[a for s in sets for a in ("--set", s)]]
    )  # fmt: skip
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", *launch, str(SCRIPT), "--steps", str(steps),
        "--step-times", str(prefix), *(["--cuda"] if cuda else []),
    ]  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    env.update(extra_env or {})
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    own = own_times(prefix, nproc)
    if sets is None:
        return {"rc": done.returncode, "steps": own["steps"], "anomalies": [], "own": own}
    found = report_json(run_dir, env)
    anomalies = found.get("anomalies", [])
    replayed = None
    if allowances:  # before the scratch folder goes: which anomalies a larger discount drops
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from bench.discount_replay import one_run

        latest = sorted(p for p in run_dir.iterdir() if p.is_dir() and not p.is_symlink())
        replayed = one_run(latest[-1], [0.0, *allowances], found) if latest else None
    return {
        "discount_replay": replayed,
        "rc": done.returncode,
        "steps": found.get("steps", {}).get("count"),
        "median_ms": found.get("steps", {}).get("median_ms"),
        "threshold_ms": found.get("steps", {}).get("threshold_ms"),
        "anomalies": [
            [
                a["step"],
                a["ratio"],
                a["traced"],
                a["verdict"].get("cause"),
                a["verdict"].get("phase"),
            ]
            for a in anomalies
        ],
        "own": own,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--plain", action="store_true", help="also under plain torchrun")
    parser.add_argument(
        "--variants", default="",
        help='JSON {"name": {"sets": ["key=value", ...], "env": {"VAR": "value"}}} run '
        "instead of fence/multiplier_only (an ablation: which part of distanom a slow step needs)",
    )  # fmt: skip
    parser.add_argument(
        "--replay-allowances", default="",
        help="e.g. 0.5,1,2: replay each distanom run's detector with this much more own time "
        "discounted (bench/discount_replay.py) and keep which anomalies each drops",
    )  # fmt: skip
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    variants: dict[str, list[str] | None] = {
        "fence": [],
        "multiplier_only": ["detect.spread_sigmas=0", "detect.min_slowdown_ms=0"],
    }
    envs: dict[str, dict[str, str]] = {}
    if args.variants:
        chosen = json.loads(args.variants)
        variants = {name: list(v.get("sets", [])) for name, v in chosen.items()}
        envs = {name: dict(v.get("env", {})) for name, v in chosen.items()}
    if args.plain:
        variants["plain_torchrun"] = None
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    allowances = [float(a) for a in args.replay_allowances.split(",") if a.strip()]
    with tempfile.TemporaryDirectory() as scratch:
        for pair in range(args.pairs):
            order = list(variants) if pair % 2 == 0 else list(reversed(variants))
            for name in order:
                result = one_job(
                    args.nproc, args.steps, args.cuda, variants[name], Path(scratch),
                    envs.get(name), allowances,
                )  # fmt: skip
                runs[name].append(result)
                shown = {
                    k: v for k, v in result.items() if k not in ("anomalies", "discount_replay")
                }
                shown["own"] = {k: v for k, v in result["own"].items() if k != "over_3x"}
                print(name, json.dumps(shown), len(result["anomalies"]), "anomalies", flush=True)
    import torch

    summary = {
        name: {
            "anomalies": sum(len(r["anomalies"]) for r in results),
            "steps": sum(r["steps"] or 0 for r in results),
            "own_over_3x_per_1000": [r["own"]["over_3x_per_1000"] for r in results],
            "own_over_1.5x_per_1000": [r["own"]["over_1.5x_per_1000"] for r in results],
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
