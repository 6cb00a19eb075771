"""bench/agent_cost.py on the CPU: blocks rotate between variants in one process, each
agent is closed and its optimizer wrapper taken off, a failing block is recorded without
losing the others, the time budget stops new rounds, and bad input is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.tests.scripts import BENCH, load_bench_script
from distanom.agent import active_agent


def _tiny_loop(script: object, fail: bool = False) -> object:
    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    inputs = torch.randn(2, 4)

    def step() -> None:
        if fail:
            raise RuntimeError("boom in the loop")
        optimizer.zero_grad()
        layer(inputs).sum().backward()
        optimizer.step()

    return script.Loop(optimizer, step)  # type: ignore[attr-defined]


def test_a_block_closes_its_agent_and_unwraps_the_optimizer() -> None:
    script = load_bench_script("agent_cost")
    loop = _tiny_loop(script)
    record = script.run_block(loop, "detect", ["tracer.backend=none"], 5, 20, lambda: None)
    assert record["ms_per_step"] > 0 and "error" not in record
    assert record["steps_seen"] == 25  # every step of the block reached the agent
    assert active_agent() is None
    assert "step" not in loop.optimizer.__dict__  # type: ignore[attr-defined]
    plain = script.run_block(loop, "off", None, 0, 5, lambda: None)
    assert plain["ms_per_step"] > 0 and "steps_seen" not in plain


def test_a_failing_block_is_recorded_and_its_agent_closed() -> None:
    script = load_bench_script("agent_cost")
    record = script.run_block(_tiny_loop(script, fail=True), "default", [], 2, 5, lambda: None)
    assert record["error"] == "RuntimeError: boom in the loop"
    assert "ms_per_step" not in record
    assert active_agent() is None
    rounds = [
        {"blocks": {"off": {"ms_per_step": 2.0}, "default": record}},
        {"blocks": {"off": {"ms_per_step": 2.0}, "default": {"ms_per_step": 2.2}}},
    ]
    summary = script.summarize(rounds, ["off", "default"])
    assert summary["default"]["ratios_to_off"] == [1.1]
    assert summary["default"]["errors"] == ["RuntimeError: boom in the loop"]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent), OUT="")
    return subprocess.run(
        [sys.executable, str(BENCH / "agent_cost.py"), "--device", "cpu", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


@pytest.mark.slow
def test_rounds_rotate_variants_and_write_the_json(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    done = _run(
        tmp_path, "--workloads", "amp", "--variants", "off,detect,budget1",
        "--define", "batch8", "tracer.backend=none", "consensus.batch_steps=8",
        "--warmup", "10", "--steps", "20", "--rounds", "3", "--setup-steps", "2",
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["facts"]["device"] == "cpu" and report["facts"]["torch"] == torch.__version__
    assert "first 10 steps" in report["excluded"]
    entry = report["workloads"]["amp"]
    orders = [r["order"] for r in entry["rounds"]]
    assert orders == [
        ["off", "detect", "budget1", "batch8"],
        ["detect", "budget1", "batch8", "off"],
        ["budget1", "batch8", "off", "detect"],
    ]
    for variant in ("detect", "budget1", "batch8"):
        summary = entry["summary"][variant]
        assert len(summary["ratios_to_off"]) == 3 and summary["errors"] == []
        assert summary["min_ratio"] <= summary["median_ratio"] <= summary["max_ratio"]
    assert entry["rounds"][0]["blocks"]["batch8"]["steps_seen"] == 30
    assert "amp" in done.stdout and "batch8" in done.stdout  # the table


@pytest.mark.slow
def test_the_time_budget_stops_new_rounds(tmp_path: Path) -> None:
    done = _run(
        tmp_path, "--workloads", "amp", "--variants", "off,detect", "--warmup", "5",
        "--steps", "10", "--rounds", "50", "--setup-steps", "1", "--budget-s", "1",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    entry = json.loads((tmp_path / "agent_cost.json").read_text())["workloads"]["amp"]
    assert len(entry["rounds"]) < 50 and entry["stopped"].startswith("time budget")


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    for args, word in (
        (["--variants", "off,nosuch"], "nosuch"),
        (["--define", "x", "tracer.backend=bogus"], "tracer.backend"),
        (["--steps", "0"], "--steps"),
        (["--device", "tpu"], "--device"),
    ):
        done = _run(tmp_path, *args, "--out", str(tmp_path))
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and word in lines[0], done.stderr
