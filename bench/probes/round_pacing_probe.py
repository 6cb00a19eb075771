"""What pausing between a round's phases costs the control thread, in one process.

    python3 bench/probes/round_pacing_probe.py --out bench/results/round_pacing_cpu.json
        [--rounds 4] [--steps 300] [--step-ms 10] [--round-steps 16,128]

A loop of `--step-ms` steps (a sleep, as a GPU-bound step's host wait, plus a tiny CPU
model) runs the agent (`tracer.backend: none`, world size 1) in blocks, alternating two
rules: `always` (the rule before c88301d: pause about a step between a round's phases
whenever a median is known; here `pacing.UNPACED_SHARE` set to -1) and `measured` (the
rule now: no pauses where the round's measured work is at most a tenth of the median
step). `--round-steps` sets `consensus.batch_steps` (16 is a tracer's round at the
default `tracer.history_steps`). Per block: ms/step, the control thread's CPU per step,
pauses slept, and the round work the pacer measured. Figures are from this machine's CPU
only; the GPU figure is bench/whole_job_ab.py's threads' CPU per step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from distanom import pacing
from distanom.agent import Agent
from distanom.config import load_config
from distanom.world import WorldInfo


def control_cpu_ns() -> int:
    """CPU time so far of the distanom-control thread (0 when it is not running)."""
    for thread in threading.enumerate():
        if thread.name == "distanom-control" and thread.ident is not None:
            return time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
    return 0


def block(rule: str, round_steps: int, steps: int, step_s: float) -> dict[str, Any]:
    """One agent, 60 warm-up steps, then `steps` timed ones under `rule`."""
    pacing.UNPACED_SHARE = -1.0 if rule == "always" else DEFAULT_SHARE
    layer = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    inputs = torch.randn(4, 16)
    overrides = ["tracer.backend=none", f"consensus.batch_steps={round_steps}"]
    agent = Agent(load_config(None, overrides), WorldInfo.from_env({}), Path(tempfile.mkdtemp()))
    agent.install()
    try:

        def run(count: int) -> None:
            for _ in range(count):
                layer(inputs).sum().backward()
                time.sleep(step_s)
                optimizer.step()
                optimizer.zero_grad()

        run(60)
        cpu, pauses, began = control_cpu_ns(), agent.control.pacer.pauses, time.perf_counter()
        run(steps)
        elapsed = time.perf_counter() - began
        cpu_us = (control_cpu_ns() - cpu) / steps / 1e3
        work = agent.control.pacer.work_ms
        return {
            "ms_per_step": round(elapsed * 1e3 / steps, 4),
            "control_cpu_us_per_step": round(cpu_us, 2),
            "pauses": agent.control.pacer.pauses - pauses,
            "rounds": agent.control.rounds,
            "round_work_ms": None if work is None else round(work, 3),
        }
    finally:
        agent.close()
        pacing.UNPACED_SHARE = DEFAULT_SHARE


DEFAULT_SHARE = pacing.UNPACED_SHARE


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--round-steps", default="16,128")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [int(size) for size in args.round_steps.split(",") if size]
    blocks: dict[str, list[dict[str, Any]]] = {}
    for number in range(args.rounds):
        rules = ["always", "measured"] if number % 2 == 0 else ["measured", "always"]
        for size in sizes:
            for rule in rules:
                record = block(rule, size, args.steps, args.step_ms / 1e3)
                blocks.setdefault(f"{rule}/{size}", []).append(record)
    summary = {
        name: {
            "control_cpu_us_per_step_median": statistics.median(
                b["control_cpu_us_per_step"] for b in runs
            ),
            "ms_per_step_median": statistics.median(b["ms_per_step"] for b in runs),
            "pauses_per_block_median": statistics.median(b["pauses"] for b in runs),
        }
        for name, runs in blocks.items()
    }
    result = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "summary": summary,
        "blocks": blocks,
    }
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
