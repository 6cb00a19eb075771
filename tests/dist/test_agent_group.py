"""distanom's private gloo group across real processes (no torchrun: the test hosts the store)."""

from __future__ import annotations

import array
import datetime
import multiprocessing as mp
import time
from typing import Any

import torch
import torch.distributed as dist

from distanom.world import AgentGroup, GroupUnavailableError, WorldInfo
from tests.conftest import free_port


def world(rank: int, size: int, port: int) -> WorldInfo:
    return WorldInfo(rank, size, rank, size, 0, "host", "127.0.0.1", port, "test/0")


def gather_worker(rank: int, size: int, port: int, out: Any) -> None:
    group = AgentGroup(world(rank, size, port), setup_timeout_s=30, op_timeout_s=30)
    row = torch.tensor([float(rank), float(rank) * 10], dtype=torch.float64)
    result = group.all_gather(row)
    as_lists = group.all_gather_rows(array.array("d", row.tolist()))
    group.publish(f"k{rank}", f"v{rank}")
    seen = [group.lookup(f"k{r}") for r in range(size)]
    out.put((rank, result.tolist(), seen, as_lists))


def test_all_gather_and_store_across_four_processes() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=gather_worker, args=(r, 4, port, out)) for r in range(4)]
    for proc in procs:
        proc.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(30)
    expected = [[float(r), float(r) * 10] for r in range(4)]
    assert [r[1] for r in results] == [expected] * 4
    assert [r[3] for r in results] == [expected] * 4  # all_gather_rows: the same, as lists
    assert [r[2] for r in results] == [[f"v{r}" for r in range(4)]] * 4
    del store


def dying_worker(rank: int, port: int, out: Any) -> None:
    group = AgentGroup(world(rank, 2, port), setup_timeout_s=30, op_timeout_s=3)
    row = torch.zeros(2, dtype=torch.float64)
    group.all_gather(row)
    if rank == 1:
        return  # gone: never joins the second round
    started = time.monotonic()
    try:
        group.all_gather(row)
        out.put(("no error", 0.0))
    except GroupUnavailableError as err:
        out.put((str(err), time.monotonic() - started))


def test_a_rank_that_disappears_times_out_instead_of_hanging() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=dying_worker, args=(r, port, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    message, waited = out.get(timeout=120)
    for proc in procs:
        proc.join(30)
    assert message.startswith("all-gather failed"), message
    assert waited < 30
    del store


def test_world_size_one_needs_no_store() -> None:
    group = AgentGroup(world(0, 1, 0), setup_timeout_s=1, op_timeout_s=1)
    row = torch.tensor([1.5], dtype=torch.float64)
    assert group.all_gather(row).tolist() == [[1.5]]
    group.publish("a", "b")
    assert group.lookup("a") == "b"


def test_world_info_from_torchrun_environment() -> None:
    info = WorldInfo.from_env(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "abc",
            "TORCHELASTIC_RESTART_COUNT": "2",
        }
    )
    assert (info.rank, info.world_size, info.local_rank, info.node_rank) == (5, 8, 1, 1)
    assert info.master_port == 29500 and info.job_id == "abc/2" and info.label == "r5/8"
    assert WorldInfo.from_env({}).world_size == 1


def test_a_one_rank_group_gathers_rows_without_a_store() -> None:
    group = AgentGroup(world(0, 1, 1), setup_timeout_s=1, op_timeout_s=1)
    row = array.array("d", [1.0, float("nan"), 3.0])
    gathered = group.all_gather_rows(row)
    assert repr(gathered) == repr(group.all_gather(torch.frombuffer(row, dtype=torch.float64)).tolist())
