"""Synthetic folders of finished runs for `distanom hosts` (not a test module; also used
by bench/hosts_scan.py).

Each run is written through the product's own record writers: run.json (hosts per
rank), anomalies.jsonl lines whose arrival evidence makes the report's evidence verdict
name one rank (host stall), stragglers.json and hang records. `make_fleet` spreads runs
over a pool of hosts, blames random ranks as background noise and, where the planted bad
host takes part, blames its `bad_local_rank` more often.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from distanom.records.anomalies import AnomalyRecord, AnomalyWriter, StepEvidence, write_stragglers
from distanom.records.hangs import HangRecord, write_hang_record
from distanom.records.run_info import build_run_info, write_run_info
from distanom.rundir import RunDir

VERSIONS: dict[str, str | None] = {
    "distanom": "0.1.0",
    "torch": "2.13",
    "cuda": None,
    "python": "3.11",
}
MEDIAN_MS = 100.0
ARRIVE_MS = 50.0  # every rank's usual arrival at the step's last collective
CPU_MS = 80.0


def slow_step(step: int, world: int, culprit: int, late_ms: float = 200.0) -> AnomalyRecord:
    """A step `late_ms` over the median because `culprit` arrived that late at the
    step's last collective, off the CPU: the evidence verdict is `culprit` - host_stall."""
    evidence = tuple(
        StepEvidence(ARRIVE_MS + (late_ms if rank == culprit else 0.0), 4, CPU_MS, 0.0, 1.0)
        for rank in range(world)
    )
    return AnomalyRecord(
        step=step,
        step_ms=MEDIAN_MS + late_ms,
        median_ms=MEDIAN_MS,
        threshold_ms=1.5 * MEDIAN_MS,
        traced=False,
        judged_by="condition",
        slowest_rank=culprit,
        durations_ms=tuple(MEDIAN_MS + late_ms for _ in range(world)),
        evidence=evidence,
        arrive_median_ms=tuple(ARRIVE_MS for _ in range(world)),
        cpu_median_ms=tuple(CPU_MS for _ in range(world)),
    )


def hang_record(rank: int, world: int, host: str, last_step: int) -> HangRecord:
    """One rank's record of hang 1 (no stacks, no Flight Recorder: judged by steps)."""
    return HangRecord(
        rank=rank,
        world_size=world,
        host=host,
        pid=1000 + rank,
        number=1,
        detected_at=1.0e9,
        cause="no_step",
        reason="no step for 60 s",
        last_step=last_step,
        silent_s=60.0,
        after_s=60.0,
        threads=[],
        flight_recorder=None,
        flight_recorder_note="synthetic",
    )


def write_run(
    base: Path,
    run_id: str,
    hosts: list[str],
    *,
    culprits: dict[int, int] | None = None,
    stragglers: tuple[int, ...] = (),
    hang_culprit: int | None = None,
) -> RunDir:
    """A finished run: `culprits` maps a step to the rank its evidence blames."""
    path = base / run_id
    path.mkdir(parents=True)
    run = RunDir(path)
    world = len(hosts)
    info = build_run_info(
        run_id=run_id,
        versions=VERSIONS,
        world_size=world,
        started_at=1.0e9,
        argv=["train.py"],
        config={},
        hosts=hosts,
    )
    write_run_info(run, info)
    writer = AnomalyWriter(run)
    for step, rank in sorted((culprits or {}).items()):
        writer.write(slow_step(step, world, rank))
    writer.close()
    body = {
        "stragglers": [
            {"rank": r, "score": 0.2, "since_step": 40, "evidence": {}} for r in stragglers
        ],
        "drift": None,
        "earlier": [],
        "scored_steps": 200,
    }
    write_stragglers(run, body)
    if hang_culprit is not None:
        for rank in range(world):
            behind = 1 if rank == hang_culprit else 0
            write_hang_record(run, hang_record(rank, world, hosts[rank], 150 - behind))
    return run


@dataclass(frozen=True)
class Fleet:
    """What `make_fleet` planted."""

    runs: int
    hosts: list[str]
    bad_host: str
    bad_local_rank: int


def make_fleet(
    base: Path,
    runs: int,
    *,
    seed: int = 0,
    pool: int = 32,
    nodes_per_run: int = 2,
    gpus_per_node: int = 4,
    bad_host: str = "node07",
    bad_local_rank: int = 3,
    bad_rate: float = 0.6,
    noise_rate: float = 0.25,
) -> Fleet:
    """`runs` runs over a pool of hosts; the bad host's `bad_local_rank` is blamed (a
    slow step, a straggler or a hang) in about `bad_rate` of its runs, any rank of any
    run in about `noise_rate` of them."""
    rng = random.Random(seed)
    names = [f"node{i:02d}" for i in range(pool)]
    assert bad_host in names
    for index in range(runs):
        nodes = rng.sample(names, nodes_per_run)
        hosts = [node for node in nodes for _ in range(gpus_per_node)]
        world = len(hosts)
        culprits: dict[int, int] = {}
        stragglers: list[int] = []
        hang = None
        if rng.random() < noise_rate:
            culprits[rng.randrange(20, 200)] = rng.randrange(world)
        if bad_host in nodes and rng.random() < bad_rate:
            bad = nodes.index(bad_host) * gpus_per_node + bad_local_rank
            kind = rng.random()
            if kind < 0.6:
                for _ in range(rng.randint(1, 3)):
                    culprits[rng.randrange(20, 200)] = bad
            elif kind < 0.9:
                stragglers.append(bad)
            else:
                hang = bad
        write_run(
            base,
            f"job{index:05d}-20260101-000000",
            hosts,
            culprits=culprits,
            stragglers=tuple(stragglers),
            hang_culprit=hang,
        )
    return Fleet(runs, names, bad_host, bad_local_rank)
