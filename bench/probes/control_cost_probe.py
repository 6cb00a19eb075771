"""Where the control thread's CPU time goes, per step, on a launch-bound CPU loop.

    python3 bench/probes/control_cost_probe.py --out $OUT/control.json
        [--steps 6000] [--step-ms 3] [--repeats 3] [--define NAME KEY=VALUE ...]
        [--fake-cupti] [--unpaced]

One process, world size 1, a fresh agent per block (detection alone by default,
`--define` adds variants; `--fake-cupti` gives a `tracer.backend=cupti` variant the CUPTI
tracer with CUDA faked, as `boundary_cost_probe.py --fake-cupti` does). The loop is the
CPU one of `bench/agent_cost_cpu.py` (12 linear layers of 16: all Python dispatch, ~1 ms)
followed by a busy wait of `--step-ms`, so rounds hold about as many steps as on a GPU
loop of that step time. The probe wraps, from outside,
the control thread's sections (a round, its decode and encode, the detector, the
evidence fold and poll, the steps file, the status file, the inbox, the pacer's pauses,
the request poll) and reads the thread CPU time (`time.thread_time_ns`) each call spent
and how often it blocked (voluntary context switches: a wait, a sleep, the GIL taken
back), on the control thread only; and how often the training thread blocked per step
(the busy wait holds the GIL, as launching does: its blocks are GIL hand-overs). CPU
figures are microseconds of control-thread CPU per training step. Sections nest (a round
holds the detector, the fold and two pauses; `_round_loop` holds everything):
`control_us_per_step` is the whole, the agent's own figure. Linux only (getrusage's
RUSAGE_THREAD). The meters' own reads (two CPU-clock and two getrusage calls per metered
call, some nested) are inside the CPU figures, not measured apart; the block counts are
not inflated by them (neither call lets the GIL go).

The control thread's CPU time is what it can take from a launch-bound training thread
(both need the GIL); this probe says which of its parts to shrink. CPU only, so it runs
on any machine; the H200's figures for the whole thread are in `boundary_cost_probe.py`.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "probes"))  # its faked CUPTI and JSON writer
sys.path.insert(0, str(REPO / "bench" / "workloads"))  # the A/B's block count, unpacing

from ab_switch import thread_blocks, unpace_rounds  # noqa: E402
from boundary_cost_probe import fake_cupti, write_json  # noqa: E402

from distanom import consensus, control_loop  # noqa: E402
from distanom.agent import Agent  # noqa: E402
from distanom.anomaly_journal import AnomalyJournal  # noqa: E402
from distanom.boundary import StepBoundaries  # noqa: E402
from distanom.config import load_config  # noqa: E402
from distanom.detect import Detector  # noqa: E402
from distanom.evidence import EvidenceCollector, EvidenceTier  # noqa: E402
from distanom.inbox import StepInbox  # noqa: E402
from distanom.pacing import RoundPacer  # noqa: E402
from distanom.request_desk import RequestDesk  # noqa: E402
from distanom.rounds import RoundBuilder  # noqa: E402
from distanom.side_link import SideSteps  # noqa: E402
from distanom.step_log import StepLog  # noqa: E402
from distanom.world import WorldInfo  # noqa: E402

CONTROL_THREAD = "distanom-control"
UNPACED = "detect_unpaced"  # the variant `--unpaced` adds
CPU_NS: collections.Counter[str] = collections.Counter()
CALLS: collections.Counter[str] = collections.Counter()
BLOCKS: collections.Counter[str] = collections.Counter()

# (owner, method): the sections metered. A round (`_run_round`) holds `_after_round`, the
# detector, the fold and two of a pass's three pauses; the rest run between rounds.
SECTIONS: list[tuple[Any, str]] = [
    (control_loop.ControlLoop, "_run_round"),
    (control_loop.ControlLoop, "_after_round"),
    (control_loop.ControlLoop, "_fold_evidence"),
    (SideSteps, "write"),  # a round's frame for the side process (control.side_process)
    (SideSteps, "flush"),
    (StepLog, "write"),  # the rows written here (control.side_process false)
    (StepLog, "flush"),
    (StepBoundaries, "collect"),  # a deferred (CUDA event) clock's steps, made at a take
    (control_loop.ControlLoop, "_write_status"),
    (Detector, "observe_many"),
    (AnomalyJournal, "add_evidence"),
    (AnomalyJournal, "add_times_many"),
    (EvidenceTier, "fold"),
    (EvidenceTier, "poll"),
    (EvidenceCollector, "poll"),
    (RoundBuilder, "take"),
    (RoundBuilder, "add_many"),
    (StepInbox, "take"),
    (RoundPacer, "pause"),
    (RequestDesk, "poll"),
    (control_loop.ControlLoop, "_round_loop"),  # the whole thread's work, once
]


def blocks_so_far() -> int:
    """How often the calling thread has blocked (voluntary context switches): waiting
    for the GIL, a sleep, a wait. `getrusage` keeps the GIL, so counting adds none."""
    blocks = thread_blocks()
    assert blocks is not None  # main() refuses to run where there is no count
    return blocks


def meter(owner: Any, name: str, label: str) -> None:
    """Wrap `owner.name` (a class's method, or a module's function) to add the control
    thread's CPU time and blocks in each call to `label`; other threads' calls pass
    through."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def metered(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name != CONTROL_THREAD:
            return original(*args, **kwargs)
        began, blocked = time.thread_time_ns(), blocks_so_far()
        try:
            return original(*args, **kwargs)
        finally:
            CPU_NS[label] += time.thread_time_ns() - began
            BLOCKS[label] += blocks_so_far() - blocked
            CALLS[label] += 1

    setattr(owner, name, metered)


