"""Where the training thread's time at a step boundary goes, on a real loop.

    python3 bench/probes/boundary_cost_probe.py --out $OUT/boundary.json
        [--workloads resnet18,amp] [--steps 600] [--define NAME KEY=VALUE ...]
        [--no-parts] [--device cpu --fake-cupti]

One process per call, world size 1, a fresh agent per block (detection alone by default,
`--define` adds variants as `bench/agent_cost.py` takes them). The probe wraps, from
outside, the boundary's body, the clock's `mark` (training thread) and `poll` (control
thread) and reads per call both the wall clock and the calling thread's CPU time
(`time.thread_time_ns`): wall minus CPU is time the thread waited (for the GIL, mostly).
It also reads the control thread's CPU time per step (the agent's own figure, which
includes `poll`) and how many `threading.Event.set` calls there were (the training
thread waking the control thread, mostly). A `clock` block times the CUDA-event clock
alone (no agent: `mark` each step, `poll` every 32) in the same loop. Figures are per
step, from the timed steps only (after `--warmup`).

Spike census: every step duration the clock gives during the timed steps (the agent's
own clock, or the bare clock of the `clock` block) is kept, and each block reports how
many steps took over 1.25x, 1.5x and 2x the block's median, and which: whether steps
slow down more often with the agent than without it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "workloads"))
sys.path.insert(0, str(REPO))

from loops import build_loop  # noqa: E402

from distanom import boundary as boundary_module  # noqa: E402
from distanom import clock as clock_module  # noqa: E402
from distanom.agent import Agent  # noqa: E402
from distanom.config import load_config  # noqa: E402
from distanom.world import WorldInfo  # noqa: E402


class Meter:
    """Wall and thread-CPU nanoseconds of the calls wrapped, and their count. Each call's
    CPU time is kept too: a mean over a block holds the few milliseconds-long calls
    (a tracer switching on or off) that the median, the untraced step's cost, leaves out."""

    def __init__(self) -> None:
        self.wall = 0
        self.cpu = 0
        self.calls = 0
        self.cpu_samples: list[int] = []
        self.untraced_samples: list[int] = []  # calls with tracing off before and after

    def reset(self) -> None:
        self.wall = self.cpu = self.calls = 0
        self.cpu_samples = []
        self.untraced_samples = []

    def wrap(self, owner: Any, name: str, tracing: Callable[[Any], bool] | None = None) -> None:
        """Meter `owner.name`; `tracing(instance)`, if given, tells whether tracing is on,
        read before and after each call: calls with it off at both ends are untraced."""
        original = getattr(owner, name)
        meter = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            before = tracing(args[0]) if tracing is not None else True
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.thread_time_ns() - cpu
                meter.cpu += spent
                meter.cpu_samples.append(spent)
                if tracing is not None and not before and not tracing(args[0]):
                    meter.untraced_samples.append(spent)
                meter.wall += time.perf_counter_ns() - wall
                meter.calls += 1

        setattr(owner, name, wrapped)

    def per_call_us(self) -> dict[str, float]:
        n = max(1, self.calls)
        return {
            "calls": self.calls,
            "wall_us": round(self.wall / n / 1e3, 2),
            "cpu_us": round(self.cpu / n / 1e3, 2),
            "waited_us": round((self.wall - self.cpu) / n / 1e3, 2),
            "cpu_median_us": round(statistics.median(self.cpu_samples or [0]) / 1e3, 2),
            "untraced_calls": len(self.untraced_samples),
            "untraced_cpu_median_us": round(
                statistics.median(self.untraced_samples or [0]) / 1e3, 2
            ),
            "cpu_p90_us": round(
                sorted(self.cpu_samples or [0])[int(0.9 * max(0, len(self.cpu_samples) - 1))] / 1e3,
                2,
            ),
        }


BOUNDARY, CLOCK, POLL = Meter(), Meter(), Meter()
# Parts of the boundary's body, metered apart (training thread): where a tracer's
# untraced step spends its time beside detection's own work.
PARTS: dict[str, Meter] = {
    name: Meter()
    for name in (
        "tracer_mark", "duty_wanted", "inbox_put_step", "evidence_mark", "gc_take",
        "self_ms", "capture_is_off",
    )
}  # fmt: skip
DEVICE = ["cuda:0"]
METERED_PARTS = [True]  # False under --no-parts: the parts and the clock go unmetered
WAKES = [0]
DURATIONS: list[tuple[int, float]] = []  # what the clock's `mark` returned, timed steps


