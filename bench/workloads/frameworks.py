"""Framework loops for the whole-job benchmark: a Hugging Face `Trainer` on a small GPT-2
built from a config (no download) and a Lightning `Trainer` on a small MLP. Ordinary
scripts: they know nothing of distanom.

    torchrun --nproc-per-node 1 bench/workloads/frameworks.py hf --steps 1000
    torchrun --nproc-per-node 1 bench/workloads/frameworks.py lightning --steps 2000

Each times its optimizer steps through the framework's own callback (StepTimer).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from steptimer import StepTimer


class RandomTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token ids as a causal-LM dataset (labels = inputs)."""

    def __init__(self, count: int, seq: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, seq), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def run_hf(steps: int, timer: StepTimer) -> None:
    """A GPT-2 (4 layers, d 256) trained by transformers.Trainer for `steps` steps."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    class Timed(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            timer.step_end()

    cuda = torch.cuda.is_available()
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=5000, n_positions=256)
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        arguments = TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=8,
            bf16=cuda,
            use_cpu=not cuda,
            logging_steps=10**9,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        data = RandomTokens(8 * 64, 128, config.vocab_size)
        Trainer(model=model, args=arguments, train_dataset=data, callbacks=[Timed()]).train()


def run_lightning(steps: int, timer: StepTimer) -> None:
    """A 4-layer MLP trained by a Lightning Trainer for `steps` steps."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    class Mlp(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            layers: list[torch.nn.Module] = []
            for _ in range(4):
                layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*layers)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timed(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            timer.step_end()

    x = torch.randn(64 * 32, 512)
    data = torch.utils.data.TensorDataset(x, torch.randn(64 * 32, 512))
    loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=False)
    cuda = torch.cuda.is_available()
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timed()],
    )
    trainer.fit(Mlp(), loader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("framework", choices=["hf", "lightning"])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    warmup = min(100, args.steps // 5)
    timer = StepTimer(warmup, chunk=min(100, max(5, (args.steps - warmup) // 10)))
    (run_hf if args.framework == "hf" else run_lightning)(args.steps, timer)
    timer.finish(workload=args.framework)


if __name__ == "__main__":
    main()
