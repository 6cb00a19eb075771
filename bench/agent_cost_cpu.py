"""What the agent itself costs a launch-bound loop with tracing off, in one process.

    python3 bench/agent_cost_cpu.py --out bench/results/agent_cost_cpu.json [--rounds 6]

A CPU loop of many tiny ops per step (12 linear layers of 16, batch 4, SGD: ~0.4 ms a
step, all Python dispatch, as launch-bound GPU loops are) runs in blocks: no agent, and
the agent (`tracer.backend: none`, world size 1) at each `consensus.batch_steps` given,
in an order that rotates from round to round. Each block installs a fresh agent, warms
up 100 steps, times 400. The figure is the median ms per step of each variant and its
ratio to the no-agent blocks: the control thread's GIL-holding work per step is what the
training thread pays. In-process, so free of the process-to-process spread.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from distanom.agent import Agent
from distanom.config import load_config
from distanom.world import WorldInfo


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batches", default="1,8")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(12)])
    optimizer = torch.optim.SGD(layers.parameters(), lr=1e-3)
    inputs = torch.randn(4, 16)

    def timed(steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            layers(inputs).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return (time.perf_counter() - started) * 1000 / steps

    def block(variant: str) -> float:
        if variant == "none":
            timed(100)
            return timed(400)
        config = load_config(None, ["tracer.backend=none", f"consensus.batch_steps={variant}"])
        agent = Agent(config, WorldInfo.from_env({}), Path(tempfile.mkdtemp()) / "runs")
        agent.install()
        try:
            timed(100)
            return timed(400)
        finally:
            agent.close()

    variants = ["none", *args.batches.split(",")]
    blocks: dict[str, list[float]] = {v: [] for v in variants}
    for round_number in range(args.rounds):
        shift = round_number % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            blocks[variant].append(round(block(variant), 4))
    base = statistics.median(blocks["none"])
    result: dict[str, Any] = {
        "host": platform.node(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "blocks_ms_per_step": blocks,
        "median_ms_per_step": {v: round(statistics.median(b), 4) for v, b in blocks.items()},
        "ratio_to_no_agent": {v: round(statistics.median(b) / base, 3) for v, b in blocks.items()},
        "note": "variant names: none = no agent; N = agent with consensus.batch_steps=N",
    }
    print(json.dumps(result["ratio_to_no_agent"]))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
