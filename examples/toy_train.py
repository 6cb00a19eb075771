"""A tiny DDP training script with injectable slow steps, for the demo and the tests.

It knows nothing of distanom: run it under `torchrun ... -m distanom.launch toy_train.py`.
With a GPU for every local rank it trains over NCCL, one GPU per rank; otherwise on
CPU over gloo. Injections happen on known steps (0-based optimizer steps):

  --stall-rank R --stall-steps 30,60 --stall-s 0.5   host stall (time.sleep) before the
                                                      forward pass, on rank R only
  --gpu-sleep-rank R --gpu-sleep-steps 40 --gpu-sleep-cycles 20000000
                                                      extra GPU work (torch.cuda._sleep)
  --all-slow-steps 50 --all-slow-s 0.3               every rank slows down at once
  --step-sleep 0.02                                   every step takes at least this long
  --exit-rank R --exit-step K                         rank R leaves at step K (os._exit(0));
                                                      with --no-ddp the others carry on
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def parse_steps(text: str) -> set[int]:
    return {int(part) for part in text.split(",") if part.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--stall-rank", type=int, default=-1)
    parser.add_argument("--stall-steps", type=parse_steps, default=set())
    parser.add_argument("--stall-s", type=float, default=0.5)
    parser.add_argument(
        "--stall-after-backward", action="store_true",
        help="stall between backward() and optimizer.step(), after the gradients' all-reduce",
    )  # fmt: skip
    parser.add_argument("--gpu-sleep-rank", type=int, default=-1)
    parser.add_argument("--gpu-sleep-steps", type=parse_steps, default=set())
    parser.add_argument("--gpu-sleep-cycles", type=int, default=20_000_000)
    parser.add_argument("--all-slow-steps", type=parse_steps, default=set())
    parser.add_argument("--all-slow-s", type=float, default=0.3)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--exit-rank", type=int, default=-1)
    parser.add_argument("--exit-step", type=int, default=-1)
    parser.add_argument("--no-ddp", action="store_true", help="no gradient all-reduce")
    parser.add_argument("--exit-code", type=int, default=0, help="exit with this status")
    args = parser.parse_args()

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cuda") if use_cuda else torch.device("cpu")

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(
        nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 1)
    ).to(device)
    if distributed and not args.no_ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(args.batch, args.width, device=device)
    targets = torch.randn(args.batch, 1, device=device)

    for step in range(args.steps):
        if rank == args.exit_rank and step == args.exit_step:
            os._exit(0)  # a rank that vanishes without any cleanup
        if args.step_sleep:
            time.sleep(args.step_sleep)
        stall = rank == args.stall_rank and step in args.stall_steps
        if stall and not args.stall_after_backward:
            time.sleep(args.stall_s)
        if step in args.all_slow_steps:
            time.sleep(args.all_slow_s)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        if stall and args.stall_after_backward:
            time.sleep(args.stall_s)
        if use_cuda and rank == args.gpu_sleep_rank and step in args.gpu_sleep_steps:
            torch.cuda._sleep(args.gpu_sleep_cycles)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if use_cuda:
        torch.cuda.synchronize()
    if distributed:
        if not args.no_ddp:
            dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        print(f"toy_train: {args.steps} steps done")
    raise SystemExit(args.exit_code)


if __name__ == "__main__":
    main()