def census(durations: list[tuple[int, float]]) -> dict[str, Any]:
    """How many steps took over 1.25x, 1.5x, 2x the median, and which (over 1.5x)."""
    if not durations:
        return {"steps": 0}
    median = statistics.median(ms for _, ms in durations)
    out: dict[str, Any] = {"steps": len(durations), "median_ms": round(median, 4)}
    for factor in (1.25, 1.5, 2.0):
        out[f"over_{factor}x"] = sum(1 for _, ms in durations if ms > factor * median)
    out["steps_over_1.5x"] = [
        [step, round(ms / median, 2)] for step, ms in durations if ms > 1.5 * median
    ][:50]
    return out


def install_meters(parts: bool = True) -> None:
    """Meter the boundary, the clock and (if `parts`) the boundary's parts. Each part's
    meter runs inside the boundary and adds its own clock reads to the boundary's time:
    `--no-parts` times the boundary as users run it."""
    # the step that ended was traced (before the call), the next one is (after it)
    BOUNDARY.wrap(
        boundary_module.StepBoundaries, "_boundary_unguarded", lambda b: b._tracing_during
    )
    METERED_PARTS[0] = parts
    if parts:  # the clock's meter is inside the boundary too
        CLOCK.wrap(clock_module.StepClock, "mark")
    metered_mark = clock_module.StepClock.mark

    def collecting_mark(self: Any, step: int) -> Any:
        got = metered_mark(self, step)
        DURATIONS.extend(got)
        return got

    clock_module.StepClock.mark = collecting_mark  # type: ignore[method-assign]
    POLL.wrap(clock_module.StepClock, "poll")
    if parts:
        install_part_meters()
    original_set = threading.Event.set

    def counting_set(self: Any) -> None:
        WAKES[0] += 1
        original_set(self)

    threading.Event.set = counting_set  # type: ignore[method-assign]


def install_part_meters() -> None:
    from distanom.duty_cycle import DutyCycle
    from distanom.evidence import EvidenceMarks
    from distanom.gc_pauses import GcPauses
    from distanom.inbox import StepInbox

    PARTS["duty_wanted"].wrap(DutyCycle, "wanted")
    PARTS["inbox_put_step"].wrap(StepInbox, "put_step")
    PARTS["evidence_mark"].wrap(EvidenceMarks, "mark")
    PARTS["gc_take"].wrap(GcPauses, "take")
    PARTS["self_ms"].wrap(boundary_module.StepBoundaries, "self_ms_of_ended_step")
    from distanom.health import Health

    PARTS["capture_is_off"].wrap(Health, "capture_is_off")
    try:  # the CUPTI backend needs cupti-python; without it the meter stays at 0 calls
        from distanom.tracers.cupti.tracer import CuptiTracer

        PARTS["tracer_mark"].wrap(CuptiTracer, "mark_step", lambda t: t._tracing)
    except ImportError:
        pass
    from distanom.tracers.kineto import KinetoTracer  # one tracer per block: one meter

    PARTS["tracer_mark"].wrap(KinetoTracer, "mark_step", lambda t: t._profiler is not None)


def fake_cupti() -> None:
    """CPU only: give the agent the CUPTI tracer with torch.cuda, CUPTI and the marker
    faked (the unit tests' `running_tracer`), so the default's boundary path, tracer
    and duty cycle included, runs in a CPU loop (`--fake-cupti`)."""
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from test_cupti_mark_step import running_tracer

    def create(config: Any, *, rank: int, use_cuda: bool) -> tuple[Any, str]:
        if config.backend == "none":
            return None, "tracer: none (detection only)"
        tracer, _ = running_tracer(history=config.history_steps)
        tracer.start = lambda: None  # type: ignore[method-assign]
        return tracer, "tracer: cupti (faked CUDA)"

    boundary_module.create_tracer = create  # type: ignore[assignment]


