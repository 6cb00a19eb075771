"""Where a rank's side process spends its CPU (issue 38, item 3): start-up, rows, idle.

    python3 bench/probes/side_cpu_probe.py --out $OUT/side_cpu.json [--rounds 400]

A real side process (`side_link.SideSteps`, as the agent starts it) takes over a steps
file; the probe reads its CPU time (/proc) at four points: once it has said it reads
(start-up: the interpreter, its imports), after `--rounds` rounds of 64 steps sent
back to back (the rows), after `--idle-s` seconds with nothing sent (idle: its poll and
parent checks), and after the same rounds sent 10 ms apart (rows at a job's pace, each
round a wake-up). Also the side process's own import time (`python -X importtime` of
`distanom.side_main`, its ten slowest modules) and the threads it runs. Linux only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from distanom.health import Health  # noqa: E402
from distanom.phase_split import NO_RAW  # noqa: E402
from distanom.side_link import SideSteps  # noqa: E402
from distanom.step_record import StepRecord  # noqa: E402

ROUND_STEPS = 64


def _round(first: int) -> list[StepRecord]:
    """A round of steps with four host marks each, as a training loop's phases give."""
    out = []
    for step in range(first, first + ROUND_STEPS):
        base = 1_000_000 * step
        marks = [(0, base + 100_000, None), (1, base + 400_000, None), (2, base + 800_000, None)]
        phases = (marks, base, base + 990_000, 20_000, (0.3, 0.4, 0.2)) if step % 5 else NO_RAW
        out.append(StepRecord(step, 1.0 + (step % 7) / 100, 0, 0.0, 0.0, -1, phases))
    return out


def _cpu(steps: SideSteps) -> int:
    used = steps.cpu_ns()
    return used[0] if used else 0


def _threads(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None


def _slowest_imports(count: int = 10) -> list[tuple[str, int]]:
    """The side process's imports that took longest (cumulative us), as it starts."""
    code = f"import sys; sys.path[0] = {str(REPO)!r}; import distanom.side_main"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = []
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((parts[2].rstrip(), int(parts[1])))
    return sorted(rows, key=lambda row: -row[1])[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--idle-s", type=float, default=5.0)
    args = parser.parse_args()
    run = Path(tempfile.mkdtemp()) / "steps" / "rank0.csv"
    run.parent.mkdir(parents=True)
    steps = SideSteps(Health(), "probe", use_side=True)
    began = time.monotonic()
    steps.open(run)
    while steps.link is None and time.monotonic() - began < 60:
        time.sleep(0.005)
        steps.flush()  # where the rank looks whether it is ready
    ready_s = time.monotonic() - began
    link = steps.link
    assert link is not None, "the side process never took the file over"
    pid = link.process.pid
    cpu = [_cpu(steps)]
    rounds = [_round(r * ROUND_STEPS) for r in range(args.rounds)]
    for items in rounds:
        steps.write(items)
    steps.flush()
    time.sleep(1.0)  # let it drain
    cpu.append(_cpu(steps))
    time.sleep(args.idle_s)
    cpu.append(_cpu(steps))
    for items in rounds:
        steps.write(items)
        time.sleep(0.01)
    steps.flush()
    time.sleep(1.0)
    cpu.append(_cpu(steps))
    threads = _threads(pid)
    steps.close()
    sent = args.rounds * ROUND_STEPS
    result = {
        "facts": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "ready_s": round(ready_s, 3),
        "startup_cpu_ms": cpu[0] / 1e6,
        "startup_cpu_ms_as_reported": ((steps.cpu_ns() or (0, 0))[1]) / 1e6,
        "rows_back_to_back_us_per_step": round((cpu[1] - cpu[0]) / sent / 1e3, 2),
        "idle_cpu_ms_per_s": round((cpu[2] - cpu[1]) / 1e6 / args.idle_s, 3),
        "rows_paced_us_per_step": round((cpu[3] - cpu[2]) / sent / 1e3, 2),
        "steps_per_pass": sent,
        "side_threads": threads,
        "slowest_imports_us": _slowest_imports(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
