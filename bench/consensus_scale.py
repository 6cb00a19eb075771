"""What one consensus round costs at scale, simulated on the CPU (no network).

    python bench/consensus_scale.py                      # 1,024 and 8,192 ranks
    python bench/consensus_scale.py --ranks 64,1024,8192 --batch 1,8,32 --rounds 20

For each world size and `consensus.batch_steps`, every rank's row is encoded (one rank's
`encode_round` is timed: ranks encode in parallel), the rows are stacked into the
gathered matrix (the all-gather's result, without the network), then the control
thread's work: `decode_round` and `decide` (the detector) on every rank, and on rank 0
also decoding every rank's evidence and the evidence journal (anomaly records and the
straggler scoring). One rank
is 3 ms late at every step so the scorer has a straggler to keep. Reports, per round
and per step: milliseconds of each part, the row's bytes and the gathered bytes per
rank (what the all-gather moves to every rank). Writes `--out` (default
bench/results/consensus_scale.json).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from distanom.anomaly_journal import AnomalyJournal
from distanom.config import CaptureConfig, DetectConfig
from distanom.consensus import (
    LocalRound,
    decide,
    decode_round,
    encode_round,
    row_length,
)
from distanom.detect import Detector
from distanom.records.anomalies import StepEvidence
from distanom.rounds import RoundBuilder


def simulate(world: int, batch: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """Time `rounds` rounds of a `world`-rank job with rounds of `batch` steps."""
    rng = random.Random(seed)
    detector = Detector(DetectConfig(), CaptureConfig(reference_every_steps=0))
    journal = AnomalyJournal(world, writer=None)
    parts: dict[str, list[float]] = {
        k: [] for k in ("encode", "gather", "decode", "decode_rank0", "decide", "journal")
    }
    builders = [RoundBuilder(batch) for _ in range(2)]  # rank 0 and a typical rank
    step = 1
    for _ in range(rounds):
        for rank_builder in builders:
            for offset in range(batch):
                s = step + offset
                rank_builder.add(s, 15.0 + rng.random(), 0)
                rank_builder.add_evidence([(s, StepEvidence(10.0 + rng.random(), 3, 1.0, 0.0))])
        local0 = builders[0].take()
        typical = builders[1].take()
        began = time.perf_counter()
        row0 = encode_round(local0, batch)
        parts["encode"].append(time.perf_counter() - began)
        row = encode_round(typical, batch)
        late = encode_round(
            LocalRound(
                typical.first_step,
                tuple(d + 3.0 for d in typical.durations_ms),
                typical.step_flags,
                self_ms=typical.self_ms,
                evidence=tuple(
                    (s, StepEvidence(e.arrive_ms + 3.0, 3, 1.0, 0.0)) for s, e in typical.evidence
                ),
            ),
            batch,
        )
        began = time.perf_counter()
        matrix = torch.stack([row0, *([row] * (world - 2)), late])
        parts["gather"].append(time.perf_counter() - began)
        began = time.perf_counter()
        decode_round(matrix, batch, with_evidence=False)  # every rank
        parts["decode"].append(time.perf_counter() - began)
        began = time.perf_counter()
        result = decode_round(matrix, batch)  # rank 0: with every rank's evidence
        parts["decode_rank0"].append(time.perf_counter() - began)
        began = time.perf_counter()
        decide(result, detector, world)
        parts["decide"].append(time.perf_counter() - began)
        began = time.perf_counter()
        journal.add_judgments(detector.take_anomalies())
        for sample in result.samples:
            journal.add_times(sample.step, sample.times_ms)
        journal.add_evidence(result.evidence)
        parts["journal"].append(time.perf_counter() - began)
        step += batch
    row_bytes = row_length(batch) * 8
    per_round = {k: round(statistics.median(v) * 1e3, 3) for k, v in parts.items()}
    rank0_ms = sum(v for k, v in per_round.items() if k not in ("gather", "decode"))
    other_ms = per_round["encode"] + per_round["decode"] + per_round["decide"]
    stragglers = journal.scorer.stragglers()
    return {
        "world_size": world,
        "batch_steps": batch,
        "rounds": rounds,
        "row_floats": row_length(batch),
        "row_bytes": row_bytes,
        "gathered_bytes_per_rank": row_bytes * world,
        "median_ms_per_round": per_round,
        "rank0_ms_per_round": round(rank0_ms, 3),
        "rank0_ms_per_step": round(rank0_ms / batch, 3),
        "other_rank_ms_per_round": round(other_ms, 3),
        "other_rank_ms_per_step": round(other_ms / batch, 3),
        "straggler_found": [s.rank for s in stragglers][:3],
    }


def main() -> None:
    """Run the grid and write the result file."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", default="1024,8192")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="bench/results/consensus_scale.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for world in (int(x) for x in args.ranks.split(",")):
        for batch in (int(x) for x in args.batch.split(",")):
            # enough steps for the detector's warm-up and window (30 steps by default)
            rounds = max(args.rounds, math.ceil(40 / batch))
            result = simulate(world, batch, rounds)
            results.append(result)
            print(json.dumps(result))
    out = {
        "what": "one consensus round (encode, gather without network, decode, decide, "
        "evidence journal with straggler scoring), CPU, one thread",
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
