"""What the step phases' marks (`distanom.phases`) cost the training thread, in one
process: a small MLP training loop (DataLoader fetch, outermost forward, backward,
optimizer step) in blocks of `--block` steps, alternating between the marks installed
(with their per-step bookkeeping: `step_ended` and `take`, and CUDA events on a GPU) and
not, interleaved, `--blocks` of each. Reports the per-step time of each half, the
difference in us per step and its spread over block pairs.

    python3 bench/phase_marks_cost.py [--device cuda] [--blocks 30] [--block 200] --out FILE
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from distanom.clock import CudaEventCalls, StepClock
from distanom.phases import PhaseMarks


def run_block(
    steps: int, loader_iter: Any, model: Any, optimizer: Any, marks: PhaseMarks | None,
    clock: StepClock | None, first: int,
) -> float:  # fmt: skip
    """Seconds for `steps` training steps (with marks: their step ends and takes)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    began = time.perf_counter()
    for index in range(steps):
        (batch,) = next(loader_iter)
        loss = model(batch).square().mean()
        loss.backward()
        if marks is not None:
            marks.optimizer_started()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if marks is not None:
            step = first + index
            event = None
            if clock is not None:
                for done, _ms in clock.mark(step):
                    marks.take(done)
                event = clock.last_event
            marks.step_ended(step, time.perf_counter_ns(), event)
    sync()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--block", type=int, default=200)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(4096, 256))

    def batches() -> Any:
        while True:
            for (batch,) in DataLoader(data, batch_size=32):
                yield (batch.to(device, non_blocking=True),)

    stream = batches()
    marks = PhaseMarks()
    clock = StepClock("cuda_event") if device.type == "cuda" else None
    run_block(args.block, stream, model, optimizer, None, None, 0)  # warm up
    on: list[float] = []
    off: list[float] = []
    step = 0
    for pair in range(args.blocks):
        order = ("on", "off") if pair % 2 == 0 else ("off", "on")
        for half in order:
            if half == "on":
                marks = PhaseMarks()
                if clock is not None:
                    marks.use_gpu(CudaEventCalls())
                marks.install()
                run_block(1, stream, model, optimizer, marks, clock, step)  # finds the model
                seconds = run_block(args.block, stream, model, optimizer, marks, clock, step + 1)
                marks.uninstall()
                on.append(seconds / args.block * 1e6)
            else:
                seconds = run_block(args.block, stream, model, optimizer, None, None, 0)
                off.append(seconds / args.block * 1e6)
            step += args.block + 1
    diffs = [a - b for a, b in zip(on, off, strict=True)]
    result = {
        "bench": "phase_marks_cost",
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "block_steps": args.block,
        "blocks_each": args.blocks,
        "us_per_step_on": on,
        "us_per_step_off": off,
        "median_us_on": statistics.median(on),
        "median_us_off": statistics.median(off),
        "added_us_per_step_median_of_pairs": statistics.median(diffs),
        "added_us_per_step_mean_of_pairs": statistics.fmean(diffs),
        "pair_diff_stdev_us": statistics.stdev(diffs) if len(diffs) > 1 else None,
        "model_found": marks.model_name,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("us_per")}, indent=1))


if __name__ == "__main__":
    main()