def install_meters() -> None:
    for owner, name in SECTIONS:
        meter(owner, name, f"{owner.__name__}.{name}")
    # the row codec, as the control loop module imported it (small worlds: lists)
    for name in ("encode_row", "decode_rows"):
        assert getattr(control_loop, name) is getattr(consensus, name)
        meter(control_loop, name, f"consensus.{name}")


def launch_bound_steps(
    layers: Any, optimizer: Any, inputs: Any, steps: int, step_ms: float
) -> None:
    """The probe's loop (also side_process_probe.py's): a tiny model's step, all Python
    dispatch, then a busy wait of `step_ms`, as a launching thread is busy."""
    for _ in range(steps):
        layers(inputs).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        until = time.perf_counter() + step_ms / 1e3
        while time.perf_counter() < until:
            pass


def block(
    overrides: list[str], steps: int, step_ms: float, unpaced: bool = False
) -> dict[str, Any]:
    """One agent over `steps` steps; `unpaced`: its rounds run in one piece (no pacer
    pauses, as `bench/whole_job_ab.py`'s `+nopause`)."""
    undo = unpace_rounds() if unpaced else None
    try:
        return _block(overrides, steps, step_ms)
    finally:
        if undo is not None:
            undo()


def _block(overrides: list[str], steps: int, step_ms: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(12)])
    optimizer = torch.optim.SGD(layers.parameters(), lr=1e-3)
    inputs = torch.randn(4, 16)
    CPU_NS.clear()
    CALLS.clear()
    BLOCKS.clear()
    with tempfile.TemporaryDirectory() as scratch:
        agent = Agent(load_config(None, overrides), WorldInfo.from_env({}), Path(scratch) / "r")
        agent.install()
        began, blocked = time.perf_counter(), blocks_so_far()
        launch_bound_steps(layers, optimizer, inputs, steps, step_ms)
        wall_s = time.perf_counter() - began
        training_blocks = blocks_so_far() - blocked
        agent.close()
        own = agent.own_cost()
    sections = {
        label: {
            "calls": CALLS[label],
            "us_per_step": round(CPU_NS[label] / steps / 1e3, 2),
            "us_per_call": round(CPU_NS[label] / max(1, CALLS[label]) / 1e3, 1),
            "blocks": BLOCKS[label],
        }
        for label in sorted(CPU_NS, key=lambda k: -CPU_NS[k])
    }
    return {
        "ms_per_step": round(wall_s * 1e3 / steps, 3),
        "control_us_per_step": own["control_us_per_step"],
        "boundary_us_per_step": own["boundary_us_per_step"],
        "rounds": CALLS["ControlLoop._run_round"],
        # GIL hand-overs, roughly: the training thread's blocks while it trained
        "training_blocks_per_step": round(training_blocks / steps, 4),
        "sections": sections,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--step-ms", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--define", nargs="+", action="append", default=[])
    parser.add_argument("--commit", default=None)
    parser.add_argument(
        "--fake-cupti", action="store_true", help="the CUPTI tracer with CUDA faked (a default)"
    )
    parser.add_argument(
        "--unpaced",
        action="store_true",
        help="add detect_unpaced: detection with its rounds unpaced (no pacer pauses)",
    )
    args = parser.parse_args()
    if thread_blocks() is None:
        parser.error("needs Linux: the block counts read getrusage(RUSAGE_THREAD)")
    if args.fake_cupti:  # as boundary_cost_probe.py fakes it
        fake_cupti()
    install_meters()
    variants: dict[str, list[str]] = {"detect": ["tracer.backend=none"]}
    if args.unpaced:
        variants[UNPACED] = ["tracer.backend=none"]
    for name, *overrides in args.define:
        variants[name] = overrides
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    out: dict[str, Any] = {
        "facts": {
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "distanom_commit": args.commit,
        },
        "params": {k: str(v) for k, v in vars(args).items()},
        "blocks": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(args.repeats):  # variants alternate within each repeat
        for name, overrides in variants.items():
            rows[name].append(block(overrides, args.steps, args.step_ms, name == UNPACED))
            print(name, json.dumps(rows[name][-1]), flush=True)
            # after every block: a run cut by a time limit keeps what it measured
            write_json(args.out, out)
    out["median"] = {
        name: {
            "control_us_per_step": statistics.median(r["control_us_per_step"] for r in mine),
            "sections_us_per_step": {
                label: statistics.median(r["sections"].get(label, {}).get("us_per_step", 0.0)
                                         for r in mine)
                for label in mine[0]["sections"]
            },
        }
        for name, mine in rows.items()
    }  # fmt: skip
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
