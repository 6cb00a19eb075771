"""Is the 1% budget's excess on ResNet18 the governor, the governed loop, or noise?

    python3 bench/probes/budget_three_way.py --triples 200 --out "$OUT"

Device probe for issue 4. bench/overhead.py's budget blocks read the governed blocks
that held no traced step ~1.5-2.5% slower than the tracing-off blocks beside them, a
per-block noise of ~9% (64 steps) leaves one process's figure +-1.2%, and the A/A run of
budget_block_calibration.py (+0.07%) was a separate phase of one process. Here one
ResNet18 process rotates three kinds of 64-step blocks through all six orders, so every
comparison is interleaved in time:

- `off`: tracing off, the tracer's boundary marked (as bench/overhead.py's off blocks);
- `never`: the governed loop with a governor that never traces (the loop's own cost);
- `governed`: the real 1% governor, as in bench/overhead.py (a block that ends inside a
  traced run goes on until the run and its switch-off are done).

Per block: steps, host ms (synchronized at both ends), traced steps. The summary gives,
per kind, ms per step over all blocks and the mean of per-rotation ratios against `off`,
with their standard error; `governed` also split into blocks that held a traced step and
blocks that did not, the excess of each over the `off` block of its rotation as a share
of governed time, and clean governed blocks against `never`. Writes budget_three_way.json
under --out; `--summarize RESULT [RESULT ...]` recomputes the summary of saved results
anywhere, the rotations of several runs pooled (one run's +-0.7% cannot settle a 1% budget).
`--simulate` runs the same rotation with no GPU: a CPU step and a tracer that burns the
costs the cupti backend measured, so the governed loop's own cost can be seen apart from
anything CUPTI or the GPU does (budget_three_way_simulated.json). `--simulate
--scenarios` instead runs where the budget goes (`probes/budget_scenarios.py`: periodic
anomalies and lasting slowdowns, the duty cycle alone against it with the trace planner,
on a virtual clock; budget_scenarios_simulated_cpu.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class SimulatedTracer:
    """Stands in for CuptiTracer under --simulate: burns, on the training thread, what
    the cupti backend measured on the H200 (bench/results/cupti_switch_cost_probe_h200.json:
    a traced ResNet18 step +13%, switching on ~9.6 ms, off ~3.2 ms) and nothing else."""

    TRACED_STEP_S, SWITCH_ON_S, SWITCH_OFF_S = 0.0025, 0.0096, 0.0032

    def __init__(self) -> None:
        self.tracing = False
        self.boundary_flushes = 0

    def mark_step(self, step: int, now_ns: int) -> None:
        if self.tracing:
            _busy(self.TRACED_STEP_S)

    def set_tracing(self, on: bool) -> None:
        _busy(self.SWITCH_ON_S if on else self.SWITCH_OFF_S)
        self.tracing = on

    def close(self) -> None:
        self.tracing = False


def _cpu_step(torch: Any) -> Any:
    """A CPU step of about 10 ms: repeated 256x256 matmuls, sized once on this CPU."""
    a = torch.randn(256, 256)
    for _ in range(200):  # warm up first: the first matmuls run faster or slower
        a @ a
    per = time.perf_counter()
    for _ in range(200):
        a @ a
    per = (time.perf_counter() - per) / 200
    reps = max(1, round(0.010 / per))

    def step() -> None:
        for _ in range(reps):
            a @ a

    return step


def _mean_se(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"n": len(values), "mean_pct": float("nan"), "se_pct": float("nan")}
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / len(values) ** 0.5
    return {"n": len(values), "mean_pct": round((mean - 1) * 100, 3), "se_pct": round(se * 100, 3)}


def _per_step(block: dict[str, Any]) -> float:
    return float(block["ms"]) / int(block["steps"])


def summarize(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the probe reports, from its blocks (also for a saved result)."""
    by_triple: dict[Any, dict[str, dict[str, Any]]] = {}
    for b in blocks:
        by_triple.setdefault(b["triple"], {})[b["kind"]] = b
    ratios: dict[str, list[float]] = {"never": [], "governed": [], "governed_clean": [],
                                      "governed_burst": []}  # fmt: skip
    clean_vs_never: list[float] = []
    # governed time in excess of the off block of the same rotation, by block type
    excess_ms = {"burst": 0.0, "clean": 0.0}
    for tri in by_triple.values():
        off = _per_step(tri["off"])
        ratios["never"].append(_per_step(tri["never"]) / off)
        g = tri["governed"]
        ratios["governed"].append(_per_step(g) / off)
        ratios["governed_burst" if g["traced"] else "governed_clean"].append(_per_step(g) / off)
        excess_ms["burst" if g["traced"] else "clean"] += g["ms"] - off * g["steps"]
        if not g["traced"]:
            clean_vs_never.append(_per_step(g) / _per_step(tri["never"]))
    totals = {
        kind: round(sum(b["ms"] for b in blocks if b["kind"] == kind)
                    / sum(b["steps"] for b in blocks if b["kind"] == kind), 4)
        for kind in ("off", "never", "governed")
    }  # fmt: skip
    split: dict[str, dict[str, float]] = {}
    if all("work_ms" in b for b in blocks):  # results from before --split was recorded lack it
        for kind in ("off", "never", "governed_clean"):
            chosen = [
                b for b in blocks
                if b["kind"] == kind.removesuffix("_clean") and not (kind != "off" and b["traced"])
            ]  # fmt: skip
            steps = sum(b["steps"] for b in chosen)
            work = sum(b["work_ms"] for b in chosen)
            split[kind] = {
                "work_ms_per_step": round(work / steps, 4),
                "rest_ms_per_step": round((sum(b["ms"] for b in chosen) - work) / steps, 4),
            }
    governed_ms = sum(b["ms"] for b in blocks if b["kind"] == "governed")
    governed_steps = sum(b["steps"] for b in blocks if b["kind"] == "governed")
    return {
        "ms_per_step": totals,
        "overall_pct_vs_off": {
            k: round((totals[k] / totals["off"] - 1) * 100, 3) for k in ("never", "governed")
        },
        "rotation_ratio_vs_off": {k: _mean_se(v) for k, v in ratios.items()},
        "governed_clean_vs_never": _mean_se(clean_vs_never),
        "governed_excess_pct_of_governed_time": {
            k: round(v / governed_ms * 100, 3) for k, v in excess_ms.items()
        },
        "coverage": round(sum(b["traced"] for b in blocks) / governed_steps, 4),
        **({"untraced_blocks_split": split} if split else {}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triples", type=int, default=200)
    parser.add_argument("--block-steps", type=int, default=64)
    parser.add_argument("--out", default=".")
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="no GPU: a ~10 ms CPU step and a tracer that only burns the device's measured "
        "costs (traced step +2.5 ms, switch on 9.6 ms, off 3.2 ms), to see whether the "
        "governed loop itself costs anything",
    )
    parser.add_argument(
        "--scenarios",
        action="store_true",
        help="with --simulate: where a 1%% budget goes on simulated runs with periodic "
        "anomalies and lasting slowdowns, the duty cycle alone and with the trace planner",
    )
    parser.add_argument("--steps", type=int, default=12_000, help="--scenarios: steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="--scenarios: runs per scenario")
    parser.add_argument(
        "--summarize",
        metavar="RESULT",
        nargs="+",
        help="print the summary of saved results and exit (several: their rotations "
        "pooled; the work/rest split only if every result recorded it)",
    )
    args = parser.parse_args()
    if args.summarize:
        pooled: list[dict[str, Any]] = []
        for number, path in enumerate(args.summarize):
            blocks = json.loads(Path(path).read_text())["blocks"]
            # each run numbers its rotations from 0: keep them apart
            pooled += [{**b, "triple": (number, b["triple"])} for b in blocks]
        print(json.dumps(summarize(pooled), indent=1))
        return 0
    if args.scenarios:
        if not args.simulate:
            parser.error("--scenarios needs --simulate (it runs on a virtual clock)")
        return _scenarios(args.steps, args.seeds, Path(args.out))

    import torch
    from budget_block_calibration import NeverTraces
    from overhead import _govern, _tracer_config, build_workload

    from distanom.governor import GovernorParams, OverheadGovernor

    tracer: Any
    if args.simulate:
        torch.set_num_threads(1)
        step_fn = _cpu_step(torch)
        sync: Any = lambda: None  # noqa: E731
        tracer = SimulatedTracer()
        device, workload = "cpu (simulated tracer)", "torch.mm loop, ~10 ms"
    else:
        from distanom.tracers.cupti import CuptiTracer

        work = build_workload("resnet18", 10)
        step_fn, sync = (lambda: work.step(0)), torch.cuda.synchronize
        for _ in range(30):
            step_fn()
        sync()
        tracer = CuptiTracer(_tracer_config(1.0), rank=0)
        tracer.mark_step(0, time.time_ns())
        tracer.start()
        device, workload = torch.cuda.get_device_name(), "resnet18 bf16 batch 5"
    step = 1
    governor = OverheadGovernor(1.0, GovernorParams(window_steps=16, lag_steps=2), first_step=1)
    states: dict[str, dict[str, Any]] = {
        "governed": {"on": True, "g": 1, "after_flush": False, "prev_on": True},
        "never": {"on": False, "g": 1, "after_flush": False, "prev_on": False},
    }
    gov_state = states["governed"]
    gov_state["last"] = time.perf_counter()
    for _ in range(400):  # let the real governor settle, as the bench's timed loop does
        step_fn()
        flushes = tracer.boundary_flushes
        tracer.mark_step(step, time.time_ns())
        _govern(tracer, governor, gov_state, flushes)
        step += 1
    while gov_state["on"] or gov_state["prev_on"]:  # finish a run in progress
        step_fn()
        flushes = tracer.boundary_flushes
        tracer.mark_step(step, time.time_ns())
        _govern(tracer, governor, gov_state, flushes)
        step += 1
    governors: dict[str, Any] = {"governed": governor, "never": NeverTraces()}

    blocks: list[dict[str, Any]] = []
    orders = list(itertools.permutations(("off", "never", "governed")))
    started = time.perf_counter()
    for t in range(args.triples):
        for kind in orders[t % len(orders)]:
            sync()
            t0 = time.perf_counter()
            n = traced = 0
            work_s = 0.0  # time inside the step itself, apart from distanom's boundary
            if kind == "off":
                for _ in range(args.block_steps):
                    w0 = time.perf_counter()
                    step_fn()
                    work_s += time.perf_counter() - w0
                    tracer.mark_step(step, time.time_ns())
                    step += 1
                    n += 1
            else:
                st = states[kind]
                st["last"] = t0
                st["on"] = tracer.tracing
                st["after_flush"] = False
                while n < args.block_steps or st["on"] or st["prev_on"]:
                    w0 = time.perf_counter()
                    step_fn()
                    work_s += time.perf_counter() - w0
                    flushes = tracer.boundary_flushes
                    tracer.mark_step(step, time.time_ns())
                    _govern(tracer, governors[kind], st, flushes)
                    traced += bool(st["prev_on"])
                    step += 1
                    n += 1
            sync()
            ms = (time.perf_counter() - t0) * 1000.0
            blocks.append(
                {"triple": t, "kind": kind, "steps": n, "ms": round(ms, 3), "traced": traced,
                 "work_ms": round(work_s * 1000.0, 3)}
            )  # fmt: skip
    tracer.close()

    out: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "workload": workload,
        "block_steps": args.block_steps,
        "triples": args.triples,
        "elapsed_s": round(time.perf_counter() - started, 1),
        **summarize(blocks),
        "governor": governor.report(),
        "blocks": blocks,
    }
    print(json.dumps({k: v for k, v in out.items() if k not in ("blocks", "governor")}))
    name = "budget_three_way_simulated.json" if args.simulate else "budget_three_way.json"
    Path(args.out, name).write_text(json.dumps(out, indent=1))
    return 0


def _scenarios(steps: int, seeds: int, out: Path) -> int:
    """Where the budget goes, on simulated runs (see probes/budget_scenarios.py)."""
    from probes.budget_scenarios import run_all

    import distanom.trace_planner as planner

    started = time.perf_counter()
    results = run_all(steps, seeds)
    body = {
        "device": "CPU simulation: no GPU, no tracer; a virtual clock fed to the agent's "
        "DutyCycle (governor + trace planner) and Detector",
        "model": "10 ms steps +-2%; traced +13%; switch on +9.6 ms, off +3.2 ms "
        "(cupti on an H200, bench/results/cupti_switch_cost_probe_h200.json); budget 1%; "
        "gathered in the agent's rounds (RoundSizer: ~1 s away from traced steps, cut "
        "near them; ended early by 4 slow steps in a row), 2 steps after their last",
        "planner_params": vars(planner.PlannerParams()),
        "steps": steps,
        "seeds": seeds,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "scenarios": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "budget_scenarios_simulated_cpu.json").write_text(json.dumps(body, indent=1))
    for name, per in results.items():
        for kind, runs in per.items():
            shown = {k: v for k, v in runs.items() if k != "runs"}
            print(f"{name} | {kind}: {json.dumps(shown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
