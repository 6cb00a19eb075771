"""End to end: real torchrun jobs of the toy script on CPU (gloo), checked through the report."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from distanom.cli import main as cli_main
from distanom.records.steps import STEPS_CSV_HEADER
from tests.conftest import EVERY_STEP_TRACED, TOY, job_env, launch, torchrun, why_not_captured

FAST = EVERY_STEP_TRACED


def report_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert cli_main(["report", str(run_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_stalled_rank_steps_are_captured_on_every_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stalls = [40, 75]
    done = torchrun(
        4,
        ["--run-dir", "runs", *FAST],
        ["--steps", "100", "--stall-rank", "2", "--stall-steps", "40,75", "--stall-s", "0.6"],
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "toy_train: 100 steps done" in done.stdout
    report = report_json(tmp_path / "runs", capsys)
    assert report["world_size"] == 4 and report["state"] == "finished"
    captures = {c["step"]: c for c in report["captures"]}
    for step in stalls:
        assert step in captures, why_not_captured(report, step, done.stderr)
        capture = captures[step]
        assert "anomaly" in capture["kinds"]
        assert sorted(capture["ranks"]) == ["0", "1", "2", "3"]
        assert capture["missing_ranks"] == []
        assert capture["ratio"] > 5
        for rank, entry in capture["ranks"].items():
            path = Path(report["run_dir"]) / entry["trace"]
            document = json.loads(gzip.decompress(path.read_bytes()))
            assert document["distributedInfo"]["rank"] == int(rank)
            assert document["distributedInfo"]["world_size"] == 4
            assert document["distanom"]["step"] == step
            names = {e.get("name") for e in document["traceEvents"]}
            assert f"distanom step {step}" in names
            assert any(e.get("cat") == "cpu_op" for e in document["traceEvents"])
    index = (Path(report["run_dir"]) / "index.jsonl").read_text().splitlines()
    written = [r for r in map(json.loads, index) if r["event"] == "written" and r["bytes"]]
    assert written
    for record in written:  # where each rank's capture time went
        cost = record["cost_ms"]
        parts = {"locate_ms", "lookups", "build_ms", "encode_ms", "write_ms", "paused_ms"}
        assert set(cost) == parts
        assert cost["lookups"] >= 1 and all(cost[k] >= 0 for k in cost)
    steps_file = Path(report["run_dir"]) / "steps" / "rank2.csv"
    rows = steps_file.read_text().splitlines()
    assert rows[0] == STEPS_CSV_HEADER.rstrip("\n")
    assert rows[0].startswith("step,duration_ms,traced,after_flush,self_ms,gc_ms,gc_gen,skipped,")
    assert len(rows) >= 95
    text = subprocess.run(
        [sys.executable, "-m", "distanom", "report", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        env=job_env(),
        check=True,
    ).stdout
    assert "captures (" in text and " 40 " in text


def test_bad_config_stops_before_training_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("detect:\n  multiplier: -1\n")
    done = launch(["--config", str(bad), str(TOY), "--steps", "5"], cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"distanom: {bad}: detect.multiplier: Input should be greater than 1 (got -1)"
    ]
    assert "toy_train" not in done.stdout and not (tmp_path / "runs").exists()
    missing = launch([str(tmp_path / "nope.py")], cwd=tmp_path)
    assert missing.returncode == 2
    assert "Traceback" not in missing.stderr
    assert missing.stderr.strip().endswith("no such file")


def test_bad_config_under_torchrun_prints_our_line_once_per_node(tmp_path: Path) -> None:
    done = torchrun(2, ["--set", "tracer.backend=magic"], ["--steps", "5"], cwd=tmp_path)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("distanom:")]
    assert len(ours) == 1 and "tracer.backend" in ours[0]
    assert "distanom/launch.py" not in done.stderr  # no traceback from our code


def test_script_exit_code_and_argv_are_preserved(tmp_path: Path) -> None:
    done = launch(["--run-dir", "r", str(TOY), "--steps", "3", "--exit-code", "3"], cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert "toy_train: 3 steps done" in done.stdout


def test_unwritable_run_dir_warns_and_training_finishes(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the run directory should be")
    done = torchrun(
        2,
        ["--run-dir", str(blocker / "runs"), *FAST],
        ["--steps", "60", "--stall-rank", "1", "--stall-steps", "40", "--stall-s", "0.3"],
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "toy_train: 60 steps done" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "capture steps aside" in line]
    assert len(warnings) == 2  # once per rank
    assert all("cannot create run directory" in w or "could not create" in w for w in warnings)
