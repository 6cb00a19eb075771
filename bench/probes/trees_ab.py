"""Two source trees of distanom side by side, interleaved in one run: the step boundary's
cost (`boundary_cost_probe.py --no-parts`, detection and the default with a faked CUPTI
tracer on CPU, or the real tracer on a GPU) and the phase marks' (`phase_marks_cost.py`),
each bench run as a fresh process from each tree in turn (the order flips every round).

    python3 bench/probes/trees_ab.py --tree base=/tmp/base --tree head=. --rounds 3 \
        --out bench/results/FILE.json [--device cpu|cuda:0] [--steps 600]

A tree is a checkout of this repository (e.g. `git archive <commit> | tar -x -C DIR`); each
bench runs from that tree's own bench/ with only that tree on PYTHONPATH. Per run it
keeps the boundary's CPU median (all calls, and untraced calls: tracing off before and
after), its wall mean, the agent's own figures (`own_cost_whole_block`: with
`own_time`, the steady boundary's parts), and the phase marks' added us per step.
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

OWN_KEYS = (
    "boundary_us_per_step", "boundary_parts_us", "phase_marks_us_per_step",
    "control_us_per_step", "startup_ms", "tracer_switches", "traced_boundaries",
)  # fmt: skip


def run_bench(tree: Path, argv: list[str], timeout_s: float) -> None:
    # the tree first; other entries kept (site packages), other distanom checkouts dropped
    kept = [
        entry
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry and not (Path(entry) / "distanom" / "__init__.py").exists()
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *kept]))
    subprocess.run(
        [sys.executable, *argv], cwd=tree, env=env, check=True, timeout=timeout_s,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def boundary_figures(path: Path, workload: str) -> dict[str, Any]:
    data = json.loads(path.read_text())
    out: dict[str, Any] = {}
    for block in data["workloads"][workload]["blocks"]:
        if block["variant"] == "clock":
            out["clock_ms_per_step"] = block["ms_per_step"]
            continue
        own = block.get("own_cost_whole_block") or {}
        out[block["variant"]] = {
            "ms_per_step": block["ms_per_step"],
            "boundary_cpu_median_us": block["boundary"]["cpu_median_us"],
            "boundary_untraced_cpu_median_us": block["boundary"]["untraced_cpu_median_us"],
            "boundary_wall_mean_us": block["boundary"]["wall_us"],
            "own": {key: own.get(key) for key in OWN_KEYS if key in own},
        }
    return out


def phase_figures(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    added = data["added_us_per_step_vs_off"]
    return {
        "marks_only_us_per_step": round(data["marks_only_us_per_step"], 2),
        **{f"{variant}_added_median_us": round(v["median_us"], 2) for variant, v in added.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workload", default="amp")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--phase-blocks", type=int, default=20)
    parser.add_argument("--phase-block", type=int, default=100)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    trees = dict(item.split("=", 1) for item in args.tree)
    paths = {name: Path(path).resolve() for name, path in trees.items()}
    cpu = args.device == "cpu"
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    result: dict[str, Any] = {
        "bench": "trees_ab",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "params": {k: str(v) for k, v in vars(args).items()},
        "runs": runs,
    }
    with tempfile.TemporaryDirectory(prefix="trees_ab_") as scratch:
        for round_number in range(args.rounds):
            order = list(paths) if round_number % 2 == 0 else list(reversed(paths))
            for name in order:
                tree = paths[name]
                boundary_out = Path(scratch) / f"b_{name}_{round_number}.json"
                argv = [
                    "bench/probes/boundary_cost_probe.py", "--device", args.device,
                    "--no-parts", "--workloads", args.workload, "--warmup", str(args.warmup),
                    "--steps", str(args.steps), "--repeats", "1", "--define", "default",
                    "--out", str(boundary_out),
                ]  # fmt: skip
                if cpu:
                    argv.append("--fake-cupti")
                began = time.monotonic()
                run_bench(tree, argv, args.timeout_s)
                phase_out = Path(scratch) / f"p_{name}_{round_number}.json"
                run_bench(
                    tree,
                    ["bench/phase_marks_cost.py", "--device", "cpu" if cpu else "cuda",
                     "--blocks", str(args.phase_blocks), "--block", str(args.phase_block),
                     "--out", str(phase_out)],
                    args.timeout_s,
                )  # fmt: skip
                run = {
                    "round": round_number,
                    "boundary": boundary_figures(boundary_out, args.workload),
                    "phase_marks": phase_figures(phase_out),
                    "seconds": round(time.monotonic() - began, 1),
                }
                runs[name].append(run)
                print(name, json.dumps(run), flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    summary: dict[str, Any] = {}
    for name, mine in runs.items():
        summary[name] = {
            f"{variant}_{field}": statistics.median(r["boundary"][variant][field] for r in mine)
            for variant in ("detect", "default")
            for field in ("boundary_untraced_cpu_median_us", "boundary_wall_mean_us")
        }
        for field in mine[0]["phase_marks"]:
            summary[name][f"phase_{field}"] = statistics.median(
                r["phase_marks"][field] for r in mine
            )
    result["median_over_runs"] = summary
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
