"""bench/probes/budget_scenarios.py (CPU simulation): with the trace planner a 1% budget
still holds, a jittered periodic anomaly and a delay near 2x the median (either side of the
planner's `min_ratio`) are traced from their 4th occurrence on, and a lasting slowdown
within its first two duty-cycle windows; without it, none of them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PROBE = Path(__file__).resolve().parents[1] / "probes" / "budget_scenarios.py"


def probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("budget_scenarios", PROBE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_planner_spends_the_budget_where_the_anomalies_are() -> None:
    sim = probe()
    by_name = {s.name.split(":")[0]: s for s in sim.scenarios(6000)}
    jitter, episodes, near = (
        by_name["periodic with jitter"],
        by_name["episodes"],
        by_name["near 2x"],
    )
    for planner in (False, True):
        run = sim.simulate(jitter, planner=planner)
        assert run["tracing_cost_pct"] <= 1.0
        covered = run["series refill/300+-1"]["traced_from_4th_pct"]
        assert covered >= 90 if planner else covered < 20
        run = sim.simulate(near, planner=planner)
        assert run["tracing_cost_pct"] <= 1.0
        covered = run["series delay/400"]["traced_from_4th_pct"]
        assert covered >= 90 if planner else covered < 20
        run = sim.simulate(episodes, planner=planner)
        assert run["tracing_cost_pct"] <= 1.0
        early = [v["within_two_windows"] for k, v in run.items() if k.startswith("slowdown")]
        assert all(early) if planner else not all(early)
