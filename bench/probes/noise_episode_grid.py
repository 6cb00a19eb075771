"""How a 1% budget fares on a loaded host: lasting slowdowns and a periodic anomaly among
a loaded host's noise episodes, over a grid of noise rates and periods (CPU only).

    python3 bench/probes/noise_episode_grid.py --out "$OUT"

The simulation of `probes/budget_scenarios.py` (the agent's own `DutyCycle`, trace
planner and `Detector` on a virtual clock, in the agent's rounds), with the planner.
Each run: 12,000 steps of 10 ms; an evaluation every `period` steps (+20 ms); four
lasting slowdowns (x1.6 for 200 steps, placed per seed); and noise episodes, 4-6 steps
in a row 1.5-2.4x slow, `rate` of them per step (a loaded 2-core CI host made such
episodes at 1.5x). Per grid cell, over 3 seeds: the share of the evaluation's
occurrences traced from the 4th on, and of the 12 slowdowns how many were traced within
their first two 16-step windows and how many at all. Written to
noise_episode_grid_cpu_<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from probes.budget_scenarios import Scenario, simulate  # noqa: E402

STEPS = 12_000
RATES = (0.002, 0.005, 0.01)  # noise episodes per step
PERIODS = (200, 300, 400)
SEEDS = 3


def scenario(seed: int, rate: float, period: int) -> Scenario:
    """One grid cell's run for `seed`."""
    rng = random.Random(seed)
    noisy: dict[int, float] = {}
    for _ in range(int(STEPS * rate)):
        first = rng.randrange(20, STEPS - 10)
        for d in range(rng.choice((4, 5, 6))):
            noisy[first + d] = rng.uniform(1.5, 2.4)
    # per seed, so a slowdown's start falls at other distances from the evaluations
    starts = [base + shift * seed for base, shift in ((2050, 37), (5050, 53), (8050, 71))]
    starts.append(10550 + 13 * seed)
    return Scenario(
        f"evaluation every {period}, {rate} noise episodes per step",
        STEPS,
        {"eval": list(range(period, STEPS, period))},
        {"eval": 0.020},
        slowdowns=[(a, a + 199, 1.6) for a in starts],
        noisy=noisy,
    )


def cell(rate: float, period: int) -> dict[str, Any]:
    """A grid cell over the seeds."""
    periodic: list[float] = []
    within = traced = total = 0
    for seed in range(SEEDS):
        run = simulate(scenario(seed, rate, period), planner=True, seed=seed)
        periodic.append(run["series eval"]["traced_from_4th_pct"])
        slowdowns = [v for k, v in run.items() if k.startswith("slowdown ")]
        total += len(slowdowns)
        within += sum(s["within_two_windows"] for s in slowdowns)
        traced += sum(s["first_traced_after_steps"] is not None for s in slowdowns)
    return {
        "rate": rate,
        "period": period,
        "periodic_traced_from_4th_pct": periodic,
        "slowdowns": total,
        "slowdowns_within_two_windows": within,
        "slowdowns_traced": traced,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the JSON result")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    cells = [cell(rate, period) for rate in RATES for period in PERIODS]
    for c in cells:
        print(json.dumps(c))
    body = {
        "device": "CPU simulation (probes/budget_scenarios.py): no GPU, no tracer",
        "commit": commit,
        "steps": STEPS,
        "seeds": SEEDS,
        "cells": cells,
        "totals": {
            "slowdowns": sum(c["slowdowns"] for c in cells),
            "within_two_windows": sum(c["slowdowns_within_two_windows"] for c in cells),
            "traced": sum(c["slowdowns_traced"] for c in cells),
            "periodic_cells_under_90pct": sum(
                1 for c in cells for p in c["periodic_traced_from_4th_pct"] if p < 90
            ),
        },
    }
    print(json.dumps(body["totals"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"noise_episode_grid_cpu_{commit}.json").write_text(json.dumps(body, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
