"""The hang record's view of Flight Recorder (`flight_recorder.read_groups`): pure
summarizing, and a real 2-process gloo job where one rank waits in a collective the
other has not entered (the watcher thread keeps running and reads the in-flight
collective meanwhile)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from distanom.flight_recorder import group_summaries, parse_dump
from tests.conftest import REPO, free_port, job_env


def _entry(seq: int, group: list[str], retired: bool, **extra: object) -> dict[str, object]:
    return {
        "collective_seq_id": seq,
        "process_group": group,
        "profiling_name": "gloo:all_reduce",
        "state": "scheduled",
        "retired": retired,
        "time_created_ns": 1000 + seq,
        "input_sizes": [[4]],
        **extra,
    }


def test_summary_per_named_group_leaves_out_unnamed_groups_and_p2p() -> None:
    default = ["0", "default_pg"]
    doc = {
        "entries": [
            *[_entry(seq, default, True) for seq in range(1, 11)],
            _entry(11, default, False),
            _entry(1, ["", ""], False),  # distanom's own group: not registered, no name
            _entry(0, ["1", "undefined"], False, is_p2p=True),
            _entry(3, ["2", "tp"], True),
        ]
    }
    groups = group_summaries(parse_dump(doc, sizes=True), 4)
    assert [g.group for g in groups] == ["default_pg", "group 2 (tp)"]
    main = groups[0]
    assert (main.last_enqueued, main.last_completed) == (11, 10)
    assert [c.seq for c in main.in_flight] == [11]
    assert [c.seq for c in main.recent] == [8, 9, 10, 11]
    assert main.recent[-1].created_ns == 1011
    assert main.recent[-1].sizes == [[4]] and main.recent[-1].state == "scheduled"
    assert groups[1].last_completed == 3 and groups[1].in_flight == []  # retired: done
    assert group_summaries(parse_dump({"entries": "bad"}, sizes=True), 4) == []
    assert group_summaries((), 4) == []


PROBE = r"""
import datetime, json, os, sys, threading, time
import torch, torch.distributed as dist
from distanom.flight_recorder import read_groups

dist.init_process_group("gloo")
rank = dist.get_rank()
store = dist.PrefixStore("distanom/x/", dist.distributed_c10d._get_default_store())
own = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
own.allgather([[torch.empty(4), torch.empty(4)]], [t]).wait()
ticks, seen = [], {}

def watch():
    while True:
        ticks.append(time.monotonic())
        if len(ticks) == 10 and rank == 0:
            groups, note = read_groups(4)
            seen["groups"] = [
                {"group": g.group, "last_enqueued": g.last_enqueued,
                 "last_completed": g.last_completed, "in_flight": [c.seq for c in g.in_flight]}
                for g in groups or []
            ]
            seen["note"] = note
        time.sleep(0.05)

threading.Thread(target=watch, daemon=True).start()
start = len(ticks)
if rank == 1:
    time.sleep(2.0)  # the user's code, in Python: the other rank waits meanwhile
    print(json.dumps({"ticks_in_sleep": len(ticks) - start}), flush=True)
dist.all_reduce(t)
if rank == 0:
    print(json.dumps({"ticks_in_wait": len(ticks) - start, **seen}), flush=True)
dist.destroy_process_group()
"""


def test_a_watcher_thread_reads_the_collective_a_rank_waits_in(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = job_env(
            RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
            TORCH_FR_BUFFER_SIZE="100",
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                cwd=REPO,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    outs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    seen = json.loads(outs[0][0].strip().splitlines()[-1])
    assert json.loads(outs[1][0].strip().splitlines()[-1])["ticks_in_sleep"] >= 10
    assert seen["ticks_in_wait"] >= 10  # ~2 s waiting in gloo: the thread kept running
    assert seen["note"] is None
    assert seen["groups"] == [
        {"group": "default_pg", "last_enqueued": 4, "last_completed": 3, "in_flight": [4]}
    ]


def test_with_flight_recorder_off_there_is_a_note_not_entries(tmp_path: Path) -> None:
    code = (
        "import torch, torch.distributed as dist\n"
        "from distanom.flight_recorder import read_groups\n"
        "dist.init_process_group('gloo')\n"
        "dist.all_reduce(torch.ones(2))\n"
        "print(read_groups(4))\n"
        "dist.destroy_process_group()\n"
    )
    env = job_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["TORCH_FR_BUFFER_SIZE"] = "0"  # torch 2.13 records by default; 0 switches it off
    env.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("(None, ")
