"""A plain DDP loop for the framework tests, on gloo (CPU): fp16-style GradScaler with
forced overflows, or gradient accumulation; one rank stalls at given iterations."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--scaler", action="store_true")
    parser.add_argument("--overflow", default="", help="iterations whose loss is made inf")
    parser.add_argument("--stall-rank", type=int, default=1)
    parser.add_argument("--stall-steps", default="")
    parser.add_argument("--cuda", action="store_true", help="on the GPU (NCCL), fp16 autocast")
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(32, 32).to(device or "cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kind = "cuda" if args.cuda else "cpu"
    scaler = torch.amp.GradScaler(kind, init_scale=2.0**8) if args.scaler else None
    overflow = {int(s) for s in args.overflow.split(",") if s}
    stalls = {int(s) for s in args.stall_steps.split(",") if s}
    skipped = 0
    for iteration in range(args.steps):
        if rank == args.stall_rank and iteration in stalls:
            time.sleep(0.6)
        for micro in range(args.accumulate):
            with torch.autocast(kind, dtype=torch.float16, enabled=args.cuda):
                loss = model(torch.randn(16, 32, device=device)).square().mean()
            loss = loss.float() / args.accumulate
            if iteration in overflow and micro == 0:
                loss = loss * float("inf")  # every rank: DDP averages the inf gradients
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += scaler.get_scale() < before
        else:
            optimizer.step()
        optimizer.zero_grad()
    print(f"amp_train: {args.steps} iterations, {skipped} skipped", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
