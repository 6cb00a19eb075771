"""Plain training loops for the whole-job benchmark: the seed's ResNet18 and an fp16 AMP
transformer loop (optionally under torch.compile). Ordinary scripts: they know nothing of
distanom, and run the same under plain `torchrun` and under `-m distanom.launch`.

    torchrun --nproc-per-node 1 bench/workloads/loops.py resnet18 --steps 1500
    torchrun --nproc-per-node 1 bench/workloads/loops.py amp --steps 1000 [--compile MODE]

On a machine without CUDA the same loops run on the CPU (tiny sizes) for smoke tests.
`build_loop` returns a workload as its optimizer and one step function, so an in-process
bench (bench/agent_cost.py) can run the same loop block by block.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from steptimer import StepTimer


def resnet18(
    device: str, small: bool, batch: int = 5
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The seed's workload: ResNet18, bf16, batch 5, MSE against random targets (a larger
    `batch` makes its steps GPU-bound)."""
    import torchvision.models as models

    dtype = torch.bfloat16
    model = models.resnet18().to(device).to(dtype)
    size = 32 if small else 224
    inputs = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
    target = torch.randn(batch, 1000, device=device, dtype=dtype)
    return model, inputs, target


def transformer(device: str, small: bool) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A small encoder stack (fp32 weights; the loop runs it under fp16 autocast)."""
    d = 64 if small else 512
    layer = torch.nn.TransformerEncoderLayer(d, 8, 4 * d, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2 if small else 6).to(device)
    seq = 16 if small else 256
    inputs = torch.randn(8, seq, d, device=device)
    return model, inputs, torch.randn(8, seq, d, device=device)


@dataclass(frozen=True)
class Loop:
    """A workload ready to train: the optimizer whose step ends a step, and one step."""

    optimizer: torch.optim.Optimizer
    step: Callable[[], None]


def build_loop(
    workload: str, device: str, small: bool, compile_mode: str | None = None, batch: int = 5
) -> Loop:
    """The `workload` ("resnet18" or "amp") on `device`, optionally under torch.compile
    (`batch`: ResNet18's batch size)."""
    torch.manual_seed(0)
    if workload == "resnet18":
        model, inputs, target = resnet18(device, small=small, batch=batch)
    else:
        model, inputs, target = transformer(device, small=small)
    if compile_mode:
        model = torch.compile(model, mode=compile_mode)  # type: ignore[assignment]
    cuda = device.startswith("cuda")
    if workload == "resnet18":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = None
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(device.split(":")[0], enabled=cuda)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if scaler is None:
            loss = torch.nn.functional.mse_loss(model(inputs), target)
            loss.backward()
            optimizer.step()
        else:
            with torch.autocast(device.split(":")[0], dtype=torch.float16, enabled=cuda):
                loss = torch.nn.functional.mse_loss(model(inputs), target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    return Loop(optimizer, step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workload", choices=["resnet18", "amp"])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--compile", default=None, help="torch.compile mode")
    parser.add_argument("--batch", type=int, default=5, help="ResNet18's batch size")
    args = parser.parse_args()
    if args.workload != "resnet18" and args.batch != 5:
        parser.error("--batch is ResNet18's batch size")

    cuda = torch.cuda.is_available()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    loop = build_loop(
        args.workload, device, small=not cuda, compile_mode=args.compile, batch=args.batch
    )
    warmup = min(100, args.steps // 5)
    timer = StepTimer(warmup, chunk=min(100, max(5, (args.steps - warmup) // 10)))
    for _ in range(args.steps):
        loop.step()
        timer.step_end()
    extra = {"batch": args.batch} if args.workload == "resnet18" else {}
    timer.finish(workload=args.workload, compile=args.compile, **extra)


if __name__ == "__main__":
    main()
