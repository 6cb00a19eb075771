"""Who this process is in the job, and distanom's own channel to the other ranks.

`WorldInfo` is read once from the environment torchrun sets (RANK, WORLD_SIZE,
LOCAL_RANK, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID) and
passed explicitly.
`AgentGroup` is a gloo process group of distanom's own, built on a client connection to
the launcher's TCPStore under a distanom key prefix. It never calls
`init_process_group` and never touches the default group, so the training script keeps
full control of its own (NCCL or gloo) setup, and group-creation order cannot deadlock
against the script's `new_group` calls. With one process, every collective is local.
This is the only module that imports torch.distributed.
"""

from __future__ import annotations

import array
import contextlib
import datetime
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class WorldInfo:
    """This process's place in the job (from torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    host: str
    master_addr: str | None
    master_port: int | None
    job_id: str
    node_count: int = 1  # torchrun's nodes (agents) in the rendezvous

    @property
    def is_distributed(self) -> bool:
        """Whether the job has more than one rank."""
        return self.world_size > 1

    @property
    def node_ranks(self) -> range:
        """The global ranks of this node: torchrun numbers a node's workers contiguously,
        local rank 0 first."""
        first = self.rank - self.local_rank
        return range(first, first + self.local_world_size)

    @property
    def label(self) -> str:
        """The rank as `r<rank>/<world_size>`, as in log prefixes."""
        return f"r{self.rank}/{self.world_size}"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> WorldInfo:
        """This rank's place in the job, from torchrun's environment (defaults: one process)."""
        env = dict(os.environ) if env is None else env

        def number(key: str, default: int) -> int:
            raw = env.get(key)
            if raw is None or raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                return default

        port = env.get("MASTER_PORT")
        return cls(
            rank=number("RANK", 0),
            world_size=max(1, number("WORLD_SIZE", 1)),
            local_rank=number("LOCAL_RANK", 0),
            local_world_size=max(1, number("LOCAL_WORLD_SIZE", 1)),
            node_rank=number("GROUP_RANK", 0),
            host=socket.gethostname(),
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=int(port) if port and port.isdecimal() else None,
            job_id=f"{env.get('TORCHELASTIC_RUN_ID', 'none')}/"
            f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}",
            node_count=max(1, number("GROUP_WORLD_SIZE", 1)),
        )


class GroupUnavailableError(RuntimeError):
    """distanom's group could not be formed or a collective failed / timed out."""


class AgentGroup:
    """distanom's private gloo group plus a small key-value channel (the store).

    Every method may block: call them from distanom's background thread only.
    """

    def __init__(self, world: WorldInfo, *, setup_timeout_s: float, op_timeout_s: float) -> None:
        self.world = world
        self._op_timeout = datetime.timedelta(seconds=op_timeout_s)
        self._store: Any = None
        self._pg: Any = None
        if world.world_size == 1:
            self._local: dict[str, bytes] = {}
            return
        self._store, self._pg = self._connect(world, setup_timeout_s, op_timeout_s)

    @staticmethod
    def _connect(world: WorldInfo, setup_timeout_s: float, op_timeout_s: float) -> tuple[Any, Any]:
        import torch.distributed

        dist: Any = torch.distributed  # TCPStore/PrefixStore are not re-exported in its stubs
        timeout = datetime.timedelta(seconds=setup_timeout_s)
        base: Any
        if world.master_addr is not None and world.master_port is not None:
            base = dist.TCPStore(
                world.master_addr, world.master_port, is_master=False, timeout=timeout
            )
        else:
            # No launcher store: wait for the script's own init_process_group and share its store.
            deadline = time.monotonic() + setup_timeout_s
            while not (dist.is_available() and dist.is_initialized()):
                if time.monotonic() > deadline:
                    raise GroupUnavailableError(
                        "no MASTER_ADDR/MASTER_PORT and the script never initialised "
                        "torch.distributed"
                    )
                time.sleep(0.5)
            base = dist.distributed_c10d._get_default_store()
        store = dist.PrefixStore(f"distanom/{world.job_id}/", base)
        pg = dist.ProcessGroupGloo(
            store, world.rank, world.world_size, datetime.timedelta(seconds=op_timeout_s)
        )
        return store, pg

    def all_gather(self, row: torch.Tensor, timeout_s: float | None = None) -> torch.Tensor:
        """Gather one 1-D float64 tensor per rank into a (world_size, n) tensor."""
        if self._pg is None:
            return row.reshape(1, -1).clone()
        out = [torch.empty_like(row) for _ in range(self.world.world_size)]
        work = self._pg.allgather([out], [row])
        wait = self._op_timeout if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        try:
            work.wait(wait)
        except Exception as err:  # gloo raises RuntimeError subclasses on timeout/peer loss
            raise GroupUnavailableError(f"all-gather failed: {err}".splitlines()[0]) from err
        return torch.stack(out)

    def all_gather_rows(
        self, row: array.array[float], timeout_s: float | None = None
    ) -> list[list[float]]:
        """`all_gather` of a float64 row given as an `array`, returned as one list per
        rank: the gathered matrix's `tolist()`. A job of one rank needs no torch for it
        (each torch call costs the control thread a cold dispatch per round)."""
        if self._pg is None:
            return [row.tolist()]
        out = self.all_gather(torch.frombuffer(row, dtype=torch.float64), timeout_s)
        return list(out.tolist())

    def close(self) -> None:
        """Release the group while Python is fully alive: left to interpreter shutdown,
        gloo's threads can be torn down out of order and abort the process."""
        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(Exception):  # best effort: the process is exiting
                pg.shutdown()
            del pg
        self._store = None

    def publish(self, key: str, value: str) -> None:
        """Set `key` in distanom's store (a local dict when the job has one rank)."""
        if self._store is None:
            self._local[key] = value.encode()
            return
        self._store.set(key, value)

    def lookup(self, key: str) -> str:
        """Blocking read of a key published by another rank (bounded by the setup timeout)."""
        if self._store is None:
            return self._local[key].decode()
        try:
            return bytes(self._store.get(key)).decode()
        except Exception as err:
            raise GroupUnavailableError(f"store lookup of {key!r} failed: {err}") from err
