"""Regenerate tests/data/cpu_ddp_gloo_rank{0,1}.json.gz: a real CPU-only torch.profiler trace.

Run with `torchrun --nproc-per-node 2 tests/data/tools/make_cpu_trace.py OUTDIR`. Each rank
trains a tiny MLP under DistributedDataParallel (gloo) for a few steps with
torch.profiler (CPU activity only) and writes `OUTDIR/cpu_ddp_gloo_rank<R>.json.gz`.
A `distanom::step_end` record_function mimics distanom's own markers, which the host
timeline must ignore. Not imported by the tests; kept so the fixture can be rebuilt.
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function, schedule


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(32, 64)
    target = torch.randn(32, 8)

    def save(prof: profile) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(raw)
            dest = os.path.join(out_dir, f"cpu_ddp_gloo_rank{rank}.json.gz")
            with open(raw, "rb") as src, gzip.open(dest, "wb", compresslevel=9) as dst:
                shutil.copyfileobj(src, dst)

    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=save,
    ) as prof:
        for _ in range(6):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(data), target)
            loss.backward()
            opt.step()
            with record_function("distanom::step_end"):
                pass
            prof.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
