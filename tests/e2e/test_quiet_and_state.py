"""What a job prints and how its run ends: one start and one end line per rank, a line per
anomaly capture on rank 0, no profiler noise; status.json says failed / interrupted with
the exit status when the script did not finish."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TOY, launch, torchrun

FAST = [  # every step traced (a one-off stall is captured): the budget off
    *["--set", "tracer.overhead_budget_pct=null"],
    *["--set", "detect.warmup_steps=5", "--set", "detect.min_steps=15"],
]


def final_status(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "r" / "latest" / "status.json").read_text())


def test_a_job_prints_a_start_and_an_end_line_per_rank_and_its_captures(tmp_path: Path) -> None:
    done = torchrun(
        2,
        ["--run-dir", "runs", *FAST, "--set", "capture.reference_every_steps=20"],
        ["--steps", "80", "--stall-rank", "1", "--stall-steps", "50", "--stall-s", "0.5"],
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "USDT" not in done.stderr and "profiler_start" not in done.stderr
    ours = [line for line in done.stderr.splitlines() if line.startswith("[distanom")]
    starts = [line for line in ours if "INFO started: steps end at SGD.step()" in line]
    ends = [line for line in ours if "INFO finished: 80 steps;" in line]
    captures = [line for line in ours if "captured step" in line]
    assert len(starts) == 2 and len(ends) == 2, ours
    assert all(line.startswith("[distanom r0/2]") for line in captures)
    assert any("captured step 50 (anomaly" in line for line in captures)
    assert not any("reference" in line for line in captures)
    # a loaded machine can make a rank a straggler: rank 0 says so once, like a capture
    stragglers = [line for line in ours if "INFO straggler: rank" in line]
    assert all(line.startswith("[distanom r0/2]") for line in stragglers)
    # nothing else at INFO (a warning, e.g. a capture missed on a loaded machine, may show)
    info = [line for line in ours if " INFO " in line]
    expected = len(starts) + len(ends) + len(captures) + len(stragglers)
    assert len(info) == expected, "\n".join(ours)
    assert "trace files" in ends[0] and "ms of capture work" in ends[0]


def test_log_level_debug_brings_the_details_back(tmp_path: Path) -> None:
    done = launch(
        ["--run-dir", "r", "--set", "log.level=DEBUG", str(TOY), "--steps", "30"], cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "USDT" in done.stderr  # kineto's own lines are back


@pytest.mark.parametrize(
    ("body", "state", "code"),
    [
        ("import sys; sys.exit(3)", "failed", 3),
        ("raise ValueError('boom')", "failed", 1),
        ("raise KeyboardInterrupt", "interrupted", 130),
        ("pass", "finished", 0),
    ],
)
def test_the_runs_state_says_how_the_script_ended(
    tmp_path: Path, body: str, state: str, code: int
) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(5):\n"
        "    model(torch.randn(2, 4)).sum().backward()\n"
        "    opt.step()\n"
        f"{body}\n"
    )
    done = launch(["--run-dir", "r", str(script)], cwd=tmp_path)
    assert done.returncode != 0 if code else done.returncode == 0, done.stderr[-2000:]
    status = final_status(tmp_path)
    assert status["state"] == state and status["exit_code"] == code
    ended = state if code == 0 else f"{state} (exit status {code})"
    assert f"INFO {ended}: 5 steps;" in done.stderr


UNEVEN = """
import os, time
import torch
rank = int(os.environ["RANK"])
# rank 1 ends first (uneven data, a dropped tail); rank 0 runs on past the next round
# (away from traced steps, rounds cover ~1 s of steps)
steps = 250 if rank == 0 else 40
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(steps):
    model(torch.ones(2, 4)).sum().backward()
    time.sleep(0.01)
    optimizer.step()
    optimizer.zero_grad()
"""


def test_a_rank_that_ends_first_ends_consensus_cleanly(tmp_path: Path) -> None:
    """The others learn it from its final round: one line, no failed all-gather, no wait."""
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN)
    done = torchrun(2, ["--run-dir", "r"], [], cwd=tmp_path, script=script)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = [line for line in done.stderr.splitlines() if line.startswith("[distanom")]
    ended = [line for line in ours if "consensus ended: rank 1 ended its training first" in line]
    assert len(ended) == 1 and ended[0].startswith("[distanom r0/2] INFO"), ours
    assert not [line for line in ours if "WARNING" in line or "abandoned" in line], ours
    assert any("INFO finished: 250 steps" in line for line in ours)
    status = final_status(tmp_path)
    assert status["state"] == "finished" and status["consensus_error"].startswith(
        "consensus ended: rank 1"
    )
    steps = (tmp_path / "r" / "latest" / "steps" / "rank0.csv").read_text().splitlines()
    assert int(steps[-1].split(",")[0]) == 249  # rank 0's steps recorded to its end


def test_a_script_that_changes_directory_still_writes_into_its_run(tmp_path: Path) -> None:
    # Hydra's job.chdir and many scripts move to an output folder once started: the run
    # directory given as `runs` stays the one under the launch directory
    script = tmp_path / "moving_train.py"
    script.write_text(
        "import os, runpy, sys\n"
        "os.makedirs('elsewhere', exist_ok=True)\n"
        "os.chdir('elsewhere')\n"
        f"sys.argv = [{str(TOY)!r}, *sys.argv[1:]]\n"
        f"runpy.run_path({str(TOY)!r}, run_name='__main__')\n"
    )
    done = torchrun(
        2,
        ["--run-dir", "runs", *FAST],
        ["--steps", "60", "--stall-rank", "1", "--stall-steps", "40", "--stall-s", "0.4"],
        cwd=tmp_path,
        script=script,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "elsewhere" / "runs").exists()
    run = (tmp_path / "runs" / "latest").resolve()
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert len((run / "steps" / "rank1.csv").read_text().splitlines()) > 50
    assert list(run.glob("captures/step_40/rank*.trace.json.gz"))
    ends = [line for line in done.stderr.splitlines() if "INFO finished: 60 steps" in line]
    assert len(ends) == 2 and all(f"in runs/{run.name};" in line for line in ends), ends
