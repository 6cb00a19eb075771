"""The framework loops of tests/e2e/test_frameworks.py on NVIDIA GPUs (skipped without
CUDA): a Hugging Face Trainer with fp16, a Lightning Trainer with 16-mixed precision and
an fp16 GradScaler loop with forced overflows, one rank per GPU (NCCL), under
`torchrun -m distanom.launch` with the default tracer (cupti where it works). A stall on
the last rank must be captured at the loop's step and blamed on it.

Run on the device machine: `python3 -m pytest tests/gpu/test_frameworks_gpu.py -m gpu -q`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.e2e.test_frameworks import assert_blamed, report, run_job, skipped_steps

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def gpus() -> int:
    """Ranks for the job: one per GPU, two at most."""
    return min(2, torch.cuda.device_count())


def needs(package: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        importlib.util.find_spec(package) is None, reason=f"{package} is not installed"
    )


@needs("transformers")
@needs("accelerate")
def test_hf_trainer_fp16_on_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    n = gpus()
    args = ["--cuda", "--steps", "80", "--stall-rank", str(n - 1), "--stall-steps", "50"]
    assert "hf_trainer: 80 steps done" in run_job(tmp_path, "hf_trainer_train.py", args, nproc=n)
    assert_blamed(report(tmp_path, capsys), [50], stall_rank=n - 1)


@needs("lightning")
def test_lightning_16_mixed_on_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    n = gpus()
    args = ["--cuda", "--steps", "80", "--stall-rank", str(n - 1), "--stall-steps", "50"]
    assert "lightning: 80 steps done" in run_job(tmp_path, "lightning_train.py", args, nproc=n)
    assert_blamed(report(tmp_path, capsys), [50], stall_rank=n - 1)


def test_fp16_grad_scaler_with_overflows_on_gpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n = gpus()
    overflow = [0, 1, 20, 21, 22, 45]
    args = ["--cuda", "--steps", "80", "--scaler", "--overflow", ",".join(map(str, overflow))]
    args += ["--stall-rank", str(n - 1), "--stall-steps", "30,60"]
    assert f"80 iterations, {len(overflow)} skipped" in run_job(
        tmp_path, "amp_train.py", args, nproc=n
    )
    assert_blamed(report(tmp_path, capsys), [30, 60], stall_rank=n - 1)
    assert skipped_steps(tmp_path, 0) == set(overflow) - {0}
