"""Does distanom's Flight Recorder reader see the collectives of an NCCL group?

    TORCH_FR_BUFFER_SIZE=256 python3 bench/probes/fr_nccl_probe.py [--out FILE]

One process, a world of one on one GPU: five NCCL all-reduces and one gloo all-reduce,
then `distanom.flight_recorder.read_dump()`: how many entries each recorder gave
(`source`: "nccl" or "generic") and their ops. Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from distanom.flight_recorder import read_dump


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "256")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    gloo = dist.new_group(backend="gloo")
    value = torch.ones(1024, device="cuda")
    for _ in range(5):
        dist.all_reduce(value)
    dist.all_reduce(torch.ones(4), group=gloo)
    torch.cuda.synchronize()
    dump = read_dump()
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "entries_by_source": dict(Counter(e.source for e in dump.entries)),
        "ops": [(e.source, e.op, e.state) for e in dump.entries],
        "note": dump.note,
    }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
