"""The seed's workload as an ordinary training script: ResNet18, bf16, batch 5, SGD.

Knows nothing of distanom; run it as `torchrun --nproc-per-node N -m distanom.launch
examples/seed_resnet.py ...` (one GPU per rank, NCCL when N > 1). Slow steps are injected
on known, 0-based optimizer steps:

  --sleep-steps 100,200 --sleep-cycles 20000000   GPU delay (torch.cuda._sleep, ~10 ms
                                                  on an H200 at 1.98 GHz), on --sleep-rank
  --all-sleep-steps 150                           the same delay on every rank at once
  --slow-steps 1800-2099 --slow-cycles 40000000   a lasting slowdown: a GPU delay on
                                                  each of these steps, on --sleep-rank
  --matmul-steps 120 --matmul-count 2             the seed's anomaly: extra 8192^3 bf16
                                                  matmuls, on --matmul-rank
  --stall-steps 150 --stall-s 0.05                host stall before the forward pass
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def steps(text: str) -> set[int]:
    """`100,200` or a range `1800-2099` (both ends in), or both mixed."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        first, _, last = part.partition("-")
        if part:
            out.update(range(int(first), int(last or first) + 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=5)
    parser.add_argument("--sleep-steps", type=steps, default=set())
    parser.add_argument("--sleep-rank", type=int, default=0)
    parser.add_argument("--sleep-cycles", type=int, default=20_000_000)
    parser.add_argument("--matmul-steps", type=steps, default=set())
    parser.add_argument("--matmul-rank", type=int, default=0)
    parser.add_argument("--matmul-count", type=int, default=2)
    parser.add_argument("--all-sleep-steps", type=steps, default=set(), help="every rank")
    parser.add_argument("--slow-steps", type=steps, default=set())
    parser.add_argument("--slow-cycles", type=int, default=40_000_000)
    parser.add_argument("--stall-steps", type=steps, default=set())
    parser.add_argument("--stall-rank", type=int, default=0)
    parser.add_argument("--stall-s", type=float, default=0.05)
    args = parser.parse_args()
    try:
        import torchvision.models as models
    except ImportError:
        raise SystemExit("seed_resnet.py: needs torchvision (pip install torchvision)") from None
    if not torch.cuda.is_available():
        raise SystemExit("seed_resnet.py: needs a CUDA GPU per rank")

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    dtype = torch.bfloat16
    model: torch.nn.Module = models.resnet18().cuda().to(dtype)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=dtype)
    target = torch.randn(args.batch, 1000, device="cuda", dtype=dtype)
    extra_a = extra_b = None
    if args.matmul_steps:
        extra_a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        extra_b = torch.randn(8192, 8192, device="cuda", dtype=dtype)

    # Run each injected kernel once first: its first launch loads its module (CUDA lazy
    # loading) and, for the matmuls, sets cuBLAS up; on an H200 that stalled the host
    # 5-14 ms, which would have blurred an injected GPU delay into a host stall.
    if args.sleep_steps or args.all_sleep_steps or args.slow_steps:
        torch.cuda._sleep(1000)
    if extra_a is not None and extra_b is not None:
        (extra_a @ extra_b).sum()
    torch.cuda.synchronize()

    for step in range(args.steps):
        if rank == args.stall_rank and step in args.stall_steps:
            time.sleep(args.stall_s)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(inputs), target)
        loss.backward()
        # injections go before optimizer.step(): its return ends the step distanom counts
        if (rank == args.sleep_rank and step in args.sleep_steps) or step in args.all_sleep_steps:
            torch.cuda._sleep(args.sleep_cycles)
        if rank == args.sleep_rank and step in args.slow_steps:
            torch.cuda._sleep(args.slow_cycles)
        if rank == args.matmul_rank and step in args.matmul_steps:
            x = extra_a
            for _ in range(args.matmul_count):
                x = x @ extra_b
            x.sum()
        optimizer.step()
    torch.cuda.synchronize()
    if distributed:
        dist.destroy_process_group()
    if rank == 0:
        print(f"seed_resnet: {args.steps} steps done")


if __name__ == "__main__":
    main()
