"""Flight Recorder: switched on without overriding the user, read back tolerantly."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

from distanom import flight_recorder
from distanom.flight_recorder import FrEntry, StepCollectives, enable_from_env, parse_dump
from tests.conftest import REPO


def test_enable_sets_the_buffer_only_when_the_user_did_not() -> None:
    env: dict[str, str] = {}
    assert "on" in enable_from_env(env) and env[flight_recorder.BUFFER_ENV] == "256"
    mine = {"TORCH_FR_BUFFER_SIZE": "5000"}
    assert "kept" in enable_from_env(mine) and mine["TORCH_FR_BUFFER_SIZE"] == "5000"
    nccl = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}
    enable_from_env(nccl)
    assert flight_recorder.BUFFER_ENV not in nccl
    off = {"DISTANOM_FLIGHT_RECORDER": "0"}
    assert "left off" in enable_from_env(off) and flight_recorder.BUFFER_ENV not in off
    assert flight_recorder.buffer_size(off) == 0 and flight_recorder.buffer_size(nccl) == 100


def test_parse_tolerates_missing_fields_and_garbage() -> None:
    entries = [
        {"record_id": 3, "process_group": ["0", "default_pg"], "collective_seq_id": 4,
         "profiling_name": "gloo:all_reduce", "state": "scheduled", "time_created_ns": 99,
         "time_discovered_started_ns": None, "thread_id": "7"},
        {"record_id": 4},  # an older torch: most fields missing
        "not an entry",
    ]  # fmt: skip
    parsed = parse_dump(pickle.dumps({"entries": entries}))
    assert parsed[0] == FrEntry(
        3, "0", 4, "gloo:all_reduce", "scheduled", 99, 0, 0, "7", pg_desc="default_pg"
    )
    assert parsed[1].record_id == 4 and parsed[1].time_created_ns == 0
    assert len(parsed) == 2
    assert parse_dump(b"garbage") == () and parse_dump({"entries": "x"}) == ()
    assert len(parse_dump({"entries": entries[:2]}, limit=1)) == 1


def test_the_hang_fields_retired_and_sizes_are_read_sizes_on_request() -> None:
    item = {"record_id": 1, "process_group": ["2", "tp"], "collective_seq_id": 5,
            "state": "scheduled", "retired": True, "input_sizes": [[4, 8], [2]] * 3}  # fmt: skip
    quick, full = parse_dump({"entries": [item]})[0], parse_dump({"entries": [item]}, sizes=True)[0]
    assert quick.retired and quick.completed and quick.input_sizes == ()
    assert full.input_sizes == ((4, 8), (2,), (4, 8), (2,))  # the first MAX_SIZES
    assert (full.pg_name, full.pg_desc) == ("2", "tp")
    open_entry = parse_dump({"entries": [dict(item, retired=False)]})[0]
    assert not open_entry.completed
    assert parse_dump({"entries": [dict(item, retired=False, state="completed")]})[0].completed


def test_step_summary_keeps_the_last_collective() -> None:
    summary = StepCollectives()
    for seq, at in ((1, 10), (2, 30), (3, 20)):
        summary.add(FrEntry(seq, "0", seq, "op", "scheduled", at, 0, 0, "1"))
    assert (summary.count, summary.last_created_ns, summary.last_seq) == (3, 30, 2)


def test_gloo_collectives_are_recorded_and_read_back() -> None:
    code = textwrap.dedent(
        """
        import os, time
        from distanom.flight_recorder import enable_from_env, read_entries
        import torch, torch.distributed as dist
        enable_from_env()
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        before = time.time_ns()
        t = torch.ones(4)
        for _ in range(3):
            dist.all_reduce(t)
        entries = read_entries()
        assert len(entries) == 3, entries
        assert [e.seq_id for e in entries] == [1, 2, 3]
        assert all(e.op.endswith("all_reduce") and e.time_created_ns >= before for e in entries)
        dist.destroy_process_group()
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_both_recorders_are_read_and_tagged(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL collectives are only in the NCCL recorder's dump, gloo ones in the generic."""
    from torch._C import _distributed_c10d as c10d

    def dump_of(*items: dict) -> Callable[..., bytes]:
        return lambda **_: pickle.dumps({"entries": list(items)})

    gloo = {"record_id": 0, "process_group": ["0", "default_pg"], "time_created_ns": 20}
    nccl = {"record_id": 0, "process_group": ["1", "tp"], "time_created_ns": 10}
    monkeypatch.setattr(c10d, "_dump_fr_trace", dump_of(gloo), raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace", dump_of(nccl), raising=False)
    got = flight_recorder.read_dump()
    assert [(e.source, e.pg_name) for e in got.entries] == [("nccl", "1"), ("generic", "0")]
    monkeypatch.setattr(c10d, "_dump_nccl_trace", dump_of(), raising=False)
    assert [e.source for e in flight_recorder.read_entries()] == ["generic"]


def test_parse_converts_only_entries_newer_than_those_seen() -> None:
    """A read repeats the whole buffer: entries at or before `after` are not converted,
    and the ones kept carry their recorder's name."""
    items = [
        {"record_id": i, "process_group": ["0", "default_pg"], "collective_seq_id": i,
         "profiling_name": "nccl:all_reduce", "state": "completed", "time_created_ns": i}
        for i in range(6)
    ]  # fmt: skip
    kept = parse_dump({"entries": items}, source="nccl", after=3)
    assert [e.record_id for e in kept] == [4, 5]
    assert {e.source for e in kept} == {"nccl"}
    assert [e.record_id for e in parse_dump({"entries": items})] == list(range(6))
    assert parse_dump({"entries": [*items, "junk"]}, after=4)[-1].record_id == 5
