"""A run on several nodes without a shared filesystem: each node's copy of the run
directory, joined by the agent (`run_join`) and read back as one by the report."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from distanom.analysis.report import build_report, render_text, report_json, write_outputs
from distanom.analysis.run import load_run, load_steps
from distanom.cli import main as cli_main
from distanom.errors import DistanomError
from distanom.health import Health
from distanom.records.nodes import NodeInfo, read_nodes, write_node_info
from distanom.records.run_info import node_ranks_of
from distanom.run_join import join_run, read_places
from distanom.rundir import RunDir
from distanom.world import AgentGroup, WorldInfo
from tests.unit.rungen import Capture, make_run
from tests.unit.stepgen import gpu_job

HOSTS = ["a", "a", "b", "b"]
NODE_OF = [0, 0, 1, 1]


def split_into_copies(tmp_path: Path) -> tuple[Path, Path]:
    """A 4-rank run (rank 3 slow at step 40) as two nodes without a shared filesystem
    leave it: node 0's copy with run.json, status.json and ranks 0-1's files, node 1's
    with ranks 2-3's files; each with its node file and index lines."""
    make_run(
        tmp_path / "built",
        [
            Capture(20, "reference", gpu_job(), 1.1, 1.2),
            Capture(40, "anomaly", gpu_job(extra_compute_us={3: 3000.0}), 4.1, 1.2),
        ],
        hosts=HOSTS,
    )
    built = tmp_path / "built" / "run1"
    info = json.loads((built / "run.json").read_text())
    info["node_ranks"] = NODE_OF
    (built / "run.json").write_text(json.dumps(info))
    lines = (built / "index.jsonl").read_text().splitlines()
    copies = []
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        base = tmp_path / f"node{node}" / "runs"
        copy = base / "run1"
        shutil.copytree(built, copy)
        (base / "latest").symlink_to("run1")
        for rank in {0, 1, 2, 3} - set(ranks):
            (copy / "steps" / f"rank{rank}.csv").unlink()
            for step in (20, 40):
                (copy / "captures" / f"step_{step}" / f"rank{rank}.trace.json.gz").unlink()
        if node == 1:  # rank 0's files exist on node 0 only
            for name in ("run.json", "status.json"):
                (copy / name).unlink()
        kept = [line for line in lines if json.loads(line)["rank"] in ranks]
        (copy / "index.jsonl").write_text("\n".join(kept) + "\n")
        write_node_info(RunDir(copy), NodeInfo("run1", node, 2, HOSTS[ranks[0]], 4, ranks))
        copies.append(base)
    return copies[0], copies[1]


def test_copies_of_one_run_are_reported_as_one(tmp_path: Path) -> None:
    node0, node1 = split_into_copies(tmp_path)
    data = load_run([str(node1), str(node0)])  # any order: the copy with run.json leads
    assert data.run.path == (node0 / "run1").resolve()
    assert data.step_files == {0: 0, 1: 0, 2: 1, 3: 1}
    assert len(load_steps(data).per_rank) == 4
    report = write_outputs(data, build_report(data))
    body = report_json(report)
    assert body["problems"] == []
    assert body["nodes"] == {
        "0": {"host": "a", "ranks": [0, 1]},
        "1": {"host": "b", "ranks": [2, 3]},
    }
    capture = next(c for c in body["captures"] if c["step"] == 40)
    assert capture["missing_ranks"] == []
    assert (capture["culprit_rank"], capture["culprit_node_rank"]) == (3, 1)
    assert capture["ranks"]["3"]["run_dir"] == str((node1 / "run1").resolve())
    assert "run_dir" not in capture["ranks"]["0"]
    # rank 3's tables are cached beside its trace, in node 1's copy
    assert (node1 / "run1" / "captures" / "step_40" / "rank3.gpu_timeline.csv").is_file()
    text = render_text(report)
    assert "nodes: node 0 (a) ranks 0-1; node 1 (b) ranks 2-3" in text
    assert "rank 3 ran on node 1, local rank 1, host b" in text


def test_a_copy_left_out_is_named_by_its_node(tmp_path: Path) -> None:
    node0, node1 = split_into_copies(tmp_path)
    data = load_run(str(node0))
    assert "ranks 2-3 of node 1: no step files; node 1's run directory was not given" in (
        data.problems
    )
    assert {c.step: c.missing_ranks for c in data.captures} == {20: [2, 3], 40: [2, 3]}
    alone = load_run(str(node1))
    assert alone.world_size == 4  # from the node file: run.json is on node 0's copy
    assert (
        "ranks 0-1: no step files, node unknown; not given: the run directory of node 0"
        in alone.problems
    )


