"""End to end: two torchrun agents on this machine acting as two nodes (c10d rendezvous on
localhost, one rank each), with a run directory per node (no shared filesystem) and
with one shared run directory; rank 1 stalls once, and the report names it and its node.

c10d hands out node numbers (GROUP_RANK) in the order the agents join, not by
`--node-rank`, so the tests find node 0's copy by its run.json rather than by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distanom.cli import main as cli_main
from tests.conftest import EVERY_STEP_TRACED, TOY, free_port, job_env, why_not_captured

FAST = EVERY_STEP_TRACED
STALL_STEP = 40
SCRIPT = ["--steps", "60", "--stall-rank", "1", "--stall-steps", str(STALL_STEP)]


def run_two_nodes(workdirs: list[Path]) -> list[str]:
    """Start node 0 and node 1 (one rank each) in their working folders, each with
    `--run-dir runs` there; their stderr once both finished with status 0."""
    port = free_port()
    nodes = []
    for node, cwd in enumerate(workdirs):
        cwd.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=twonode",
            "-m",
            "distanom.launch",
            "--run-dir",
            "runs",
            *FAST,
            str(TOY),
            *SCRIPT,
            "--stall-s",
            "0.5",
        ]
        nodes.append(
            subprocess.Popen(
                command,
                cwd=cwd,
                env=job_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:]
    return [err for _, err in outputs]


def report_json(dirs: list[Path], capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert cli_main(["report", *map(str, dirs), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def check_stall_named(report: dict, log: str) -> dict:
    """The stalled step is captured on both ranks and blamed on rank 1, of node 1."""
    assert report["world_size"] == 2 and report["state"] == "finished"
    assert [report["nodes"][n]["ranks"] for n in ("0", "1")] == [[0], [1]]
    captures = {c["step"]: c for c in report["captures"]}
    assert STALL_STEP in captures, why_not_captured(report, STALL_STEP, log)
    capture = captures[STALL_STEP]
    assert sorted(capture["ranks"]) == ["0", "1"] and capture["missing_ranks"] == []
    assert (capture["culprit_rank"], capture["culprit_node_rank"]) == (1, 1)
    anomaly = next(a for a in report["anomalies"] if a["step"] == STALL_STEP)
    assert anomaly["verdict"]["culprit_node_rank"] == 1
    return capture


def test_two_nodes_each_with_its_own_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workdirs = [tmp_path / "node_a", tmp_path / "node_b"]
    logs = run_two_nodes(workdirs)
    bases = [cwd / "runs" for cwd in workdirs]
    copies = [base.resolve() / os.readlink(base / "latest") for base in bases]
    assert copies[0].name == copies[1].name  # one run id, agreed by both nodes
    first = 0 if (copies[0] / "run.json").is_file() else 1  # node 0's copy
    node0, node1 = copies[first], copies[1 - first]
    assert not (node1 / "run.json").exists()
    assert sorted(p.name for p in (node0 / "steps").iterdir()) == ["rank0.csv"]
    assert sorted(p.name for p in (node1 / "steps").iterdir()) == ["rank1.csv"]
    report = report_json(bases, capsys)
    capture = check_stall_named(report, "\n".join(logs))
    assert capture["ranks"]["1"]["run_dir"] == str(node1)  # read from node 1's copy
    assert report["problems"] == []
    assert sorted(report["copies"]) == sorted(map(str, copies))
    # node 1's copy left out: its rank is named by node, its trace is missing
    alone = report_json([bases[first]], capsys)
    assert (
        "rank 1 of node 1: no step files; node 1's run directory was not given"
        in (alone["problems"])
    )
    step = next(c for c in alone["captures"] if c["step"] == STALL_STEP)
    assert step["missing_ranks"] == [1]


def test_two_nodes_share_one_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = run_two_nodes([tmp_path, tmp_path])
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "latest"]
    assert len(runs) == 1  # both nodes wrote into the one run
    assert sorted(p.name for p in (runs[0] / "nodes").iterdir()) == ["node0.json", "node1.json"]
    report = report_json([tmp_path / "runs"], capsys)
    capture = check_stall_named(report, "\n".join(logs))
    assert "run_dir" not in capture["ranks"]["1"] and "copies" not in report
    assert report["problems"] == []
