"""A Lightning Trainer job for the framework tests: a tiny MLP, DDP on gloo (CPU) under
torchrun; one rank stalls at given optimizer steps via a callback."""

from __future__ import annotations

import argparse
import os
import time

import lightning as L
import torch


class Stall(L.Callback):
    """Sleep on one rank at the start of the given optimizer steps (global_step, from 0)."""

    def __init__(self, rank: int, steps: set[int], seconds: float) -> None:
        self.rank, self.steps, self.seconds = rank, steps, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if int(os.environ["RANK"]) == self.rank and trainer.global_step in self.steps:
            time.sleep(self.seconds)


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--stall-rank", type=int, default=1)
    parser.add_argument("--stall-steps", default="")
    parser.add_argument("--cuda", action="store_true", help="on the GPU, 16-mixed (NCCL)")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(20_000, 16), torch.randn(20_000, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    stalls = {int(s) for s in args.stall_steps.split(",") if s}
    trainer = L.Trainer(
        accelerator="gpu" if args.cuda else "cpu",
        precision="16-mixed" if args.cuda else "32-true",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Stall(args.stall_rank, stalls, 0.6)],
    )
    trainer.fit(Tiny(), loader)
    print(f"lightning: {trainer.global_step} steps done", flush=True)


if __name__ == "__main__":
    main()
