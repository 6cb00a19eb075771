"""What the whole agent costs a real training loop, resolved in one process.

    python3 bench/agent_cost.py --out $OUT [--workloads resnet18,amp,compile,compile_ro]
        [--variants off,detect,default,budget1] [--warmup 300] [--steps 1000]
        [--rounds 10] [--budget-s 540] [--device cuda|cpu] [--small]
        [--define NAME KEY=VALUE ...]

Whole-process pairs (bench/whole_job.py) spread by +-25% on the H200 machine, too much
to resolve a 1% cost. Here one process builds one training loop (bench/workloads/loops.py)
and runs it in blocks, rotating between variants from round to round:

- `off`: no agent (`off_aa`: a second no-agent block, an A/A check of the method);
- `detect`: the agent with `tracer.backend=none` (detection alone);
- `default`: the agent with its defaults;
- `budget1`: the agent with `tracer.overhead_budget_pct=1` (the default since 2026-12);
- `trace_all`: the agent with `tracer.overhead_budget_pct=null` (every step traced);
- any variant named by `--define NAME KEY=VALUE ...` (config overrides as
  `distanom.config.load_config(None, overrides)` takes them; none: the defaults).

Each block installs a fresh `distanom.agent.Agent` (world size 1, `WorldInfo.from_env({})`,
a run directory in a temporary folder deleted after the block), runs `--warmup` steps
untimed, then `--steps` timed steps, and closes the agent. The block is timed on the
GPU's clock: the device is synchronized before the wall clock is read at the start and
at the end of the timed steps, never inside them (a sync per step would hide the launch
cost the agent adds). The untimed warm-up holds the agent's install, its first boundary
and tracer start, and the overhead governor's first measuring windows, so the figures
are the steady state; the output says so, and records the governor's state at the start
of the timed steps and at the end.

Per variant: every block's ms/step and their median; the ratio to `off` as the median of
per-round ratios (each block against the same round's `off` block), and the range of
those ratios. Workloads: `resnet18` (the seed's ResNet18), `amp` (fp16 AMP encoder),
`compile` and `compile_ro` (`amp` under torch.compile, default and reduce-overhead, i.e.
CUDA graphs; the step boundary hook runs in eager Python around `optimizer.step()`,
outside the compiled region). A Hugging Face `Trainer` and a Lightning loop own their
loop, so they are measured whole-job only (bench/whole_job.py). Not included here: what
`distanom.launch` does before the script runs (Flight Recorder switch, runpy).

A failing variant is recorded (its error string) and the others go on; warnings the agent
logs during a block (a part that stepped aside, and why) are kept with the block. No new
round starts once it would end after `--budget-s`; the JSON is rewritten after every
round, so a killed run keeps what was done. Output: `--out` (a `.json` file, or a folder
that gets `agent_cost.json`) and a short table on stdout. The JSON names the distanom
commit (git, or $DISTANOM_COMMIT where the tree was copied without its .git).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "workloads"))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from loops import Loop, build_loop  # noqa: E402
from whole_job import git_commit  # noqa: E402

from distanom.agent import Agent  # noqa: E402
from distanom.config import load_config  # noqa: E402
from distanom.errors import ConfigError  # noqa: E402
from distanom.world import WorldInfo  # noqa: E402

WORKLOADS: dict[str, tuple[str, str | None]] = {
    "resnet18": ("resnet18", None),
    "amp": ("amp", None),
    "compile": ("amp", "default"),
    "compile_ro": ("amp", "reduce-overhead"),
}
# None: no agent; a list: the agent with these config overrides
VARIANTS: dict[str, list[str] | None] = {
    "off": None,
    "off_aa": None,
    "detect": ["tracer.backend=none"],
    "default": [],
    "budget1": ["tracer.overhead_budget_pct=1"],
    "trace_all": ["tracer.overhead_budget_pct=null"],
}
BASELINE = "off"
# a block's agent install and close, beyond its steps (seconds; for the round estimate)
AGENT_FIXED_S = 2.0


class _Collect(logging.Handler):
    """Keeps the agent's warnings of one block (why a part stepped aside)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < 20:
            with contextlib.suppress(Exception):
                self.lines.append(record.getMessage()[:500])


