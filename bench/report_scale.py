"""Benchmark of `distanom report` on long runs and on the planted directories of issue 37:
its wall time and peak RSS, one fresh process per report, for one or more checkouts of
distanom taken in turns (so a shared host's drift hits each alike).

Owns: making the runs (a finished 2-rank run from `tests.unit.rungen` with a capture at
step 20, widened to RANKS ranks of STEPS steps each, every row with its phase columns as
the agent writes them; or one of `tests.unit.hostile_plants.PROBES`), and timing
`python -m distanom report RUN --json` under each checkout's PYTHONPATH.

Writes a JSON document (machine, per-run figures, medians per checkout and case) to
--out and prints a table. Run from the repository root:
`python -m bench.report_scale [--repo PATH ...] [--cases 8x200000,64x20000,ranks_times_steps]
[--runs 3] [--out bench/results/report_scale.json]`.
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

from distanom.records.steps import STEPS_CSV_HEADER
from tests.unit import hostile_plants

ROOT = Path(__file__).resolve().parents[1]
_PEAK = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:], stdout=subprocess."
    "DEVNULL).returncode; print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def long_run(base: Path, ranks: int, steps: int) -> Path:
    """A run of `ranks` ranks with `steps` steps each, every row with phases."""
    run = hostile_plants.a_run(base)
    info = json.loads(run.run_json.read_text())
    run.run_json.write_text(json.dumps({**info, "world_size": ranks, "hosts": ["a"] * ranks}))
    for rank in range(ranks):
        with run.steps_csv(rank).open("w") as handle:
            handle.write(STEPS_CSV_HEADER)
            for first in range(1, steps + 1, 10_000):
                handle.write(
                    "".join(
                        f"{s},{10 + (s * 7 + rank) % 5}.{s % 10000:04d},{int(s % 64 < 16)},0,"
                        f"0.000,0.000,-1,0,0.5{s % 10}0,3.210,6.543,0.100,1.500,0.400,3.000,"
                        f"6.400,1.600\n"
                        for s in range(first, min(first + 10_000, steps + 1))
                    )
                )
    return run.path


def make_case(base: Path, case: str) -> Path:
    """The run directory of a case: `RxS` (ranks x steps) or a probe's name."""
    if "x" in case and case.replace("x", "").isdigit():
        ranks, steps = (int(v) for v in case.split("x"))
        return long_run(base, ranks, steps)
    run = hostile_plants.a_run(base)
    hostile_plants.PROBES[case](run)
    return run.path


def measure(repo: Path, run: Path) -> tuple[int, float, float]:
    """Exit status, seconds and peak RSS (MB) of `report RUN --json` under `repo`."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    command = [sys.executable, "-m", "distanom", "report", str(run), "--json"]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, *command], env=env, capture_output=True, text=True,
        timeout=900, check=False, cwd=repo,
    )  # fmt: skip
    seconds = time.monotonic() - started
    code, peak_kb = (int(v) for v in done.stdout.split()[-2:])
    return code, seconds, peak_kb / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", action="append", type=Path, help="a checkout (default: this)")
    parser.add_argument("--cases", default="8x200000,64x20000,ranks_times_steps")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/report_scale.json")
    args = parser.parse_args()
    repos = [r.resolve() for r in (args.repo or [ROOT])]
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            run = make_case(Path(tmp) / case, case)
            for turn in range(args.runs):
                for repo in repos:
                    code, seconds, peak = measure(repo, run)
                    row = {"case": case, "repo": str(repo), "turn": turn, "exit": code,
                           "seconds": round(seconds, 2), "peak_mb": round(peak, 1)}  # fmt: skip
                    results.append(row)
                    print(json.dumps(row), flush=True)
    medians = {
        f"{case} @ {repo}": {
            key: statistics.median(float(r[key]) for r in rows)  # type: ignore[arg-type]
            for key in ("seconds", "peak_mb")
        }
        for case in args.cases.split(",")
        for repo in map(str, repos)
        if (rows := [r for r in results if r["case"] == case and r["repo"] == repo])
    }
    document = {
        "machine": {"host_cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "load_avg_at_end": os.getloadavg()},
        "runs": results, "medians": medians,
    }  # fmt: skip
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    for key, value in medians.items():
        print(f"{key}: {value['seconds']:.2f} s, {value['peak_mb']:.0f} MB")


if __name__ == "__main__":
    main()
