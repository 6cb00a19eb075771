"""What one Flight Recorder read costs, part by part, and which parts hold the GIL.

    TORCH_FR_BUFFER_SIZE=256 python3 bench/probes/fr_read_cost.py [--gloo] [--out FILE]

One process, a world of one (NCCL on the GPU, or gloo with `--gloo`): fills the buffer with
all-reduces, then times 20 reads split into the C++ dump (`_dump_nccl_trace` or
`_dump_fr_trace`), `pickle.loads` and distanom's `parse_dump`. A second thread that
only counts while it holds the GIL says whether each part let it run (ticks during the
part) or held the GIL throughout (no ticks).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distanom.flight_recorder import parse_dump


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gloo", action="store_true")
    parser.add_argument("--reads", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "256")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    backend = "gloo" if args.gloo else "nccl"
    dist.init_process_group(backend, rank=0, world_size=1)
    device = torch.device("cpu") if args.gloo else torch.device("cuda", 0)
    tensor = torch.ones(1024, device=device)
    for _ in range(int(os.environ["TORCH_FR_BUFFER_SIZE"]) * 2):
        dist.all_reduce(tensor)
    if not args.gloo:
        torch.cuda.synchronize()
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace" if args.gloo else "_dump_nccl_trace")
    ticks = [0]
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)  # gives the GIL back at once: ticks only while the main thread lets go

    threading.Thread(target=tick, daemon=True).start()
    time.sleep(0.01)
    parts: dict[str, list[float]] = {"dump": [], "unpickle": [], "parse": []}
    part_ticks: dict[str, list[int]] = {"dump": [], "unpickle": [], "parse": []}
    entries, raw_bytes = 0, 0
    for _ in range(args.reads):
        for _ in range(16):
            dist.all_reduce(tensor)
        if not args.gloo:
            torch.cuda.synchronize()
        time.sleep(0.005)
        t0, k0 = time.perf_counter(), ticks[0]
        raw = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
        t1, k1 = time.perf_counter(), ticks[0]
        data = pickle.loads(raw)
        t2, k2 = time.perf_counter(), ticks[0]
        parsed = parse_dump(data)
        t3, k3 = time.perf_counter(), ticks[0]
        parts["dump"].append((t1 - t0) * 1e3)
        parts["unpickle"].append((t2 - t1) * 1e3)
        parts["parse"].append((t3 - t2) * 1e3)
        part_ticks["dump"].append(k1 - k0)
        part_ticks["unpickle"].append(k2 - k1)
        part_ticks["parse"].append(k3 - k2)
        entries, raw_bytes = len(parsed), len(raw)
    stop.set()
    result = {
        "probe": "fr_read_cost",
        "device": "cpu" if args.gloo else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "backend": backend,
        "buffer": int(os.environ["TORCH_FR_BUFFER_SIZE"]),
        "entries": entries,
        "dump_bytes": raw_bytes,
        "median_ms": {k: round(statistics.median(v), 3) for k, v in parts.items()},
        "per_read_ms": {k: [round(x, 3) for x in v] for k, v in parts.items()},
        "other_thread_ticks_median": {k: statistics.median(v) for k, v in part_ticks.items()},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "per_read_ms"}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
