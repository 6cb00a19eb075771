"""Shared test helpers: repository paths, a fake clock, and running real torchrun jobs on
CPU."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from distanom.records.index import read_index
from distanom.rundir import RunDir

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "examples" / "toy_train.py"
DATA = Path(__file__).resolve().parent / "data"


class Ticks:
    """A fake nanosecond clock that advances `step_ns` at every reading."""

    def __init__(self, step_ns: int = 1000) -> None:
        self.now = 0
        self.step_ns = step_ns

    def __call__(self) -> int:
        self.now += self.step_ns
        return self.now


# every step traced, so a one-off stall is captured (the budget off), judged early
EVERY_STEP_TRACED = [
    *["--set", "tracer.overhead_budget_pct=null"],
    *["--set", "detect.warmup_steps=5", "--set", "detect.min_steps=15"],
    *["--set", "detect.window_steps=60"],
]


def why_not_captured(report: dict, step: int, stderr: str = "") -> dict:
    """What a failed "step was captured" assertion shows: the step's anomaly, the
    captures made, the capture state, its index lines, and the end of the job's log."""
    records, _problems = read_index(RunDir(Path(report["run_dir"])))
    return {
        "anomaly": [a for a in report.get("anomalies", []) if a.get("step") == step],
        "captures": sorted(c["step"] for c in report.get("captures", [])),
        "capture_state": report.get("capture_state"),
        "index": [dict(r.raw) for r in records if r.step == step][:8],
        "log": stderr[-2500:],
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return env


def torchrun(
    nproc: int,
    launch_args: list[str],
    script_args: list[str],
    *,
    cwd: Path,
    timeout: float = 240,
    extra_torchrun: list[str] | None = None,
    env: dict[str, str] | None = None,
    script: Path = TOY,
) -> subprocess.CompletedProcess[str]:
    """Run `torchrun -m distanom.launch` with `script` (the toy script unless given);
    returns the finished process."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(extra_torchrun or ["--standalone"]),
        f"--nproc-per-node={nproc}",
        "-m",
        "distanom.launch",
        *launch_args,
        str(script),
        *script_args,
    ]
    return subprocess.run(
        command,
        cwd=cwd,
        env=env or job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def repo() -> Path:
    return REPO


def launch(args: list[str], *, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `python -m distanom.launch ARGS` in one process (no torchrun)."""
    return subprocess.run(
        [sys.executable, "-m", "distanom.launch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=job_env(),
        timeout=timeout,
        check=False,
    )


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_job(job: subprocess.Popen[str]) -> None:
    """SIGKILL a torchrun job and every rank below it: torchrun starts each rank in its
    own session, so killing torchrun's process group alone leaves hung ranks behind."""
    for pid in [job.pid, *descendants(job.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.wait(timeout=60)
