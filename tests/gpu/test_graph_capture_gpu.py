"""CUDA graph loops under `torchrun -m distanom.launch` at the default config (skipped
without CUDA), as torch's documentation shows them (tests/e2e/scripts/graph_train.py):
a whole iteration captured with `torch.cuda.graph` in its default global mode, where an
event query from any thread breaks the capture, and a model passed mid-run to
`make_graphed_callables`, which refuses a module with forward hooks. Each job must train
as it does without distanom, and distanom's steps file must hold the eager steps and,
for the whole-iteration graph, each replay as a step, the one spanning the capture left
out (distanom.graph_capture); a stall before a replay is captured at that step.

Run on the device machine: `python3 -m pytest tests/gpu/test_graph_capture_gpu.py -m gpu -q`.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import REPO, torchrun
from tests.e2e.test_frameworks import FAST, report

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

SCRIPT = REPO / "tests" / "e2e" / "scripts" / "graph_train.py"
EAGER, GRAPH_STEPS = 40, 50


def run(tmp_path: Path, args: list[str], launch: Sequence[str] = ()) -> tuple[float, float, float]:
    """Run the script on one GPU; returns its losses (before, after the graphs, end)."""
    done = torchrun(
        1,
        ["--run-dir", "runs", *launch],
        ["--eager", str(EAGER), "--graph-steps", str(GRAPH_STEPS), *args],
        cwd=tmp_path,
        script=SCRIPT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = re.search(r"loss (\S+) -> (\S+) -> (\S+)", done.stdout)
    assert found, done.stdout[-2000:]
    first, middle, last = (float(value) for value in found.groups())
    assert middle < first and last < first, (first, middle, last)
    return first, middle, last


def timed_steps(tmp_path: Path) -> set[int]:
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and not p.is_symlink()]
    with open(run_dir / "steps" / "rank0.csv") as handle:
        return {int(row["step"]) for row in csv.DictReader(handle)}


@pytest.mark.parametrize("warmup", [1, 2, 3, 4])  # the capture at each place of the clock's poll
def test_a_whole_iteration_captured_in_global_mode_trains_under_distanom(
    tmp_path: Path, warmup: int
) -> None:
    run(tmp_path, ["--mode", "whole", "--warmup", str(warmup)])
    # boundaries: the eager steps and the side-stream warm-up, the captured one skipped,
    # each replay (the first spans the capture), then the eager steps after them
    ended = 2 * EAGER + warmup + GRAPH_STEPS
    assert timed_steps(tmp_path) == set(range(1, ended)) - {EAGER + warmup}


def test_a_stall_before_a_replay_is_captured_at_that_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(tmp_path, ["--mode", "whole", "--warmup", "3", "--stall-replay", "30"], FAST)
    stalled = EAGER + 3 + 30  # replays are steps from EAGER + warmup on
    found = report(tmp_path, capsys)
    captures = {capture["step"]: capture for capture in found["captures"]}
    assert stalled in captures, sorted(captures)
    assert "anomaly" in captures[stalled]["kinds"] and captures[stalled]["ratio"] > 3


def test_a_model_graphed_mid_run_trains_under_distanom(tmp_path: Path) -> None:
    run(tmp_path, ["--mode", "partial"])
    ended = 2 * EAGER + GRAPH_STEPS
    assert timed_steps(tmp_path) == set(range(1, ended)) - {EAGER}