def _duty(agent: Agent | None) -> dict[str, Any] | None:
    """The governor's counters now (None without an agent or governor)."""
    if agent is None:
        return None
    try:
        report = agent.duty.report()
    except Exception as err:
        return {"error": str(err)}
    if report is None:
        return None
    keys = ("windows_decided", "windows_traced", "target_fraction", "measured_overhead_pct")
    keys += ("steps_recorded", "steps_traced")
    return {k: report.get(k) for k in keys}


def _agent_facts(agent: Agent) -> dict[str, Any]:
    """Which tracer ran and whether a part stepped aside."""
    facts: dict[str, Any] = {}
    for name, read in (
        ("tracer", lambda: agent.tracer_note),
        ("steps_seen", lambda: agent.current_step),
        ("capture_off", lambda: agent.health.capture_off_reason),
        ("consensus_error", lambda: agent.health.consensus_error),
    ):
        try:
            facts[name] = read()
        except Exception as err:
            facts[name] = f"unreadable: {err}"
    return facts


def _own_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float] | None:
    """The agent's own time per step over the timed steps (its self-measurement: time
    in boundaries on the training thread, CPU time of its control thread)."""
    steps = int(after.get("steps", 0)) - int(before.get("steps", 0))
    if steps <= 0 or "boundary_ns" not in before or "boundary_ns" not in after:
        return None
    boundary = (after["boundary_ns"] - before["boundary_ns"]) / steps / 1e3
    control = (after["control_cpu_ns"] - before["control_cpu_ns"]) / steps / 1e3
    return {"boundary_us": round(boundary, 2), "control_us": round(control, 2)}


def run_block(
    loop: Loop, name: str, overrides: list[str] | None, warmup: int, steps: int, sync: Any
) -> dict[str, Any]:
    """One block: a fresh agent (unless `overrides` is None), warm-up, timed steps, close."""
    record: dict[str, Any] = {"variant": name}
    optimizer = loop.optimizer
    had_step = "step" in optimizer.__dict__
    saved_step = optimizer.__dict__.get("step")
    collect = _Collect()
    logging.getLogger("distanom").addHandler(collect)
    agent: Agent | None = None
    gc.collect()  # the last block's garbage is not this block's cost
    with tempfile.TemporaryDirectory(prefix="agent_cost_") as scratch:
        try:
            if overrides is not None:
                started = time.perf_counter()
                config = load_config(None, overrides)
                agent = Agent(config, WorldInfo.from_env({}), Path(scratch) / "runs")
                agent.install()
                record["install_s"] = round(time.perf_counter() - started, 3)
            for _ in range(warmup):
                loop.step()
            sync()
            record["duty_at_timed_start"] = _duty(agent)
            own_before = agent.own_cost() if agent is not None else None
            started = time.perf_counter()
            for _ in range(steps):
                loop.step()
            sync()
            record["ms_per_step"] = round((time.perf_counter() - started) * 1000 / steps, 4)
            if agent is not None and own_before is not None:
                record["own_us_per_timed_step"] = _own_delta(own_before, agent.own_cost())
        except Exception as err:
            record["error"] = f"{type(err).__name__}: {err}"[:1000]
        finally:
            if agent is not None:
                started = time.perf_counter()
                try:
                    agent.close()
                except Exception as err:
                    record["close_error"] = f"{type(err).__name__}: {err}"[:1000]
                record["close_s"] = round(time.perf_counter() - started, 3)
                record["duty_at_end"] = _duty(agent)
                record["own_cost"] = agent.own_cost()  # measured by the agent itself
                record.update(_agent_facts(agent))
            # the closed agent's inert wrapper is taken off, so wrappers do not pile up
            if had_step:
                optimizer.step = saved_step  # type: ignore[method-assign]
            else:
                optimizer.__dict__.pop("step", None)
            logging.getLogger("distanom").removeHandler(collect)
    if collect.lines:
        record["agent_warnings"] = collect.lines
    return record


