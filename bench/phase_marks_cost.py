"""What the step phases' marks (`distanom.phases`) cost the training thread, in one
process: a small MLP training loop (DataLoader fetch, outermost forward, backward,
optimizer step) in blocks of `--block` steps, rotating between three variants,
interleaved, `--blocks` of each: `off` (the step clock alone, as the agent always runs
it), `host` (plus the marks on the host, their per-step bookkeeping `step_ended` and
`take`) and, on a GPU, `gpu` (plus a CUDA event at each mark). Reports per variant the
median us per step, and per variant the added us per step against `off` (median of the
adjacent block pairs) with its spread; and the cost of one raw CUDA event record.

    python3 bench/phase_marks_cost.py [--device cuda] [--blocks 30] [--block 200] --out FILE
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from distanom.clock import CudaEventCalls, StepClock
from distanom.phases import PhaseMarks


def run_block(
    steps: int, loader_iter: Any, model: Any, optimizer: Any, marks: PhaseMarks | None,
    clock: StepClock | None, first: int,
) -> float:  # fmt: skip
    """Seconds for `steps` training steps, the clock marking each (with marks: their
    step ends and takes)."""
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
        step = first + index
        done = clock.mark(step) if clock is not None else ()
        if marks is not None:
            # the training thread's share: `take_raw` where the split is left to the
            # control thread (distanom.phases.resolve), `take` before that
            take = getattr(marks, "take_raw", marks.take)
            for resolved, _ms in done:
                take(resolved)
            event = clock.last_event if clock is not None else None
            marks.step_ended(step, time.perf_counter_ns(), event)
    sync()
    return time.perf_counter() - began


def event_record_us(samples: int = 2000) -> float | None:
    """The median cost of one CUDA event record through the clock's bound calls (us)."""
    if not torch.cuda.is_available():
        return None
    calls = CudaEventCalls()
    stream = calls.stream_of(calls.stream_key())
    events = [calls.new_event() for _ in range(64)]
    times = []
    for index in range(samples):
        began = time.perf_counter_ns()
        calls.record(events[index % 64], stream)
        times.append((time.perf_counter_ns() - began) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def marks_only_us(samples: int = 20000) -> float:
    """The host marks' own work per step in a tight loop (us): four marks, a step end and
    a take, without hooks or events: the floor of the training thread's share."""
    from distanom.phases import _BWD_END, _FWD_END, _FWD_START

    marks = PhaseMarks()
    take = getattr(marks, "take_raw", marks.take)  # as `run_block`
    marks.step_ended(0, time.perf_counter_ns())
    began = time.perf_counter_ns()
    for step in range(1, samples + 1):
        marks._mark(_FWD_START)
        marks._mark(_FWD_END)
        marks._mark(_BWD_END)
        marks.optimizer_started()
        marks.step_ended(step, time.perf_counter_ns())
        take(step)
    return (time.perf_counter_ns() - began) / samples / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--block", type=int, default=200)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(4096, 256))

    # one iterator for the whole run (a new one every epoch would add its own start-up)
    endless = RandomSampler(data, replacement=True, num_samples=10**9)
    loader = iter(DataLoader(data, batch_size=32, sampler=endless))

    def batches() -> Any:
        while True:
            (batch,) = next(loader)
            yield (batch.to(device, non_blocking=True),)

    stream = batches()
    variants = ["off", "host", "gpu"] if gpu else ["off", "host"]
    per_step: dict[str, list[float]] = {v: [] for v in variants}
    step = 0
    found = None
    for block in range(args.blocks):
        order = variants[block % len(variants) :] + variants[: block % len(variants)]
        for variant in order:
            clock = StepClock("cuda_event") if gpu else StepClock("host")
            marks = None
            if variant != "off":
                marks = PhaseMarks()
                if variant == "gpu":
                    marks.use_gpu(clock.event_calls)
                marks.install()
                run_block(2, stream, model, optimizer, marks, clock, step)  # finds the model
                found = marks.model_name
            else:
                run_block(2, stream, model, optimizer, None, clock, step)
            seconds = run_block(args.block, stream, model, optimizer, marks, clock, step + 2)
            if marks is not None:
                marks.uninstall()
            per_step[variant].append(seconds / args.block * 1e6)
            step += args.block + 2
    added = {}
    rng = random.Random(0)
    for variant in variants[1:]:
        diffs = [a - b for a, b in zip(per_step[variant], per_step["off"], strict=True)]
        means = sorted(
            statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(2000)
        )  # bootstrap of the mean difference
        added[variant] = {
            "median_us": statistics.median(diffs),
            "mean_us": statistics.fmean(diffs),
            "mean_ci95_us": [means[50], means[1949]],
            "stdev_us": statistics.stdev(diffs) if len(diffs) > 1 else None,
        }
    result = {
        "bench": "phase_marks_cost",
        "device": torch.cuda.get_device_name() if gpu else platform.machine(),
        "torch": torch.__version__,
        "block_steps": args.block,
        "blocks_each": args.blocks,
        "median_us_per_step": {v: statistics.median(t) for v, t in per_step.items()},
        "added_us_per_step_vs_off": added,
        "event_record_us": event_record_us(),
        "marks_only_us_per_step": marks_only_us(),
        "model_found": found,
        "us_per_step": per_step,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "us_per_step"}, indent=1))


if __name__ == "__main__":
    main()
