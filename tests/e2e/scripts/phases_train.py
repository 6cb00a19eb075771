"""A DDP loop as users write it (DataLoader workers over a DistributedSampler, AdamW,
`loss.item()` logging), on gloo (CPU) or NCCL, with one fault per kind at a chosen rank
and step: `--faults KIND:RANK:STEP,...`, KIND one of
- `data`: the DataLoader worker's `__getitem__` sleeps for that step's batch,
- `forward`: the model's forward keeps the CPU busy,
- `tail`: a sleep between `loss.backward()` and `optimizer.step()`,
- `optimizer`: a sleep inside the optimizer subclass's own `step`,
- `gc`: a full Python garbage collection over a million objects,
- `gpu_backward` (CUDA): a GPU-side delay inside the backward pass,
- `host`: a sleep before the batch is used (before forward).
`--scaler` runs fp16 autocast with a GradScaler (it synchronizes every step); `--no-sync`
drops the per-step `loss.item()`, so (without a scaler) the host never waits.
`--step-times PREFIX` writes each step's own wall time (ms, from one batch's arrival to the
next) and every Python garbage collection ([step, generation, ms]) to PREFIX.rank<R>.json,
the same with or without distanom (bench/noise_rate.py)."""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FAULT_S = 0.4
BATCH = 8


class Faults:
    def __init__(self, spec: str, rank: int) -> None:
        self.at: dict[str, set[int]] = {}
        for item in filter(None, spec.split(",")):
            kind, fault_rank, step = item.split(":")
            if int(fault_rank) == rank:
                self.at.setdefault(kind, set()).add(int(step))

    def __call__(self, kind: str, step: int) -> bool:
        return step in self.at.get(kind, ())


class Items(Dataset[torch.Tensor]):
    """Random inputs; the first item of a faulted step's batch sleeps in the worker."""

    def __init__(self, steps: int, world: int, data_steps: set[int]) -> None:
        self.world, self.data_steps, self.length = world, data_steps, steps * BATCH * world

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        position = (
            index // self.world
        )  # DistributedSampler without shuffling: rank r gets r, r+W, ...
        if position % BATCH == 0 and position // BATCH in self.data_steps:
            time.sleep(FAULT_S)
        return torch.full((64,), float(index % 7))


class SlowAdamW(torch.optim.AdamW):
    def __init__(self, params: Any, steps: set[int]) -> None:
        super().__init__(params, lr=1e-3)
        self.calls, self.slow = 0, steps

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.calls in self.slow:
            time.sleep(FAULT_S)
        self.calls += 1
        return super().step(closure)


class Net(torch.nn.Module):
    def __init__(self, busy: set[int], gpu_delay: set[int]) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU())
        self.head = torch.nn.Linear(128, 8)
        self.calls, self.busy, self.gpu_delay = 0, busy, gpu_delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls in self.busy:
            until = time.perf_counter() + FAULT_S
            while time.perf_counter() < until:
                pass
        hidden = self.body(x)
        if self.calls in self.gpu_delay:
            hidden = _GpuDelayInBackward.apply(hidden)
        self.calls += 1
        return self.head(hidden)


class _GpuDelayInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(int(FAULT_S * 1.4e9))  # ~FAULT_S of GPU cycles at ~1.4-2 GHz
        return grad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--faults", default="")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--scaler", action="store_true")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--no-sync", action="store_true", help="no loss.item(): never waits")
    parser.add_argument(
        "--step-times", default="", help="write own step times to PREFIX.rank<R>.json"
    )
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.cuda else torch.device("cpu")
    )
    if args.cuda:
        torch.cuda.set_device(device)
    faults = Faults(args.faults, rank)
    torch.manual_seed(0)
    items = Items(args.steps, world, faults.at.get("data", set()))
    loader = DataLoader(
        items,
        batch_size=BATCH,
        sampler=DistributedSampler(items, shuffle=False),
        num_workers=args.workers,
        pin_memory=args.cuda,
    )
    model = DistributedDataParallel(
        Net(faults.at.get("forward", set()), faults.at.get("gpu_backward", set())).to(device)
    )
    optimizer = SlowAdamW(model.parameters(), faults.at.get("optimizer", set()))
    scaler = torch.amp.GradScaler("cuda") if args.scaler else None
    garbage: list[Any] = []
    stamps: list[float] = []
    collections: list[list[float]] = []  # [step, generation, ms] of each Python GC
    if args.step_times:
        started: list[float] = [0.0]

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                spent = round((time.perf_counter() - started[0]) * 1e3, 3)
                collections.append([len(stamps), info["generation"], spent])

        gc.callbacks.append(on_gc)
    for step, batch in enumerate(loader):
        if args.step_times:
            stamps.append(time.perf_counter())
        if faults("host", step):
            time.sleep(FAULT_S)
        batch = batch.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.float16, enabled=args.scaler):
            loss = model(batch).square().mean()
        (scaler.scale(loss) if scaler else loss).backward()
        if faults("tail", step):
            time.sleep(FAULT_S)
        if faults("gc", step):
            garbage = [[i] for i in range(1_000_000)]
            gc.collect()
            garbage = []
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        if not args.no_sync:
            value = loss.item()  # logged as users do: a synchronize every step on the GPU
            if not step % 50:
                print(f"step {step} loss {value:.4f}", flush=True)
    del garbage
    if args.step_times:
        times = [round((b - a) * 1e3, 4) for a, b in itertools.pairwise(stamps)]
        with open(f"{args.step_times}.rank{rank}.json", "w") as handle:
            json.dump(
                {"times": times, "gc": collections, "starts_ns": [int(s * 1e9) for s in stamps]},
                handle,
            )
    print(f"phases_train: {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
