"""What a co-user of a shared run directory can plant among the records the job and the
report share (hangs/, anomalies.jsonl, stragglers.json, steps/): each probe of issue 37
as a function that damages a run made by `tests.unit.rungen` (not a test module).

Used by tests/unit/test_hostile_records.py and by `python -m tests.unit.hostile_plants`
(which plants every probe into a folder and measures `distanom report` on each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from distanom.records.hangs import (
    CAUSE_NO_STEP,
    Frame,
    HangRecord,
    ThreadStack,
    record_path,
    write_hang_record,
)
from distanom.rundir import RunDir, write_json_atomic
from tests.unit.rungen import Capture, make_run
from tests.unit.stepgen import gpu_job

TERABYTE = 1 << 40


def a_run(base: Path, hosts: tuple[str, ...] = ("a", "b")) -> RunDir:
    """A finished 2-rank run with one anomaly capture at step 20."""
    return make_run(base, [Capture(20, "anomaly", gpu_job(len(hosts)), 4.1, 1.2)], hosts=hosts)


def hang_record(rank: int, *, number: int = 1, world_size: int = 2) -> HangRecord:
    """A well-formed hang record of `rank`."""
    stack = ThreadStack(1, "MainThread", True, [Frame("train.py", 10, "main", "step()")])
    return HangRecord(
        rank=rank, world_size=world_size, host="h", pid=100 + rank, number=number,
        detected_at=1000.0, cause=CAUSE_NO_STEP, reason="no step has ended for 4 s",
        last_step=24, silent_s=4.2, after_s=4.0, threads=[stack], flight_recorder=None,
        flight_recorder_note="off",
    )  # fmt: skip


def plant_record(run: RunDir, number: int, rank: int, body: dict[str, object] | str) -> Path:
    """Write a hang record file as a co-user would (any body, no checks)."""
    path = record_path(run, number, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return path


def hang_memory_bomb(run: RunDir, folders: int = 20) -> None:
    """Probe 1: hang folders of one record each claiming the largest world size."""
    for number in range(1, folders + 1):
        record = replace(hang_record(0, number=number), world_size=131072)
        write_hang_record(run, record)


def overflowing_hang_record(run: RunDir) -> None:
    """Probe 3: a record of a rank outside the world with an infinite frame line."""
    write_hang_record(run, hang_record(0))
    text = json.dumps(replace(hang_record(5), world_size=8).as_json())
    plant_record(run, 1, 5, text.replace('"line": 10', '"line": 1e999'))


def sparse_anomalies(run: RunDir, size: int = TERABYTE) -> None:
    """Probe 2: a sparse anomalies.jsonl without a newline."""
    path = run.path / "anomalies.jsonl"
    path.write_bytes(b'{"step": 1')
    os.truncate(path, size)


def sparse_steps(run: RunDir, size: int = TERABYTE) -> None:
    """Probe 2: a sparse steps file whose second line never ends."""
    path = run.steps_csv(1)
    with path.open("a") as handle:
        handle.write("1")
    os.truncate(path, size)


def ranks_times_steps(run: RunDir, ranks: int = 64, steps: int = 20_000) -> None:
    """Probe 4: a world of 64 ranks, each with steps no other rank has."""
    info = json.loads(run.run_json.read_text())
    write_json_atomic(run.run_json, {**info, "world_size": ranks, "hosts": ["a"] * ranks})
    for rank in range(ranks):
        first = rank * steps + 1
        rows = "".join(f"{s},1.5,1\n" for s in range(first, first + steps))
        run.steps_csv(rank).write_text("step,duration_ms,traced\n" + rows)


def anomaly_line(step: object, **extra: object) -> str:
    """An anomalies.jsonl line for a 2-rank run."""
    body = {
        "v": 1, "step": step, "step_ms": 4.0, "median_ms": 1.5, "threshold_ms": 2.25,
        "traced": False, "judged_by": "condition", "slowest_rank": 1,
        "durations_ms": [1.5, 4.0], "evidence": [{}, {"arrive_ms": 2.5}],
    }  # fmt: skip
    body.update(extra)
    return json.dumps(body)


def absurd_steps(run: RunDir) -> None:
    """Probe 5: steps near 10**299, negative, boolean and duplicated-key lines."""
    lines = [anomaly_line(1e299 * (1 + i / 7)) for i in range(300)]
    lines += [anomaly_line(-5), anomaly_line(True), anomaly_line(2**70)]
    lines.append(anomaly_line(30)[:-1] + ', "step": 10000000000000000000000}')
    (run.path / "anomalies.jsonl").write_text("\n".join(lines) + "\n")


def long_evidence(run: RunDir, lines: int = 10, entries: int = 349_000) -> None:
    """Probe 6: lines whose per-rank arrays are far longer than the world."""
    evidence = "[" + ",".join(["{}"] * entries) + "]"
    text = anomaly_line(40).replace('[{}, {"arrive_ms": 2.5}]', evidence)
    (run.path / "anomalies.jsonl").write_text((text + "\n") * lines)


def stragglers(run: RunDir, body: object) -> None:
    """Probe 7: any stragglers.json body."""
    (run.path / "stragglers.json").write_text(body if isinstance(body, str) else json.dumps(body))


BAD_STRAGGLERS = [
    {"stragglers": [{"rank": 1, "score": 0.3, "since_step": 5, "evidence": "x"}]},
    '{"stragglers": [{"rank": 1, "score": 1e999, "since_step": 5, "evidence": {}}]}',
    {"stragglers": [{"rank": 1, "score": 0.3, "detected_at": "nan", "evidence": {}}]},
    {"earlier": [{"rank": "x\ny", "since_step": 10**400, "until_step": None}], "drift": 3},
    '{"drift": {"first_ms": 1e999, "last_ms": -1e999, "ratio": 1e999}}',
]


def huge_straggler_list(run: RunDir, entries: int = 20_000) -> None:
    """Probe 8: an uncapped straggler list (~3.5 MB in, under the 4 MB file cap)."""
    entry = {"rank": 1, "score": 0.3, "since_step": 5, "evidence": {"late_steps": 40}}
    stragglers(run, {"stragglers": [entry] * entries, "earlier": [entry] * entries})


def huge_step_time(run: RunDir) -> None:
    """Probe 7: a finite 1.7e308 step time (charts without matplotlib)."""
    with run.steps_csv(0).open("a") as handle:
        handle.write("150,1.7e308,0\n151,-1.7e308,0\n")


PROBES: dict[str, Callable[[RunDir], None]] = {
    "hang_memory_bomb": hang_memory_bomb,
    "sparse_anomalies": sparse_anomalies,
    "sparse_steps": sparse_steps,
    "overflowing_hang_record": overflowing_hang_record,
    "ranks_times_steps": ranks_times_steps,
    "absurd_steps": absurd_steps,
    "long_evidence": long_evidence,
    "huge_straggler_list": huge_straggler_list,
    "huge_step_time": huge_step_time,
}


# Runs a command and prints its peak RSS: a fresh parent whose only child is the report
# (RUSAGE_CHILDREN is the largest of all children a process has waited for).
_PEAK = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:], stdout=subprocess."
    "DEVNULL).returncode; print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def measure_report(run: RunDir, *args: str) -> tuple[int, float, float, str]:
    """`distanom report RUN *args` in a child process: exit status, seconds, the child's
    peak RSS (MB) and stderr's last line."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    report = [sys.executable, "-m", "distanom", "report", str(run.path), *args]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, *report], env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    seconds = time.monotonic() - started
    code, peak_kb = (int(v) for v in done.stdout.split()[-2:])
    tail = (done.stderr.strip().splitlines() or [""])[-1]
    return code, seconds, peak_kb / 1024, tail


def main() -> None:
    """Plant each probe into a fresh run and print report's time and peak RSS (a fresh
    interpreter per probe, so each peak is that probe's own)."""
    if len(sys.argv) > 1:
        name, args = sys.argv[1], sys.argv[2:]
        with tempfile.TemporaryDirectory() as base:
            run = a_run(Path(base))
            PROBES[name](run)
            code, seconds, peak, tail = measure_report(run, *args)
        print(f"{name:26} {' '.join(args):7} exit {code}  {seconds:6.2f} s  {peak:7.1f} MB  {tail}")
        return
    for name in PROBES:
        for args in ([], ["--json"]):
            command = [sys.executable, "-u", "-m", "tests.unit.hostile_plants", name, *args]
            subprocess.run(command, check=False)


if __name__ == "__main__":
    main()
