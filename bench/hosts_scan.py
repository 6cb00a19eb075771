"""Benchmark of `distanom hosts` over a large folder of runs.

Owns: timing the command over `--runs` synthetic finished runs (default 2,000; 8 ranks
on 2 of 32 hosts each, written by `tests.unit.fleetgen.make_fleet` through the
product's record writers: run.json, anomalies.jsonl, stragglers.json, some hang
records, a planted bad host). Times the whole command in fresh processes (interpreter
start, imports, scan, ranking, JSON out) and the scan + ranking alone in process, each
`--repeat` times, and checks that the planted host came out first.

Writes bench/results/hosts_scan.json and prints the medians. Run:
`python bench/hosts_scan.py [--runs N] [--repeat K] [--out PATH]`.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distanom.analysis.fleet_runs import scan_runs  # noqa: E402
from distanom.analysis.hosts import rank_suspects  # noqa: E402
from tests.unit.fleetgen import make_fleet  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "hosts_scan.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="distanom-hosts-") as temp:
        base = Path(temp) / "runs"
        started = time.perf_counter()
        fleet = make_fleet(base, args.runs, seed=1)
        made_s = time.perf_counter() - started
        files = sum(len(names) for _, _, names in os.walk(base))
        size = sum(
            os.path.getsize(os.path.join(folder, name))
            for folder, _, names in os.walk(base)
            for name in names
        )
        command = [sys.executable, "-c", "import sys; from distanom.cli import main; "
                   "sys.exit(main(sys.argv[1:]))", "hosts", str(base), "--json"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        whole, in_process = [], []
        first = ""
        for _ in range(args.repeat):
            started = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            whole.append(time.perf_counter() - started)
            first = json.loads(done.stdout)["hosts"][0]["host"]
            started = time.perf_counter()
            suspects = rank_suspects(scan_runs([base]))
            in_process.append(time.perf_counter() - started)
        gpu = suspects.gpus[0]
    result = {
        "benchmark": "distanom hosts RUNS_DIR --json over synthetic finished runs",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
        },
        "runs": args.runs,
        "files": files,
        "bytes": size,
        "make_s": round(made_s, 3),
        "repeat": args.repeat,
        "command_s": [round(t, 3) for t in whole],
        "command_median_s": round(statistics.median(whole), 3),
        "scan_and_rank_s": [round(t, 3) for t in in_process],
        "scan_and_rank_median_s": round(statistics.median(in_process), 3),
        "per_run_ms": round(1000 * statistics.median(in_process) / args.runs, 3),
        "planted": {"host": fleet.bad_host, "local_rank": fleet.bad_local_rank},
        "first_host": first,
        "first_gpu": {"host": gpu.host, "local_rank": gpu.local_rank},
        "problems": len(suspects.scan.problems),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("runs", "files", "command_median_s",
                                              "scan_and_rank_median_s", "per_run_ms",
                                              "first_host", "first_gpu")}))  # fmt: skip
    if first != fleet.bad_host:
        sys.exit(f"the planted host {fleet.bad_host} is not first ({first})")


if __name__ == "__main__":
    main()
