"""How every rank of a job comes to write into one run, on one node or several.

Rank 0 creates the run directory under its `--run-dir` and names it; the name (the run
id) reaches every other rank through distanom's store, so all nodes agree on it whatever
their clocks say. Each rank then opens `<its --run-dir>/<run id>`: with a shared
filesystem that is rank 0's folder, without one each node makes its own copy. Each
node's local rank 0 writes that node's file (`records.nodes`) and points its node's
`runs/latest` at the run (on a shared filesystem that is rank 0's link, set again to
the same run, atomically). Every rank publishes where it runs
(node, local rank, host) for rank 0's run.json. Called on the control thread, during
setup; the store calls may block.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from distanom.errors import RunDirError
from distanom.health import Health
from distanom.records.nodes import NodeInfo, write_node_info
from distanom.rundir import RunDir, create_run, update_latest
from distanom.world import AgentGroup, WorldInfo

RUN_ID_KEY = "run_id"


@dataclass(frozen=True)
class Place:
    """Where one rank runs: its node (torchrun's GROUP_RANK) and host."""

    node_rank: int
    host: str


def join_run(
    group: AgentGroup, world: WorldInfo, run_base: Path, name: str | None, health: Health
) -> tuple[str, RunDir | None]:
    """The run id every rank shares ("" when rank 0 could not create the run) and this
    rank's run directory (its node's copy), None when it cannot write one (the reason is
    in `health`). Publishes the run id (rank 0) and this rank's place."""
    run_id = ""
    if world.rank == 0:
        try:
            path = create_run(run_base, name)
            run_id = path.name
            with contextlib.suppress(OSError):
                update_latest(run_base, path)
        except RunDirError as err:
            health.capture_off(str(err))
        group.publish(RUN_ID_KEY, run_id)
    else:
        run_id = group.lookup(RUN_ID_KEY)
        if not run_id:
            health.capture_off("rank 0 could not create the run directory")
    group.publish(f"place/{world.rank}", f"{world.node_rank}/{world.host}")
    if not run_id:
        return run_id, None
    run = RunDir(run_base / run_id)
    try:
        if world.rank != 0:
            _open_copy(run.path)
    except (OSError, RunDirError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        health.capture_off(f"{run.path}: not writable ({reason})")
        return run_id, None
    if world.local_rank == 0:
        node = NodeInfo(
            run_id=run_id,
            node_rank=world.node_rank,
            node_count=world.node_count,
            host=world.host,
            world_size=world.world_size,
            ranks=tuple(world.node_ranks),
        )
        try:
            write_node_info(run, node)
            if world.rank != 0:  # rank 0 set its own when it created the run
                update_latest(run_base, run.path)
        except OSError as err:  # the report then lacks this node's name: training goes on
            health.warn_once("node-file", "distanom: %s: node file not written (%s)", run.path, err)
    return run_id, run


def _open_copy(path: Path) -> None:
    """Make this node's copy of the run directory unless it is there (rank 0's folder on
    a shared filesystem, or made by a rank of this node that came first). A link or a
    file in its place is refused, never followed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise RunDirError(f"{path}: a link or file stands where the run belongs")


def read_places(group: AgentGroup, world_size: int) -> list[Place]:
    """Every rank's place, as the ranks published them (rank 0 only, for run.json)."""
    places = []
    for rank in range(world_size):
        node, _, host = group.lookup(f"place/{rank}").partition("/")
        places.append(Place(int(node) if node.isdecimal() else -1, host))
    return places