def test_copies_of_different_runs_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node0, node1 = split_into_copies(tmp_path)
    node_file = node1 / "run1" / "nodes" / "node1.json"
    node_file.write_text(node_file.read_text().replace('"run1"', '"run2"'))
    assert cli_main(["report", str(node0), str(node1)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not copies of one run" in err[0] and "run2" in err[0]
    with pytest.raises(DistanomError, match="not copies of one run"):
        load_run([str(node0), str(node1)])


def test_a_node_file_naming_another_run_is_set_aside(tmp_path: Path) -> None:
    node0, node1 = split_into_copies(tmp_path)
    planted = RunDir(node0 / "run1")
    write_node_info(planted, NodeInfo("other", 1, 2, "evil", 4, (2, 3)))
    data = load_run([str(node0), str(node1)])
    assert data.nodes[1].host == "b"  # node 1's own file, from its copy
    assert any("names run 'other', not 'run1'; ignored" in p for p in data.problems)


def test_the_same_copy_given_twice_is_read_once(tmp_path: Path) -> None:
    node0, _ = split_into_copies(tmp_path)
    data = load_run([str(node0), str(node0 / "run1")])
    assert len(data.copies) == 1


def test_node_files_are_read_bounded_and_never_through_a_link(tmp_path: Path) -> None:
    node0, _ = split_into_copies(tmp_path)
    run = RunDir((node0 / "run1").resolve())
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(NodeInfo("run1", 1, 2, "x", 4, (2, 3)).as_json()))
    os.symlink(outside, run.path / "nodes" / "node1.json")
    (run.path / "nodes" / "node5.json").write_text('{"run_id": "run1", "node_rank": 5}')
    (run.path / "nodes" / "node6.json").write_bytes(b"x" * (70 * 1024))
    nodes, problems = read_nodes(run)
    assert [n.node_rank for n in nodes] == [0]
    assert len(problems) == 3 and all("not a node file" in p for p in problems)


def test_run_json_node_ranks_are_validated() -> None:
    assert node_ranks_of({"node_ranks": [0, 1, "x", -3, True]}) == [0, 1, -1, -1, -1]
    assert node_ranks_of({"node_ranks": "0,1"}) == []


def _group(run_id: str) -> AgentGroup:
    """A one-rank group (its store is a local dict) holding what rank 0 published."""
    group = AgentGroup(
        WorldInfo(0, 1, 0, 1, 0, "h", None, None, "j"), setup_timeout_s=1, op_timeout_s=1
    )
    group.publish("run_id", run_id)
    return group


def test_a_node_leader_makes_its_copy_node_file_and_latest(tmp_path: Path) -> None:
    base = tmp_path / "node1" / "runs"
    world = WorldInfo(2, 4, 0, 2, 1, "hostb", None, None, "j", node_count=2)
    health = Health()
    run_id, run = join_run(_group("job-20260101-000000"), world, base, None, health)
    assert (
        run_id == "job-20260101-000000"
        and run is not None
        and run.path == base / "job-20260101-000000"
    )
    assert os.readlink(base / "latest") == "job-20260101-000000"
    nodes, problems = read_nodes(run)
    assert problems == [] and nodes == [NodeInfo("job-20260101-000000", 1, 2, "hostb", 4, (2, 3))]


def test_a_link_in_place_of_the_run_is_refused_not_followed(tmp_path: Path) -> None:
    base = tmp_path / "runs"
    base.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (base / "r1").symlink_to(elsewhere)
    health = Health()
    world = WorldInfo(1, 2, 0, 1, 1, "hostb", None, None, "j", node_count=2)
    # no copy of its own, but the run id every rank shares (it places the probe windows)
    assert join_run(_group("r1"), world, base, None, health) == ("r1", None)
    assert health.capture_off_reason is not None and "link" in health.capture_off_reason
    assert list(elsewhere.iterdir()) == []


def test_rank_zero_names_the_run_and_every_rank_its_place(tmp_path: Path) -> None:
    group = AgentGroup(
        WorldInfo(0, 1, 0, 1, 0, "h0", None, None, "j"), setup_timeout_s=1, op_timeout_s=1
    )
    world = WorldInfo(0, 1, 0, 1, 0, "h0", None, None, "j")
    run_id, run = join_run(group, world, tmp_path / "runs", "job", Health())
    assert run is not None and group.lookup("run_id") == run.run_id == run_id
    assert run.run_id.startswith("job-")
    places = read_places(group, 1)
    assert [(p.node_rank, p.host) for p in places] == [(0, "h0")]
    assert read_nodes(run)[0][0].ranks == (0,)


def test_status_on_another_nodes_copy_says_where_status_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, node1 = split_into_copies(tmp_path)
    assert cli_main(["status", str(node1)]) == 2
    err = capsys.readouterr().err
    assert "another node's copy of the run" in err and "node 0's copy" in err
