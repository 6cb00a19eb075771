"""nodes/node<N>.json: one node's part of a run, written once by that node's local rank 0
when the group has formed, read by the report.

Without a shared filesystem every node writes its own copy of the run directory, and
run.json (rank 0's) exists only in node 0's copy. A node file makes every copy say which
run it belongs to and which ranks wrote into it, so `distanom report` can join the copies
of one run, refuse copies of different runs, and name the node whose copy is missing
(docs/multinode.md). With a shared filesystem all node files sit side by side in the
one run directory: each node owns its own file.

Reading is bounded (the folder listing, each file's size) and never follows a link;
every field is validated, and a damaged file is a problem line, never an exception.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distanom.errors import RunDirError
from distanom.records.run_info import MAX_WORLD_SIZE
from distanom.rundir import NODES_DIR, RunDir, json_bytes
from distanom.safe_io import open_dir, parse_json, read_capped

MAX_NODE_FILE_BYTES = 64 * 1024
MAX_NODE_FILES = 4096  # node files looked at per copy
_NODE_FILE = re.compile(r"^node(\d{1,6})\.json$")


@dataclass(frozen=True)
class NodeInfo:
    """One node of a run: its number in the rendezvous, host and global ranks."""

    run_id: str
    node_rank: int
    node_count: int
    host: str
    world_size: int
    ranks: tuple[int, ...]  # local rank i is ranks[i]

    def as_json(self) -> dict[str, Any]:
        """The body of the node file."""
        return {
            "run_id": self.run_id,
            "node_rank": self.node_rank,
            "node_count": self.node_count,
            "host": self.host,
            "world_size": self.world_size,
            "ranks": list(self.ranks),
        }


def node_file(run: RunDir, node_rank: int) -> Path:
    """Where node `node_rank` writes its node file."""
    return run.path / NODES_DIR / f"node{node_rank}.json"


def write_node_info(run: RunDir, node: NodeInfo) -> None:
    """Write the node file atomically (nodes/ made without following a link)."""
    run.write_capture_file(node_file(run, node.node_rank), json_bytes(node.as_json(), indent=True))


def read_nodes(run: RunDir) -> tuple[list[NodeInfo], list[str]]:
    """Every valid node file of this copy, by node rank, and a problem line for each
    damaged one."""
    try:
        with open_dir(run.path, (NODES_DIR,)) as folder:
            names = sorted(itertools.islice(os.listdir(folder), MAX_NODE_FILES))
    except FileNotFoundError:
        return [], []
    except OSError as err:  # a link planted in place of nodes/ (UnsafePathError is one)
        return [], [f"{run.path / NODES_DIR}: not read ({err})"]
    nodes: list[NodeInfo] = []
    problems: list[str] = []
    for name in names:
        match = _NODE_FILE.match(name)
        if match is None:
            continue
        path = run.path / NODES_DIR / name
        try:
            node = _parse(read_capped(path, MAX_NODE_FILE_BYTES, follow=False))
        except (OSError, ValueError, RunDirError) as err:
            problems.append(f"{path}: not a node file ({_reason(err)})")
            continue
        if node.node_rank != int(match.group(1)):
            problems.append(f"{path}: names node {node.node_rank}; ignored")
            continue
        nodes.append(node)
    return sorted(nodes, key=lambda n: n.node_rank), problems


def _reason(err: Exception) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err)[:200]


def _parse(data: bytes) -> NodeInfo:
    body = parse_json(data)
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    run_id = body.get("run_id")
    host = body.get("host")
    ranks = body.get("ranks")
    if not isinstance(run_id, str) or not 0 < len(run_id) <= 256:
        raise ValueError("run_id is not a name")
    if not isinstance(host, str) or len(host) > 256:
        raise ValueError("host is not a name")
    world_size = _bounded(body.get("world_size"), 1, MAX_WORLD_SIZE, "world_size")
    node_count = _bounded(body.get("node_count"), 1, MAX_WORLD_SIZE, "node_count")
    node_rank = _bounded(body.get("node_rank"), 0, node_count - 1, "node_rank")
    if not isinstance(ranks, list) or not 0 < len(ranks) <= world_size:
        raise ValueError("ranks is not a list of the world's ranks")
    checked = tuple(_bounded(rank, 0, world_size - 1, "rank") for rank in ranks)
    return NodeInfo(run_id, node_rank, node_count, host, world_size, checked)


def _bounded(value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} is not an integer in {low}..{high}")
    return value
