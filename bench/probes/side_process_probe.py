"""What a per-rank side process would cost and save (issue 38, item 3): a spike, not the
product.

    python3 bench/probes/side_process_probe.py --out $OUT/side.json
        [--steps 4000] [--step-ms 3] [--repeats 2] [--round-steps 64]

Two arrangements of the same launch-bound CPU loop (`control_cost_probe.py`'s: 12 linear
layers of 16, then a busy wait of `--step-ms`), alternated within each repeat:

- `thread`: the agent as built (detection), its control thread doing the rounds,
  detector, evidence and files inside the training process. Its cost to the process is
  the control thread's CPU per step (`agent_cost`'s `control_us_per_step`), all of it
  under the GIL the training thread needs.
- `relay`: the training thread's side exactly as built (`StepBoundaries`, its phase marks
  and evidence marks, the `StepInbox`), but no control thread: a relay thread wakes once
  per `--round-steps` steps, packs the round's step records (the phases as their marks'
  kinds and times, events dropped) and evidence marks into one frame, writes it to a pipe
  and reads the reply. A side process (this script, `--side`; it imports torch and forms
  a one-rank gloo group first, as distanom's group would) unpacks each frame and runs
  the real detector and the steps file's row formatting on it. The process's cost is the
  relay thread's CPU per step.

Per block: ms per training step, the in-process thread's CPU per step, the training
thread's blocks per step (voluntary context switches: GIL hand-overs); for the relay,
the side process's start-up (spawn to ready, with its imports and group) and its memory
(VmHWM), and its own CPU per step (another core's). Linux only. On the 2-core VM the side
process competes with the training loop for the second core, as the control thread does
for the GIL: figures for the design, not a verdict on an H200 host.
"""

from __future__ import annotations

import argparse
import array
import datetime
import itertools
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "probes"))
sys.path.insert(0, str(REPO / "bench" / "workloads"))

REPLY = struct.Struct("<dI")  # the detector's median (ms), decisions made
EVIDENCE_HEAD = struct.Struct("<Q")  # bytes of the steps payload that comes first


def pack_round(records: list[Any], evidence: list[tuple[int, int, int]]) -> bytes:
    """One frame: the round's records as the product packs them (`side_frames`), then
    the evidence marks as one column."""
    from distanom.side_frames import pack_steps

    steps = pack_steps(records)
    marks = array.array("q", itertools.chain.from_iterable(evidence))
    return EVIDENCE_HEAD.pack(len(steps)) + steps + marks.tobytes()


def unpack_round(payload: bytes) -> tuple[list[Any], list[tuple[int, ...]]]:
    """The records again (phases with events None), and the evidence marks."""
    from distanom.side_frames import unpack_steps

    (size,) = EVIDENCE_HEAD.unpack_from(payload)
    at = EVIDENCE_HEAD.size
    records = unpack_steps(payload[at : at + size])
    marks = array.array("q")
    marks.frombytes(payload[at + size :])
    return records, [tuple(marks[j : j + 3]) for j in range(0, len(marks), 3)]


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def side_main(read_fd: int, write_fd: int) -> int:
    """The side process: imports, a one-rank gloo group, then frames until EOF."""
    began = time.perf_counter()
    import torch.distributed as dist

    from distanom.config import load_config
    from distanom.detect import Detector, StepSample
    from distanom.phase_split import phase_values
    from distanom.records.steps import ROW_FORMAT

    wait = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=wait)
    group = dist.ProcessGroupGloo(store, 0, 1)  # as distanom's group: no init_process_group
    config = load_config(None, ["tracer.backend=none"])
    detector = Detector(config.detect, config.capture)
    ready_ms = (time.perf_counter() - began) * 1e3
    os.write(write_fd, struct.pack("<d", ready_ms))
    sink = open(os.devnull, "w")  # noqa: SIM115 - the whole process's life
    cpu_began = time.process_time()
    steps = 0
    while True:
        head = _read_exact(read_fd, 4)
        if head is None:
            break
        (size,) = struct.unpack("<I", head)
        frame = _read_exact(read_fd, size)
        if frame is None:
            break
        records, _evidence = unpack_round(frame)
        steps += len(records)
        samples = [StepSample(r[0], (r[1],), bool(r[2] & 1)) for r in records]
        decisions = detector.observe_many(samples)
        rows = [(r[0], r[1], r[2] & 1, r[2] & 2, r[3], r[4], r[5], r[2] & 8,
                 *phase_values(r[6])) for r in records]  # fmt: skip
        sink.write("".join([ROW_FORMAT % row for row in rows]))
        median = detector.median_ms if detector.median_ms is not None else float("nan")
        os.write(write_fd, REPLY.pack(median, len(decisions)))
    cpu_s = time.process_time() - cpu_began
    with open("/proc/self/status") as status:
        hwm = next((line.split()[1] for line in status if line.startswith("VmHWM")), "0")
    os.write(write_fd, struct.pack("<dqd", cpu_s, steps, float(hwm) / 1024))
    del group
    return 0


