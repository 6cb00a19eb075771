"""What the live metrics cost: the control thread's CPU per round, and one scrape.

    python bench/metrics_cost.py                    # 8 ranks per node, rounds of 8/32/128 steps
    python bench/metrics_cost.py --rounds 400 --out bench/results/metrics_cost_cpu.json

`NodeMetrics.after_round` is timed (thread CPU time) on a node of `--local` ranks in two
roles: rank 0 (it listens to rank 0's anomaly journal, which the control loop feeds
anyway: the metrics add the histogram, the scores and the tracing-cost read) and the
local rank 0 of another node (it keeps a journal of its own: also the evidence fold and
straggler scoring of every rank, which rank 0 alone did before). The server is not
started (its start is timed once apart). One rank is 3 ms late at every step, and one
step in 50 is an anomaly judged with every rank's evidence. A scrape (snapshot, metric
families, text) is timed as prometheus_client's handler runs it.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from distanom.anomaly_journal import AnomalyJournal
from distanom.config import MetricsConfig
from distanom.consensus import EvidenceBlock, RoundResult
from distanom.detect import AnomalyJudgment, StepSample
from distanom.metrics import NodeMetrics
from distanom.metrics_server import metric_families
from distanom.records.anomalies import StepEvidence
from distanom.world import WorldInfo


class _Duty:
    def report(self) -> dict[str, Any]:
        return {"effective_overhead_pct": 0.7}


class _Evidence:
    def __init__(self, journal: AnomalyJournal | None) -> None:
        self.journal = journal


class _Source:
    def __init__(self, journal: AnomalyJournal | None) -> None:
        self.run = None
        self.hang_watch = None
        self.duty = _Duty()
        self.evidence = _Evidence(journal)


def _rounds(world: int, steps: int, rounds: int, seed: int = 0) -> list[Any]:
    rng = random.Random(seed)
    out = []
    step = 1
    for _ in range(rounds):
        samples, items, judged = [], [], []
        for _ in range(steps):
            times = tuple(10.0 + rng.random() for _ in range(world))
            if step % 50 == 0:
                times = tuple(t + (40.0 if r == 1 else 0.0) for r, t in enumerate(times))
                judged.append(AnomalyJudgment(step, max(times), 10.5, 15.75, False, "condition", 1))
            samples.append(StepSample(step, times, traced=False))
            for rank in range(world):
                late = 3.0 if rank == 1 else 0.0
                items.append((rank, step, StepEvidence(5.0 + late + rng.random(), 1, 4.0, 0.0)))
            step += 1
        block = EvidenceBlock.from_items(world, items, lists=True)
        result = RoundResult(tuple(samples), (0,) * world, None, (step,) * world, block)
        out.append((result, judged))
    return out


def _time_role(world: int, local: int, rank: int, steps: int, rounds: int) -> dict[str, Any]:
    shared = AnomalyJournal(world, None) if rank == 0 else None
    info = WorldInfo(rank, world, 0, local, rank // local, "node", None, None, "job")
    metrics = NodeMetrics(MetricsConfig(port=9400), info, _Source(shared), lambda *a: None)
    metrics._start = lambda: True  # type: ignore[method-assign]  # no server: the fold alone
    data = _rounds(world, steps, rounds)
    per_round = []
    for result, judged in data:
        if shared is not None:  # what the control loop does on rank 0 anyway, untimed
            shared.add_judgments(judged)
            shared.add_times_many((s.step, s.times_ms) for s in result.samples)
            shared.add_evidence(result.evidence)
        began = time.thread_time_ns()
        metrics.after_round(result, judged)
        per_round.append((time.thread_time_ns() - began) / 1e3)
    kept = per_round[len(per_round) // 10 :]  # the first rounds warm caches up
    anomalies = sum(count for _, count in metrics.snapshot().anomalies)
    return {
        "world": world,
        "local_ranks": local,
        "rank": rank,
        "role": "rank 0 (shared journal)" if rank == 0 else "another node's leader (own journal)",
        "steps_per_round": steps,
        "rounds": len(kept),
        "median_us_per_round": round(statistics.median(kept), 1),
        "p90_us_per_round": round(sorted(kept)[int(0.9 * len(kept))], 1),
        "median_us_per_step": round(statistics.median(kept) / steps, 2),
        "anomalies_counted": anomalies,
    }


def _time_scrape(local: int, repeats: int) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry, generate_latest

    world = 2 * local
    metrics = NodeMetrics(
        MetricsConfig(port=9400),
        WorldInfo(0, world, 0, local, 0, "node", None, None, "job"),
        _Source(None),
        lambda *a: None,
    )
    metrics._start = lambda: True  # type: ignore[method-assign]
    for result, _ in _rounds(world, 32, 4):
        metrics.after_round(result, [])

    class Collector:
        def describe(self) -> list[Any]:
            return []

        def collect(self) -> Any:
            return metric_families(metrics.snapshot())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())  # type: ignore[arg-type]
    times = []
    for _ in range(repeats):
        began = time.thread_time_ns()
        body = generate_latest(registry)
        times.append((time.thread_time_ns() - began) / 1e3)
    return {
        "local_ranks": local,
        "bytes": len(body),
        "median_us": round(statistics.median(times), 1),
        "repeats": repeats,
    }


def main() -> None:
    """Parse arguments, time, print and write the result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local", type=int, default=8)
    parser.add_argument("--world", type=int, default=16)
    parser.add_argument("--steps", default="8,32,128")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for steps in (int(s) for s in args.steps.split(",")):
        for rank in (0, args.local):
            row = _time_role(args.world, args.local, rank, steps, args.rounds)
            rows.append(row)
            print(json.dumps(row))
    scrape = _time_scrape(args.local, 200)
    print(json.dumps({"scrape": scrape}))
    result = {
        "host": platform.node(),
        "python": platform.python_version(),
        "rounds": rows,
        "scrape": scrape,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