def write_json(path: Path, data: Any) -> None:
    """Write `data` whole or not at all (a kill mid-write leaves the last whole file)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(partial, path)


def sync() -> None:
    if DEVICE[0].startswith("cuda"):
        torch.cuda.synchronize()


def block(
    workload: str, name: str, overrides: list[str] | None, warmup: int, steps: int
) -> dict[str, Any]:
    loop = build_loop(workload, DEVICE[0], small=not DEVICE[0].startswith("cuda"))
    optimizer = loop.optimizer
    record: dict[str, Any] = {"variant": name}
    mode = "cuda_event" if DEVICE[0].startswith("cuda") else "host"
    clock = clock_module.StepClock(mode) if overrides is None else None
    with tempfile.TemporaryDirectory() as scratch:
        agent = None
        if overrides is not None:
            agent = Agent(load_config(None, overrides), WorldInfo.from_env({}), Path(scratch) / "r")
            agent.install()
        for i in range(warmup):
            loop.step()
            if clock is not None:
                clock.mark(i)
        sync()
        BOUNDARY.reset()
        CLOCK.reset()
        POLL.reset()
        for meter in PARTS.values():
            meter.reset()
        WAKES[0] = 0
        DURATIONS.clear()
        own = agent.own_cost() if agent is not None else None
        cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
        for i in range(warmup, warmup + steps):
            loop.step()
            if clock is not None:
                clock.mark(i)
                if i % 32 == 0:  # as the control thread reads it, once per round
                    DURATIONS.extend(clock.poll())
        sync()
        wall = time.perf_counter_ns() - wall0
        record["ms_per_step"] = round(wall / steps / 1e6, 4)
        record["training_thread_cpu_pct"] = round((time.thread_time_ns() - cpu0) / wall * 100, 1)
        record["boundary"] = BOUNDARY.per_call_us()
        # unmetered under --no-parts: null, not a measured zero
        record["clock_mark"] = CLOCK.per_call_us() if METERED_PARTS[0] else None
        record["clock_poll"] = POLL.per_call_us()  # on the control thread (agent blocks)
        record["parts"] = (
            {name: meter.per_call_us() for name, meter in PARTS.items()}
            if METERED_PARTS[0]
            else None
        )
        record["event_sets_per_100_steps"] = round(WAKES[0] * 100 / steps, 2)
        record["spikes"] = census([d for d in DURATIONS if d[0] >= warmup])
        if agent is not None and own is not None:
            after = agent.own_cost()
            record["control_cpu_us_per_step"] = round(
                (after["control_cpu_ns"] - own["control_cpu_ns"]) / steps / 1e3,
                2,  # type: ignore[operator]
            )
            record["rounds"] = agent.control.rounds
            agent.close()
            record["own_cost_whole_block"] = agent.own_cost()
        optimizer.__dict__.pop("step", None)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workloads", default="resnet18,amp")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--define", nargs="+", action="append", default=[])
    parser.add_argument("--commit", default=None)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--fake-cupti", action="store_true", help="CPU: a faked CUPTI tracer")
    parser.add_argument(
        "--no-parts",
        action="store_true",
        help="no part or clock meter inside the boundary (unmetered figures are null)",
    )
    args = parser.parse_args()
    DEVICE[0] = args.device
    if args.fake_cupti:
        fake_cupti()
    install_meters(parts=not args.no_parts)
    variants: dict[str, list[str] | None] = {"clock": None, "detect": ["tracer.backend=none"]}
    for name, *overrides in args.define:
        variants[name] = overrides
    out: dict[str, Any] = {
        "facts": {
            "torch": torch.__version__,
            "device": (
                torch.cuda.get_device_name(0)
                if args.device.startswith("cuda")
                else platform.processor()
            ),
            "python": platform.python_version(),
            "distanom_commit": args.commit,
        },
        "params": {k: str(v) for k, v in vars(args).items()},
        "workloads": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for workload in args.workloads.split(","):
        rows: list[dict[str, Any]] = []
        out["workloads"][workload] = {"blocks": rows}
        for _ in range(args.repeats):
            for name, overrides in variants.items():
                rows.append(block(workload, name, overrides, args.warmup, args.steps))
                print(workload, json.dumps(rows[-1]), flush=True)
                # after every block: a run cut by a time limit keeps what it measured
                write_json(args.out, out)
        summary = {}
        for name in variants:
            mine = [r for r in rows if r["variant"] == name]
            metered = ("boundary", "clock_mark") if METERED_PARTS[0] else ("boundary",)
            summary[name] = {
                f"{key}_{field}": statistics.median(r[key][field] for r in mine)
                for key in metered
                for field in ("wall_us", "cpu_us", "cpu_median_us", "untraced_cpu_median_us")
            }
            for part in PARTS if METERED_PARTS[0] else ():
                for field in ("cpu_us", "cpu_median_us", "untraced_cpu_median_us"):
                    summary[name][f"{part}_{field}"] = statistics.median(
                        r["parts"][part][field] for r in mine
                    )
            summary[name]["control_cpu_us_per_step"] = statistics.median(
                r.get("control_cpu_us_per_step", 0) for r in mine
            )
        out["workloads"][workload] = {"blocks": rows, "median": summary}
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
