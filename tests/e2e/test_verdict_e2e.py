"""End to end: the cross-rank verdict on real 4-rank gloo jobs of the toy script (CPU).

Each job injects its slowdown on two separate steps and checks every capture of them.
On 2 busy cores, noise steps over 1.5 x median come every few steps and chain into one
detector episode, which then swallows an injected step now and then (by design: one
episode, one capture unless a step has a third more slowdown than the last capture;
bench/verdict_robustness.py counts it).
These tests are about the verdict, so episodes are not merged across steps here.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import torchrun
from tests.e2e.test_torchrun import FAST, report_json

WITH_REFERENCE = [
    *FAST,
    "--set",
    "capture.reference_every_steps=20",
    "--set",
    "detect.merge_gap_steps=0",
]


def run_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], script: list[str], injected: set[int]
) -> tuple[dict[str, Any], dict[int, dict[str, Any]], list[int]]:
    """Run the toy on 4 gloo ranks; the report, its captures by step, and the injected
    steps that were captured (at least one)."""
    done = torchrun(4, ["--run-dir", "runs", *WITH_REFERENCE], script, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = report_json(tmp_path / "runs", capsys)
    captures = {c["step"]: c for c in report["captures"]}
    # references replaced every 20 steps (and any replaced anomaly) leave no folder behind
    folders = {p.name: p for p in (Path(report["run_dir"]) / "captures").iterdir()}
    assert sorted(folders) == sorted(f"step_{step}" for step in captures)
    assert all(any(folder.iterdir()) for folder in folders.values())
    hit = sorted(injected & set(captures))
    assert hit, sorted(captures)
    return report, captures, hit


def test_stalled_rank_is_named_with_a_host_stall(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = ["--steps", "100", "--stall-rank", "2", "--stall-steps", "40,75", "--stall-s", "0.6"]
    report, captures, stalled = run_job(tmp_path, capsys, script, {40, 75})
    for step in stalled:
        capture = captures[step]
        verdict = capture["verdict"]
        assert (verdict["culprit_rank"], verdict["cause"]) == (2, "host_stall"), verdict
        assert verdict["culprit_node"] is None  # 4 ranks on one host: rank 2 alone is not it
        assert verdict["evidence"].startswith("rank 2: idle")
        assert verdict["details"]["arrival"]["latest_rank"] == 2
        diff = capture["kernel_diff"]
        assert diff["reference_step"] is not None
        assert "reference" in captures[diff["reference_step"]]["kinds"]
        assert diff["ranks"]["2"]["kind"] == "cpu"
        assert diff["ranks"]["2"]["idle_change_ms"] > 500
        merged = Path(report["run_dir"]) / capture["merged_trace"]
        document = json.loads(gzip.decompress(merged.read_bytes()))
        assert document["distanom"]["clock_alignment"]["method"] == "shared host clock"
        assert sorted(document["distanom"]["ranks"]) == ["0", "1", "2", "3"]
        summary = json.loads((merged.parent / "summary.json").read_text())
        assert summary["verdict"]["culprit_rank"] == 2


def test_every_rank_slow_at_once_is_global(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = ["--steps", "70", "--all-slow-steps", "35,55", "--all-slow-s", "0.3"]
    report, captures, slow = run_job(tmp_path, capsys, script, {35, 55})
    # the per-step evidence agrees: the ranks reached the collective late together, so
    # no rank is blamed (the one that happened to arrive last once was). Usually every
    # rank; with 4 ranks on 2 cores a rank the scheduler held back longer can leave the
    # others outside "within a fifth" of it (seen once in CI), and they are named instead
    anomalies = {a["step"]: a for a in report["anomalies"]}
    for step in (35, 55):
        evidence = anomalies[step]["verdict"]["details"]["evidence_verdict"]
        assert evidence["culprit_rank"] is None, evidence
        text = evidence["evidence"]
        assert text.startswith("every rank reached") or (
            text.startswith("ranks ") and "later than usual, about equally" in text
        ), evidence
    for step in slow:
        verdict = captures[step]["verdict"]
        assert (verdict["culprit_rank"], verdict["culprit_node"], verdict["cause"]) == (
            None,
            None,
            "global",
        ), verdict
        assert "idle" in verdict["evidence"]
        assert "every rank slowed together" in verdict["evidence"]
