"""`distanom hosts`: a planted bad host comes out first over a folder of synthetic runs;
copies of one run from several nodes count once; hostile or damaged runs are problem
lines, bounded, never followed through a link."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from distanom.analysis import fleet_runs
from distanom.analysis.fleet_runs import scan_runs
from distanom.analysis.hosts import hosts_json, hosts_text, rank_suspects
from distanom.cli import main
from distanom.records.anomalies import read_anomalies
from distanom.rundir import RunDir, write_json_atomic
from tests.unit.fleetgen import make_fleet, write_run

HOSTS = ["a", "a", "b", "b"]


def test_the_planted_bad_host_and_gpu_come_first(tmp_path: Path) -> None:
    fleet = make_fleet(tmp_path / "runs", 150, seed=3)
    suspects = rank_suspects(scan_runs([tmp_path / "runs"]))
    assert len(suspects.scan.runs) == 150 and suspects.scan.problems == []
    first, second = suspects.hosts[:2]
    assert first.host == fleet.bad_host
    assert first.blamed_runs > second.blamed_runs
    gpu = suspects.gpus[0]
    assert (gpu.host, gpu.local_rank) == (fleet.bad_host, fleet.bad_local_rank)
    assert set(first.counts) <= {"culprit", "straggler", "hang"} and first.counts["culprit"]
    assert first.causes["host_stall"] == first.counts["culprit"]
    assert all(e["run"].startswith("job") for e in first.evidence)
    assert all(e["steps"] for e in first.evidence if e["kind"] == "culprit")
    text = hosts_text(suspects, top=3)
    table = text.split("hosts, most often blamed first:")[1]
    assert table.splitlines()[2].split()[0] == fleet.bad_host


def test_counts_kinds_steps_and_runs_taken_part_in(tmp_path: Path) -> None:
    base = tmp_path / "runs"
    write_run(base, "r1", HOSTS, culprits={30: 2, 31: 2, 90: 0}, stragglers=(3,))
    write_run(base, "r2", HOSTS, hang_culprit=1)
    write_run(base, "r3", ["c", "c"])
    suspects = rank_suspects(scan_runs([base]))
    by_name = {s.name: s for s in suspects.hosts}
    assert by_name["b"].counts == {"culprit": 2, "straggler": 1}
    assert by_name["b"].runs == 2 and by_name["b"].blamed_runs == 1
    assert by_name["a"].counts == {"culprit": 1, "hang": 1} and by_name["a"].blamed_runs == 2
    assert by_name["c"].blamed_runs == 0 and by_name["c"].runs == 1
    assert [s.name for s in suspects.hosts] == ["a", "b", "c"]  # 2 runs blamed beat 1
    gpus = {s.name: s for s in suspects.gpus}
    assert gpus["b/0"].counts["culprit"] == 2 and gpus["b/1"].counts["straggler"] == 1
    assert gpus["a/1"].counts["hang"] == 1
    (culprit,) = [e for e in by_name["b"].evidence if e["kind"] == "culprit"]
    assert culprit == {
        "run": "r1",
        "kind": "culprit",
        "rank": 2,
        "cause": "host_stall",
        "count": 2,
        "steps": [30, 31],
    }
    body = hosts_json(suspects)
    assert body["runs"] == 3 and [h["host"] for h in body["hosts"]] == ["a", "b", "c"]
    assert [g["host"] + str(g["local_rank"]) for g in body["gpus"]] == ["b0", "a0", "a1", "b1"]
    json.dumps(body, allow_nan=False)


def test_copies_of_one_run_from_two_nodes_count_once_and_share_a_hang(tmp_path: Path) -> None:
    """Without a shared filesystem each node keeps its own ranks' files: node 1's copy
    has only its hang records; judged alone, node 0's copy would blame a rank of node 1
    for writing none."""
    node0, node1 = tmp_path / "node0" / "runs", tmp_path / "node1" / "runs"
    run0 = write_run(node0, "job-1", HOSTS, culprits={50: 3}, hang_culprit=0)
    run1 = RunDir(node1 / "job-1")
    (run1.path / "hangs").mkdir(parents=True)
    os.rename(run0.path / "hangs" / "hang_1", run1.path / "hangs" / "hang_1")
    (run0.path / "hangs" / "hang_1").mkdir()
    for rank in (0, 1):  # node 0's records stay in node 0's copy
        name = f"rank{rank}.json"
        os.rename(run1.path / "hangs" / "hang_1" / name, run0.path / "hangs" / "hang_1" / name)
    scan = scan_runs([node0, node1])
    assert [r.run_id for r in scan.runs] == ["job-1"] and len(scan.runs[0].paths) == 2
    kinds = sorted((f.kind, f.rank) for f in scan.runs[0].found)
    assert kinds == [("culprit", 3), ("hang", 0)]
    alone = scan_runs([node0])
    assert ("hang", 2) in [(f.kind, f.rank) for f in alone.runs[0].found]  # the missing one


def test_a_report_s_trace_verdict_stands_over_the_evidence(tmp_path: Path) -> None:
    run = write_run(tmp_path / "runs", "r1", HOSTS, culprits={40: 1})
    line = json.loads((run.path / "anomalies.jsonl").read_text())
    line["traced"] = True
    (run.path / "anomalies.jsonl").write_text(json.dumps(line) + "\n")
    run.capture_dir(40).mkdir(parents=True)
    verdict = {"culprit_rank": 3, "culprit_node": None, "cause": "compute", "evidence": "x"}
    write_json_atomic(run.summary_json(40), {"step": 40, "verdict": verdict})
    (found,) = scan_runs([tmp_path / "runs"]).runs[0].found
    assert (found.rank, found.host, found.cause) == (3, "b", "compute")
    node = {"culprit_rank": None, "culprit_node": "a", "cause": "host_stall", "evidence": "x"}
    write_json_atomic(run.summary_json(40), {"step": 40, "verdict": node})
    (found,) = scan_runs([tmp_path / "runs"]).runs[0].found
    assert (found.rank, found.host, found.local_rank) == (None, "a", None)
    suspects = rank_suspects(scan_runs([tmp_path / "runs"]))
    assert suspects.hosts[0].host == "a" and not any(g.blamed_runs for g in suspects.gpus)
    unknown = {"culprit_rank": None, "culprit_node": None, "cause": "unknown", "evidence": ""}
    write_json_atomic(run.summary_json(40), {"step": 40, "verdict": unknown})
    (found,) = scan_runs([tmp_path / "runs"]).runs[0].found
    assert (found.rank, found.cause) == (1, "host_stall")  # the evidence verdict stands


def test_hostile_and_damaged_runs_are_problem_lines(tmp_path: Path) -> None:
    base = tmp_path / "runs"
    write_run(base, "good", HOSTS, culprits={30: 2})
    elsewhere = write_run(tmp_path / "elsewhere", "other", HOSTS, culprits={30: 1})
    (base / "linked").symlink_to(elsewhere.path)  # a linked run: not read
    (base / "latest").symlink_to("good")
    bad_json = write_run(base, "bad-json", HOSTS)
    bad_json.run_json.write_text("{not json")
    linked_file = write_run(base, "linked-file", HOSTS, culprits={30: 0})
    linked_file.run_json.unlink()
    linked_file.run_json.symlink_to(elsewhere.run_json)
    fifo = write_run(base, "fifo", HOSTS)
    (fifo.path / "anomalies.jsonl").unlink()
    os.mkfifo(fifo.path / "anomalies.jsonl")
    os.unlink(fifo.path / "stragglers.json")
    (fifo.path / "stragglers.json").symlink_to("/dev/zero")
    out_of_range = write_run(base, "range", HOSTS, culprits={30: 2})
    body = json.loads(out_of_range.run_json.read_text())
    body["hosts"] = ["a", "a"]
    out_of_range.run_json.write_text(json.dumps(body))
    started = time.monotonic()
    scan = scan_runs([base, tmp_path / "missing"])
    assert time.monotonic() - started < 5.0
    assert sorted(r.run_id for r in scan.runs) == [
        "bad-json",
        "fifo",
        "good",
        "linked-file",
        "range",
    ]
    found = {r.run_id: [(f.kind, f.rank) for f in r.found] for r in scan.runs}
    assert found["good"] == [("culprit", 2)] and found["range"] == [] and found["fifo"] == []
    problems = "\n".join(scan.problems)
    assert "bad-json/run.json: damaged JSON" in problems
    assert "linked-file/run.json" in problems and "symlink" in problems
    assert "fifo/stragglers.json" in problems
    assert "range: rank 2 is not one of run.json's 2 ranks" in problems
    assert "missing: no such folder" in problems
    text = hosts_text(rank_suspects(scan))
    assert "problems:" in text and "b  " in text


def test_reads_are_bounded_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = write_run(tmp_path / "runs", "r1", HOSTS, culprits={s: 2 for s in range(20, 60)})
    monkeypatch.setattr(fleet_runs, "MAX_ANOMALY_LINES", 5)
    assert len(scan_runs([tmp_path / "runs"]).runs[0].found) == 5
    size = (run.path / "anomalies.jsonl").stat().st_size
    assert len(read_anomalies(run, max_bytes=size // 4)) < 40 // 4 + 1
    assert len(read_anomalies(run)) == 40
    monkeypatch.setattr(fleet_runs, "MAX_RUNS", 1)
    for index in range(3):
        write_run(tmp_path / "more", f"m{index}", HOSTS)
    scan = scan_runs([tmp_path / "more"])
    assert len(scan.runs) == 1 and "2 runs beyond the first 1 not read" in scan.problems


def test_cli_text_json_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "runs", "r1", HOSTS, culprits={30: 2})
    assert main(["hosts", str(tmp_path / "runs"), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["hosts"][0]["host"] == "b" and body["hosts"][0]["culprit"] == 1
    assert main(["hosts", str(tmp_path / "runs")]) == 0
    assert "b     1     1 (100%)" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["hosts", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no runs read" in err[0] and "no distanom runs in it" in err[0]
    assert main(["hosts", str(tmp_path / "runs"), "--top", "0"]) == 2
    assert "--top must be at least 1" in capsys.readouterr().err
