"""What the evidence tier costs: in-process micro-costs (CPU) and whole jobs (device).

    python bench/evidence_cost.py --in-process                 # CPU: per-step parts
    python bench/evidence_cost.py --out "$OUT/evidence_cost_h200.json"   # on the device
    python bench/evidence_cost.py --nproc 2 --pairs 5 --out ...

In-process (`--in-process`, any machine): the training thread's part (`EvidenceMarks.mark`,
one per step), Flight Recorder's recording cost per collective (one-rank gloo all-reduce
of 16 floats with and without `TORCH_FR_BUFFER_SIZE`, each in a fresh process, best of
5 x 5,000), and the control thread's read of a full 256-entry buffer plus the step
assignment (`EvidenceCollector.poll`), with what that costs per step at the reader's
interval.

Whole jobs (default; needs one NVIDIA GPU per rank): the seed's workload
(examples/seed_resnet.py: ResNet18, bf16, batch 5, SGD) under
`torchrun -m distanom.launch --set tracer.backend=none`, with Flight Recorder and the
evidence tier on (`evidence`) against the same job with `DISTANOM_FLIGHT_RECORDER=0`
(`no_fr`: marks and CPU/GC evidence only) and against plain `torchrun` (`plain`). Each
job is timed from inside (one clock reading per optimizer step, the same hook in every
variant): the mean step time after `--skip` warm-up steps, so startup and teardown are
left out. Variants take turns within each pair, so slow drifts hit every side. Reports
the median per variant and the median of each pair's ratio against `plain`. The target
is at most 0.5% for `evidence`.
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
import textwrap
from pathlib import Path
from typing import Any

from distanom import evidence

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "examples" / "seed_resnet.py"


def _python_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _fr_record_cost_us(buffer: int | None) -> float:
    code = textwrap.dedent(
        """
        import time, torch, torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        t = torch.ones(16)
        for _ in range(500):
            dist.all_reduce(t)
        best = []
        for _ in range(5):
            began = time.perf_counter_ns()
            for _ in range(5000):
                dist.all_reduce(t)
            best.append((time.perf_counter_ns() - began) / 5000 / 1e3)
        dist.destroy_process_group()
        print(min(best))
        """
    )
    env = _python_env(OMP_NUM_THREADS="1")
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    env.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
    if buffer:
        env["TORCH_FR_BUFFER_SIZE"] = str(buffer)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def _read_cost_code() -> str:
    return textwrap.dedent(
        """
        import json, time, torch, torch.distributed as dist
        from distanom.evidence import EvidenceCollector, EvidenceMarks
        from distanom.flight_recorder import read_entries
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        t = torch.ones(16)
        marks = EvidenceMarks()
        collector = EvidenceCollector(marks, read_fr=True)
        collector._own_thread = "-"  # polled on the training thread here, unlike the agent
        mark_ns, poll_ms, read_ms = [], [], []
        step = 0
        for rnd in range(40):
            for _ in range(20):  # 20 steps of 3 collectives each between two reads
                for _ in range(3):
                    dist.all_reduce(t)
                began = time.perf_counter_ns()
                marks.mark(step, time.time_ns())
                mark_ns.append(time.perf_counter_ns() - began)
                step += 1
            began = time.perf_counter()
            read_entries()
            read_ms.append((time.perf_counter() - began) * 1e3)
            began = time.perf_counter()
            done = collector.poll(force=True)
            poll_ms.append((time.perf_counter() - began) * 1e3)
        assert done and done[-1][1].collectives == 3, done[-1:]
        dist.destroy_process_group()
        mark_ns.sort()
        print(json.dumps({
            "mark_ns_median": mark_ns[len(mark_ns) // 2],
            "read_256_ms_median": sorted(read_ms)[len(read_ms) // 2],
            "poll_ms_median": sorted(poll_ms)[len(poll_ms) // 2],
        }))
        """
    )


def in_process() -> dict[str, Any]:
    """The evidence tier's parts, measured in one process each (CPU)."""
    without = [_fr_record_cost_us(None) for _ in range(3)]
    with_fr = [_fr_record_cost_us(256) for _ in range(3)]
    env = _python_env(OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="256")
    done = subprocess.run(
        [sys.executable, "-c", _read_cost_code()], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"evidence_cost: read probe failed: {done.stderr[-2000:]}")
    parts = json.loads(done.stdout.strip().splitlines()[-1])
    # the reader reads when the buffer is READ_FILL full: each entry is read about once
    fill = evidence.READ_FILL * 256
    return {
        "allreduce_us_without_fr": round(min(without), 3),
        "allreduce_us_with_fr": round(min(with_fr), 3),
        "fr_record_us_per_collective": round(min(with_fr) - min(without), 3),
        "mark_ns_per_step": parts["mark_ns_median"],
        "poll_ms_per_read_of_256": round(parts["poll_ms_median"], 3),
        "raw_read_ms_of_256": round(parts["read_256_ms_median"], 3),
        "read_us_per_collective": round(parts["poll_ms_median"] * 1e3 / fill, 3),
    }


# Runs the workload as __main__ and times its steps from inside: an optimizer post-hook
# takes one clock reading per step (the same in every variant), so startup and teardown
# are left out and the steady state is compared. Rank 0 writes the mean step time.
TIMED = """
import atexit, json, os, runpy, sys, time
from torch.optim.optimizer import register_optimizer_step_post_hook
stamps = []
register_optimizer_step_post_hook(lambda *a: stamps.append(time.perf_counter()))
def _write():
    skip = int(os.environ["EVIDENCE_COST_SKIP"])
    if os.environ.get("RANK", "0") == "0" and len(stamps) > skip + 1:
        mean = (stamps[-1] - stamps[skip]) / (len(stamps) - 1 - skip) * 1e3
        with open(os.environ["EVIDENCE_COST_OUT"], "w") as out:
            json.dump({"ms_per_step": mean, "steps": len(stamps)}, out)
atexit.register(_write)
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def _job(variant: str, steps: int, nproc: int, script: Path, workdir: Path, skip: int) -> float:
    timed = workdir / "timed.py"
    timed.write_text(TIMED)
    result = workdir / f"{variant}.json"
    result.unlink(missing_ok=True)
    env = _python_env(
        OMP_NUM_THREADS="1", EVIDENCE_COST_OUT=str(result), EVIDENCE_COST_SKIP=str(skip)
    )
    if variant == "no_fr":
        env["DISTANOM_FLIGHT_RECORDER"] = "0"
    launch: list[str] = []
    if variant != "plain":
        launch = ["-m", "distanom.launch", "--run-dir", str(workdir / "runs")]
        launch += ["--set", "tracer.backend=none"]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        *launch, str(timed), str(script), "--steps", str(steps),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True)
    if done.returncode != 0 or not result.exists():
        raise SystemExit(f"evidence_cost: {variant} failed: {done.stderr[-2000:]}")
    return float(json.loads(result.read_text())["ms_per_step"])


def whole_jobs(args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved pairs of whole jobs; each job's mean step time after its warm-up."""
    variants = ["plain", "no_fr", "evidence"]
    # a fresh private folder unless one is named (never a fixed path in a shared /tmp)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="evidence-"))
    workdir.mkdir(parents=True, exist_ok=True)
    slopes: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants if v != "plain"}
    script = Path(args.script).resolve()
    for pair in range(args.pairs):
        order = variants[pair % 3 :] + variants[: pair % 3]
        got = {}
        for variant in order:
            got[variant] = _job(variant, args.steps, args.nproc, script, workdir, args.skip)
            slopes[variant].append(got[variant])
        for variant in ratios:
            ratios[variant].append(got[variant] / got["plain"])
        print(json.dumps({"pair": pair, "ms_per_step": got}), flush=True)
    return {
        "script": str(script.relative_to(REPO)) if script.is_relative_to(REPO) else str(script),
        "nproc": args.nproc,
        "steps": args.steps,
        "skipped_steps": args.skip,
        "pairs": args.pairs,
        "ms_per_step": {v: [round(x, 4) for x in s] for v, s in slopes.items()},
        "median_ms_per_step": {v: round(statistics.median(s), 4) for v, s in slopes.items()},
        "median_ratio_vs_plain": {v: round(statistics.median(r), 5) for v, r in ratios.items()},
        "overhead_pct_vs_plain": {
            v: round((statistics.median(r) - 1) * 100, 3) for v, r in ratios.items()
        },
    }


def main() -> None:
    """Run the chosen measurement and write its JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--in-process", action="store_true", help="CPU micro-costs only")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--skip", type=int, default=300, help="warm-up steps not timed")
    parser.add_argument("--script", default=str(SEED))
    parser.add_argument("--workdir", default=None, help="default: a new temporary folder")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    try:
        import torch

        facts["torch"] = torch.__version__
        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    result = {**facts, **(in_process() if args.in_process else whole_jobs(args))}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
