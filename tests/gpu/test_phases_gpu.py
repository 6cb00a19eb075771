"""Step phases on an NVIDIA GPU (skipped without CUDA): the loop of
tests/e2e/scripts/phases_train.py, one rank, NCCL, the default config. A GPU delay inside
backward is `gpu_work` in the backward phase whether the loop synchronizes every step
(GradScaler + `loss.item()`: the host spin-waits, its CPU time grows) or never; a host
stall before forward is a `host_stall` in the data phase; a DataLoader worker stall with
pinned memory is `data_loading` in the data phase.

Run on the device machine: `python3 -m pytest tests/gpu/test_phases_gpu.py -m gpu -q -s`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distanom.cli import main as cli_main
from tests.conftest import REPO, torchrun

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

SCRIPT = REPO / "tests" / "e2e" / "scripts" / "phases_train.py"


def verdicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> dict[int, dict]:
    done = torchrun(
        1, ["--run-dir", "runs"], ["--cuda", "--steps", "120", *args], cwd=tmp_path,
        script=SCRIPT, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    capsys.readouterr()
    assert cli_main(["report", str(tmp_path / "runs"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    found = {a["step"]: a["verdict"] for a in report["anomalies"]}
    print(json.dumps({s: {k: v.get(k) for k in ("cause", "phase", "evidence", "gpu_phases_ms",
                                                  "phases_ms")} for s, v in found.items()},
                     indent=1))  # fmt: skip
    return found


def named(found: dict[int, dict], step: int) -> tuple:
    verdict = found.get(step) or {}
    return verdict.get("culprit_rank"), verdict.get("cause"), verdict.get("phase")


def test_gpu_delay_in_backward_with_a_synchronize_every_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    found = verdicts(tmp_path, capsys, ["--scaler", "--faults", "gpu_backward:0:60"])
    assert named(found, 60) == (0, "gpu_work", "backward"), found.get(60)


def test_gpu_delay_in_backward_in_a_loop_that_never_synchronizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    found = verdicts(tmp_path, capsys, ["--no-sync", "--faults", "gpu_backward:0:60"])
    assert named(found, 60) == (0, "gpu_work", "backward"), found.get(60)


def test_host_stall_before_forward_and_a_pinned_dataloader_stall(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    found = verdicts(tmp_path, capsys, ["--faults", "host:0:60,data:0:90"])
    assert named(found, 60) == (0, "host_stall", "data"), found.get(60)
    assert named(found, 90) == (0, "data_loading", "data"), found.get(90)
