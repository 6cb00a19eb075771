"""A Hugging Face Trainer job for the framework tests: a tiny GPT-2 built from a config
(no download), gloo on CPU; one rank stalls at given optimizer steps via a callback."""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Stall(TrainerCallback):
    """Sleep on one rank at the start of the given optimizer steps (global_step, from 0)."""

    def __init__(self, rank: int, steps: set[int], seconds: float) -> None:
        self.rank, self.steps, self.seconds = rank, steps, seconds

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if int(os.environ["RANK"]) == self.rank and state.global_step in self.steps:
            time.sleep(self.seconds)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--stall-rank", type=int, default=1)
    parser.add_argument("--stall-steps", default="")
    parser.add_argument("--out", default="hf_out")
    parser.add_argument("--cuda", action="store_true", help="on the GPU, fp16 (NCCL)")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=args.accumulate,
        learning_rate=1e-3,
        use_cpu=not args.cuda,
        fp16=args.cuda,
        ddp_backend=None if args.cuda else "gloo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    stalls = {int(s) for s in args.stall_steps.split(",") if s}
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Tokens(),
        callbacks=[Stall(args.stall_rank, stalls, 0.6)],
    )
    trainer.train()
    print(f"hf_trainer: {trainer.state.global_step} steps done", flush=True)


if __name__ == "__main__":
    main()
