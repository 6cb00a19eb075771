"""A synthetic run directory, as a finished distanom job leaves it (not a test module).

`make_run` writes run.json, status.json, steps/rank<R>.csv, every capture's rank
traces (gzipped documents, e.g. from `tests.unit.stepgen`) and their index lines.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distanom.rundir import RunDir, write_json_atomic


@dataclass
class Capture:
    step: int
    kind: str
    documents: Mapping[int, Mapping[str, Any]]
    step_ms: float
    median_ms: float = 1.5
    tracer_stats: Mapping[int, Mapping[str, int]] | None = None  # per rank, as the tracer left them
    cost_ms: Mapping[int, Mapping[str, float]] | None = None  # per rank, the capture worker's


def make_run(
    base: Path,
    captures: Sequence[Capture],
    *,
    hosts: Sequence[str],
    steps: int = 100,
    step_ms: float = 1.5,
    run_id: str = "run1",
) -> RunDir:
    path = base / run_id
    path.mkdir(parents=True)
    run = RunDir(path)
    world = len(hosts)
    write_json_atomic(
        run.run_json,
        {
            "run_id": run_id,
            "world_size": world,
            "hosts": list(hosts),
            "config": {
                "detect": {
                    "multiplier": 1.5,
                    "window_steps": 50,
                    "warmup_steps": 5,
                    "min_steps": 10,
                }
            },
        },
    )
    write_json_atomic(
        run.status_json,
        {"state": "finished", "run_id": run_id, "world_size": world, "threshold_ms": 2.25},
    )
    slow = {c.step: c.step_ms for c in captures}
    (path / "steps").mkdir()
    for rank in range(world):
        rows = ["step,duration_ms,traced"]
        for step in range(1, steps):
            value = slow.get(step, step_ms + 0.01 * ((step * 7 + rank) % 5))
            rows.append(f"{step},{value:.4f},{1 if step % 3 else 0}")
        run.steps_csv(rank).write_text("\n".join(rows) + "\n")
    for capture in captures:
        run.capture_dir(capture.step).mkdir(parents=True)
        for rank, document in capture.documents.items():
            trace = run.trace_path(capture.step, rank)
            trace.write_bytes(gzip.compress(json.dumps(document).encode()))
            run.append_index(
                {
                    "event": "written",
                    "step": capture.step,
                    "rank": rank,
                    "kind": capture.kind,
                    "trace": run.relative(trace),
                    "host": hosts[rank],
                    "bytes": trace.stat().st_size,
                    "step_ms": capture.step_ms,
                    "median_ms": capture.median_ms,
                    "threshold_ms": 1.5 * capture.median_ms,
                    "slowest_rank": 0,
                    "tracer": "kineto",
                    **(
                        {"tracer_stats": dict(capture.tracer_stats[rank])}
                        if capture.tracer_stats and rank in capture.tracer_stats
                        else {}
                    ),
                    **(
                        {"cost_ms": dict(capture.cost_ms[rank])}
                        if capture.cost_ms and rank in capture.cost_ms
                        else {}
                    ),
                }
            )
    (base / "latest").symlink_to(run_id)
    return run