def summarize(rounds: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Per variant: block figures, their median, and per-round ratios to `off`."""
    out: dict[str, Any] = {}
    for variant in variants:
        blocks = [r["blocks"][variant].get("ms_per_step") for r in rounds]
        times = [b for b in blocks if b]
        ratios = []
        for one in rounds:
            base = one["blocks"].get(BASELINE, {}).get("ms_per_step")
            mine = one["blocks"][variant].get("ms_per_step")
            if base and mine:
                ratios.append(mine / base)
        errors = sorted(
            {r["blocks"][variant]["error"] for r in rounds if "error" in r["blocks"][variant]}
        )
        out[variant] = {
            "blocks_ms_per_step": blocks,
            "median_ms_per_step": round(statistics.median(times), 4) if times else None,
            "ratios_to_off": [round(r, 4) for r in ratios],
            "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
            "min_ratio": round(min(ratios), 4) if ratios else None,
            "max_ratio": round(max(ratios), 4) if ratios else None,
            "errors": errors,
        }
        own = [r["blocks"][variant].get("own_us_per_timed_step") for r in rounds]
        own = [o for o in own if o]
        if own and times:
            per_step_us = statistics.median(o["boundary_us"] + o["control_us"] for o in own)
            out[variant]["own_us_per_step"] = round(per_step_us, 2)
            # resolved where the block ratios are not: the agent's own time per step
            out[variant]["own_pct_of_step"] = round(
                per_step_us / 1e3 / statistics.median(times) * 100, 3
            )
    return out


def facts(device: str) -> dict[str, Any]:
    """Device name, torch, CUDA and Python versions, host, distanom commit."""
    found: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    found["device"] = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    found["python"] = platform.python_version()
    found["host"] = platform.node()
    found["distanom_commit"] = git_commit()
    return found


def out_path(out: Path) -> Path:
    """`out` itself when it names a .json file, else `out/agent_cost.json`."""
    return out if out.suffix == ".json" else out / "agent_cost.json"


def measure_workload(
    name: str,
    args: argparse.Namespace,
    variants: dict[str, list[str] | None],
    deadline: float,
    entry: dict[str, Any],
    save: Any,
) -> None:
    """Rounds of blocks of one workload into `entry` until `--rounds` or `deadline`;
    `save()` after every round."""
    workload, compile_mode = WORKLOADS[name]
    device = args.device
    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    started = time.monotonic()
    try:
        loop = build_loop(workload, device, small=args.small, compile_mode=compile_mode)
        # compilation, CUDA graph capture and allocator growth happen here, untimed
        for _ in range(args.setup_steps):
            loop.step()
        sync()
        probe_start = time.perf_counter()
        for _ in range(20):
            loop.step()
        sync()
        step_s = (time.perf_counter() - probe_start) / 20
    except Exception as err:
        entry["error"] = f"{type(err).__name__}: {err}"[:1000]
        save()
        return
    entry["setup_s"] = round(time.monotonic() - started, 2)
    entry["probe_ms_per_step"] = round(step_s * 1000, 4)
    agents = sum(1 for v in variants.values() if v is not None)
    estimate = len(variants) * (args.warmup + args.steps) * step_s * 1.2 + agents * AGENT_FIXED_S
    names = list(variants)
    for number in range(args.rounds):
        if time.monotonic() + estimate > deadline:
            entry["stopped"] = f"time budget: round {number} would end after --budget-s"
            break
        round_start = time.monotonic()
        shift = number % len(names)
        order = names[shift:] + names[:shift]
        blocks = {v: run_block(loop, v, variants[v], args.warmup, args.steps, sync) for v in order}
        elapsed = time.monotonic() - round_start
        estimate = max(estimate, elapsed)
        entry["rounds"].append({"order": order, "seconds": round(elapsed, 2), "blocks": blocks})
        entry["summary"] = summarize(entry["rounds"], names)
        line = ", ".join(f"{v} {blocks[v].get('ms_per_step')}" for v in order)
        print(f"[{name} round {number}] ms/step: {line}", flush=True)
        save()
    del loop
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    with contextlib.suppress(Exception):
        torch._dynamo.reset()


def table(report: dict[str, Any]) -> str:
    """The short table: per workload and variant, median ms/step and ratio to off."""
    rows = [
        f"{'workload':<11} {'variant':<9} {'blocks':>6} {'ms/step':>9} {'ratio':>7} {'range':>17}"
    ]
    for name, entry in report["workloads"].items():
        if "error" in entry:
            rows.append(f"{name:<11} failed: {entry['error'][:100]}")
        for variant, s in entry.get("summary", {}).items():
            ms = s["median_ms_per_step"]
            ratio = s["median_ratio"]
            spread = f"[{s['min_ratio']}, {s['max_ratio']}]" if ratio is not None else ""
            rows.append(
                f"{name:<11} {variant:<9} {len(s['blocks_ms_per_step']):>6} "
                f"{ms if ms is not None else '-':>9} {ratio if ratio is not None else '-':>7} "
                f"{spread:>17}" + (f"  errors: {s['errors'][0][:80]}" if s["errors"] else "")
            )
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_out = Path(os.environ.get("OUT", "agent_cost_out"))
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--workloads", default="resnet18,amp,compile,compile_ro")
    parser.add_argument("--variants", default="off,detect,default,budget1")
    parser.add_argument(
        "--define", nargs="+", action="append", default=[], metavar="NAME [KEY=VALUE]",
        help="a variant: the agent with these config overrides (repeatable)",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=300, help="untimed steps per block")
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per block")
    parser.add_argument("--rounds", type=int, default=10, help="at most this many rounds")
    parser.add_argument("--setup-steps", type=int, default=100, help="untimed, before round 0")
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--small", action="store_true", help="tiny sizes (always on cpu)")
    return parser.parse_args(argv)


def resolve(args: argparse.Namespace) -> tuple[list[str], dict[str, list[str] | None]]:
    """Workloads and variants from the command line; ValueError names a bad one."""
    if args.warmup < 0 or args.steps < 1 or args.rounds < 1 or args.setup_steps < 0:
        raise ValueError("--warmup >= 0, --steps >= 1, --rounds >= 1, --setup-steps >= 0")
    known: dict[str, list[str] | None] = dict(VARIANTS)
    for spec in args.define:
        if spec[0] in VARIANTS:
            raise ValueError(f"--define: {spec[0]} is a built-in variant")
        known[spec[0]] = list(spec[1:])
    workloads = [w for w in args.workloads.split(",") if w]
    names = [v for v in args.variants.split(",") if v]
    names += [spec[0] for spec in args.define if spec[0] not in names]
    unknown = [w for w in workloads if w not in WORKLOADS] + [v for v in names if v not in known]
    if unknown:
        raise ValueError(f"unknown workload or variant: {', '.join(unknown)}")
    if not workloads:
        raise ValueError("no workload named")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    variants = {v: known[v] for v in names}
    for overrides in variants.values():
        if overrides is not None:
            try:
                load_config(None, overrides)
            except ConfigError as err:
                raise ValueError(str(err)) from None
    return workloads, variants


def main(argv: list[str] | None = None) -> int:
    """Run the bench; 0 when it ran (failed variants are in the output), 2 on bad input."""
    args = parse_args(argv)
    try:
        workloads, variants = resolve(args)
    except ValueError as err:
        print(f"agent_cost: {err}", file=sys.stderr)
        return 2
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        args.device = "cuda:0"  # set_device and the facts want an index
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("agent_cost: --device cuda but no CUDA device is available", file=sys.stderr)
            return 2
        torch.cuda.set_device(args.device)
    elif args.device != "cpu":
        print(f"agent_cost: --device {args.device}: cuda, cuda:N or cpu", file=sys.stderr)
        return 2
    else:
        args.small = True
        torch.set_num_threads(1)  # the shared CPU: one thread is less noisy
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    path = out_path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report: dict[str, Any] = {
        "facts": facts(args.device),
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "variants": variants,
        "timing": (
            "per block: the device synchronized, then the wall clock read, at the start and "
            "the end of the timed steps, never inside them; ratio = block / the same round's "
            "off block, median and range over rounds"
        ),
        "excluded": (
            f"each block's first {args.warmup} steps (agent install, first boundary, tracer "
            "start, the overhead governor's first measuring windows) and each workload's "
            f"{args.setup_steps} setup steps (compilation, CUDA graph capture) are not timed; "
            "duty_at_timed_start shows the governor's state where timing began"
        ),
        "workloads": {},
    }

    def save() -> None:
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        path.write_text(json.dumps(report, indent=1) + "\n")

    for index, name in enumerate(workloads):
        left = args.budget_s - (time.monotonic() - started)
        deadline = time.monotonic() + left / (len(workloads) - index)
        entry: dict[str, Any] = report["workloads"].setdefault(name, {"rounds": []})
        measure_workload(name, args, variants, deadline, entry, save)
        save()
    print(table(report))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
