"""A rank that blocks forever inside the user's code: the hang is diagnosed while the job
still hangs (hang records on every rank, the culprit and its stack in `distanom report
--json` and `distanom status`), then the test kills the job."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distanom.cli import main as cli_main
from tests.conftest import job_env, kill_job

AFTER_S = 4.0
POLL_S = 0.5

SCRIPT = """
import sys, threading, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def wait_forever():
    threading.Event().wait()  # the user's code never returns


dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 8)
after_backward = sys.argv[1] == "after_backward"
for step in range(100000):
    if rank == 1 and step == 25 and not after_backward:
        wait_forever()
    opt.zero_grad()
    model(x).sum().backward()
    if rank == 1 and step == 25 and after_backward:
        wait_forever()  # its collectives of the step are done: rank 0 ends step 25
    opt.step()
    time.sleep(0.01)
"""


def _wait_for(predicate: object, deadline: float, job: subprocess.Popen[str]) -> None:
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        assert job.poll() is None, "the job ended; it should hang"
        time.sleep(0.2)
    raise AssertionError("timed out")


def hang_job(tmp_path: Path, where: str, *sets: str) -> list[str]:
    """The 2-rank hanging job's command (the script written into tmp_path)."""
    script = tmp_path / "hang_train.py"
    script.write_text(SCRIPT)
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "distanom.launch", "--run-dir", "runs",
        "--set", f"hang.after_s={AFTER_S}", "--set", f"hang.poll_s={POLL_S}",
        "--set", "tracer.backend=none", *sets, str(script), where,
    ]  # fmt: skip


@pytest.mark.parametrize("where", ["before_backward", "after_backward"])
def test_a_rank_blocked_in_user_code_is_named_while_the_job_hangs(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """after_backward: rank 0 ends one more step than rank 1, so its control thread
    waits in a consensus round for rank 1 meanwhile; the watch does not need it."""
    command = hang_job(tmp_path, where, "--set", "control.status_interval_s=0.5")
    env = job_env(TORCH_FR_BUFFER_SIZE="2000")
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err_file:
        job = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err_file,
            text=True, start_new_session=True,
        )  # fmt: skip
    try:
        runs = tmp_path / "runs"
        hang_dir = runs / "latest" / "hangs" / "hang_1"
        records = [hang_dir / "rank0.json", hang_dir / "rank1.json"]
        _wait_for(lambda: all(p.exists() for p in records), time.monotonic() + 150, job)
        assert job.poll() is None  # diagnosed while the job still hangs
        run = str((runs / "latest").resolve())
        for rank, path in enumerate(records):
            record = json.loads(path.read_text())
            assert record["last_step"] == (25 if rank == 0 and where == "after_backward" else 24)
            # detected within the configured time (two polls late at most, plus load)
            assert AFTER_S <= record["silent_s"] <= AFTER_S + 2 * POLL_S + 3.0
            threads = {t["name"] for t in record["threads"]}
            assert {"MainThread", "distanom-control", "distanom-hang"} <= threads
        capsys.readouterr()
        assert cli_main(["report", "--json", run]) == 0
        hangs = json.loads(capsys.readouterr().out)["hangs"]
        assert len(hangs) == 1
        hang = hangs[0]
        assert hang["culprit_rank"] == 1
        assert hang["step"] == 25
        assert "never entered" in hang["cause"]
        assert any("wait_forever" in frame for frame in hang["ranks"]["1"]["stack"])
        assert hang["ranks"]["0"]["collective"]["completed"] is False
        assert hang["ranks"]["1"]["collective"]["seq"] < hang["ranks"]["0"]["collective"]["seq"]
        assert cli_main(["report", run]) == 0
        assert "HANG 1: hung at step 25: culprit rank 1" in capsys.readouterr().out
        page = tmp_path / "report.html"
        assert cli_main(["report", run, "--html", str(page)]) == 0
        assert "Hangs (1)" in page.read_text() and "wait_forever" in page.read_text()
        assert cli_main(["status", run]) == 0
        status = capsys.readouterr().out
        assert "culprit rank 1" in status
        assert "wait_forever" in status
        assert cli_main(["status", run, "--json"]) == 0
        live = json.loads(capsys.readouterr().out)
        assert live["hangs"][0]["culprit_rank"] == 1 and live["hangs"][0]["step"] == 25
        # rank 0 logs the verdict once every rank's record is in
        _wait_for(lambda: "hang verdict" in stderr.read_text(), time.monotonic() + 60, job)
    finally:
        kill_job(job)  # torchrun and its ranks, each in a session of its own
    err = stderr.read_text()
    for rank in ("r0/2", "r1/2"):
        lines = [
            line for line in err.splitlines() if f"[distanom {rank}]" in line and "HANG:" in line
        ]
        assert len(lines) == 1, err[-3000:]
    verdict = [line for line in err.splitlines() if "hang verdict" in line]
    assert len(verdict) == 1 and "culprit rank 1" in verdict[0]


def test_a_planted_record_does_not_stop_the_live_verdict(tmp_path: Path) -> None:
    """A co-user plants hangs/hang_1/rank5.json (a rank outside the 2-rank world, with a
    frame line of 1e999) before the job hangs: rank 0's watch still logs its verdict."""
    command = hang_job(tmp_path, "before_backward")
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err_file:
        job = subprocess.Popen(
            command, cwd=tmp_path, env=job_env(), stdout=subprocess.DEVNULL, stderr=err_file,
            text=True, start_new_session=True,
        )  # fmt: skip
    try:
        latest = tmp_path / "runs" / "latest"
        _wait_for(lambda: (latest / "run.json").exists(), time.monotonic() + 120, job)
        planted = latest / "hangs" / "hang_1" / "rank5.json"
        planted.parent.mkdir(parents=True, exist_ok=True)
        frame = '{"file": "x.py", "line": 1e999, "function": "f", "code": ""}'
        planted.write_text(
            '{"version": 1, "rank": 5, "world_size": 8, "host": "h", "pid": 1, "number": 1,'
            ' "detected_at": 1.0, "cause": "no_step", "reason": "r", "last_step": 0,'
            ' "silent_s": 1.0, "after_s": 1.0, "flight_recorder": null, "threads":'
            ' [{"ident": 1, "name": "MainThread", "training": true, "frames": [' + frame + "]}]}"
        )
        _wait_for(lambda: "hang verdict" in stderr.read_text(), time.monotonic() + 150, job)
    finally:
        kill_job(job)
    err = stderr.read_text()
    verdict = [line for line in err.splitlines() if "hang verdict" in line]
    assert len(verdict) == 1 and "culprit rank 1" in verdict[0], err[-3000:]
    assert "internal error" not in err