def _training_loop(steps: int, step_ms: float) -> tuple[float, int]:
    import torch
    from ab_switch import thread_blocks
    from control_cost_probe import launch_bound_steps

    torch.set_num_threads(1)
    layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(12)])
    optimizer = torch.optim.SGD(layers.parameters(), lr=1e-3)
    inputs = torch.randn(4, 16)
    began, blocked = time.perf_counter(), thread_blocks() or 0
    launch_bound_steps(layers, optimizer, inputs, steps, step_ms)
    return time.perf_counter() - began, (thread_blocks() or 0) - blocked


def block_thread(steps: int, step_ms: float) -> dict[str, Any]:
    """The agent as built: its control thread in this process."""
    from distanom.agent import Agent
    from distanom.config import load_config
    from distanom.world import WorldInfo

    with tempfile.TemporaryDirectory() as scratch:
        config = load_config(None, ["tracer.backend=none"])
        agent = Agent(config, WorldInfo.from_env({}), Path(scratch) / "r")
        agent.install()
        wall_s, blocks = _training_loop(steps, step_ms)
        agent.close()
        own = agent.own_cost()
    return {
        "ms_per_step": round(wall_s * 1e3 / steps, 4),
        "in_process_us_per_step": own["control_us_per_step"],
        "boundary_us_per_step": own["boundary_us_per_step"],
        "training_blocks_per_step": round(blocks / steps, 4),
    }


def block_relay(steps: int, step_ms: float, round_steps: int) -> dict[str, Any]:
    """The training thread's side as built, a relay thread, a side process."""
    from distanom.boundary import FINAL, StepBoundaries
    from distanom.config import load_config
    from distanom.duty_cycle import DutyCycle
    from distanom.health import Health
    from distanom.inbox import StepInbox

    config = load_config(None, ["tracer.backend=none"])
    to_side_r, to_side_w = os.pipe()
    from_side_r, from_side_w = os.pipe()
    spawned = time.perf_counter()
    side = subprocess.Popen(
        [sys.executable, __file__, "--side", str(to_side_r), str(from_side_w)],
        pass_fds=(to_side_r, from_side_w),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path[:3])},
    )
    os.close(to_side_r)
    os.close(from_side_w)
    (side_ready_ms,) = struct.unpack("<d", _read_exact(from_side_r, 8) or b"\0" * 8)
    startup_ms = (time.perf_counter() - spawned) * 1e3
    health = Health()
    inbox = StepInbox(FINAL)
    boundaries = StepBoundaries(config, 0, health, DutyCycle(config), inbox)
    boundaries.install_hook()
    boundaries.gc_pauses.install()
    relay_cpu = [0]

    def relay() -> None:
        evidence = boundaries.evidence_marks.marks
        ended = False
        while not ended:
            inbox.wake_at = round_steps
            items = inbox.take(1.0)
            records = [item for item in items if item is not FINAL]
            ended = len(records) != len(items)
            marks = [evidence.popleft() for _ in range(len(evidence))]
            if records:
                frame = pack_round(records, marks)
                os.write(to_side_w, struct.pack("<I", len(frame)) + frame)
                _read_exact(from_side_r, REPLY.size)
        relay_cpu[0] = time.thread_time_ns()

    thread = threading.Thread(target=relay, name="distanom-relay", daemon=True)
    thread.start()
    wall_s, blocks = _training_loop(steps, step_ms)
    boundaries.closed = True
    boundaries.remove_hook()
    boundaries.drain(5.0)
    inbox.put(FINAL)
    thread.join(30)
    os.close(to_side_w)
    cpu_s, side_steps, hwm_mb = struct.unpack("<dqd", _read_exact(from_side_r, 24) or b"\0" * 24)
    side.wait(30)
    os.close(from_side_r)
    boundaries.gc_pauses.uninstall()
    return {
        "ms_per_step": round(wall_s * 1e3 / steps, 4),
        "in_process_us_per_step": round(relay_cpu[0] / steps / 1e3, 2),
        "boundary_us_per_step": round(boundaries.own_ns / max(1, boundaries.current_step) / 1e3, 2),
        "training_blocks_per_step": round(blocks / steps, 4),
        "side_startup_ms": round(startup_ms, 1),
        "side_ready_ms": round(side_ready_ms, 1),
        "side_cpu_us_per_step": round(cpu_s * 1e6 / max(1, side_steps), 2),
        "side_steps": side_steps,
        "side_vm_hwm_mb": round(hwm_mb, 1),
    }


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--side":
        return side_main(int(sys.argv[2]), int(sys.argv[3]))
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--step-ms", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--round-steps", type=int, default=64)
    args = parser.parse_args()
    import torch
    from boundary_cost_probe import write_json

    rows: dict[str, list[dict[str, Any]]] = {"thread": [], "relay": []}
    out: dict[str, Any] = {
        "bench": "bench/probes/side_process_probe.py " + " ".join(sys.argv[1:]),
        "facts": {
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "blocks": rows,
    }
    for _ in range(args.repeats):
        rows["thread"].append(block_thread(args.steps, args.step_ms))
        print("thread", json.dumps(rows["thread"][-1]), flush=True)
        rows["relay"].append(block_relay(args.steps, args.step_ms, args.round_steps))
        print("relay", json.dumps(rows["relay"][-1]), flush=True)
        write_json(args.out, out)
    out["median"] = {
        name: {key: statistics.median(r[key] for r in mine) for key in mine[0]}
        for name, mine in rows.items()
    }
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
