"""run.json: the facts of a run (versions, world, hosts, argv, the whole configuration),
written once by rank 0's control thread when the group has formed, read by the report.

Every field is optional to a reader (a damaged or older file), so `RunInfo` is a
`TypedDict` read with `.get`; `world_size` and `hosts` have checked accessors.
"""

from __future__ import annotations

from typing import Any, TypedDict

from distanom.errors import RunDirError
from distanom.rundir import RunDir, read_json, write_json_atomic

MAX_WORLD_SIZE = 1 << 17  # far beyond any job; larger is damage (a report would loop on it)


class RunInfo(TypedDict, total=False):
    """The body of run.json (keys in the order written)."""

    run_id: str | None
    distanom: str
    torch: str
    cuda: str | None
    python: str
    world_size: int
    started_at: float
    argv: list[str]
    config: dict[str, Any]
    hosts: list[str]  # host of each rank
    nodes: dict[str, list[int]]  # host -> its ranks
    node_ranks: list[int]  # torchrun's node (GROUP_RANK) of each rank, -1 unknown


def runtime_versions() -> dict[str, str | None]:
    """This process's distanom, torch, cuda and python versions, in run.json's order."""
    import platform

    import torch  # here: readers of run.json need no torch

    from distanom.version import __version__

    return {
        "distanom": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def build_run_info(
    *,
    run_id: str | None,
    versions: dict[str, str | None],
    world_size: int,
    started_at: float,
    argv: list[str],
    config: dict[str, Any],
    hosts: list[str] | None,
    node_ranks: list[int] | None = None,
) -> RunInfo:
    """The run.json body; `versions` holds distanom, torch, cuda and python, in that order."""
    body: dict[str, Any] = {"run_id": run_id, **versions}
    body.update(world_size=world_size, started_at=started_at, argv=argv, config=config)
    if hosts is not None:
        body["hosts"] = hosts
        nodes: dict[str, list[int]] = {}
        for rank, host in enumerate(hosts):
            nodes.setdefault(host, []).append(rank)
        body["nodes"] = nodes
    if node_ranks is not None:
        body["node_ranks"] = node_ranks
    return body  # type: ignore[return-value]


def write_run_info(run: RunDir, info: RunInfo) -> None:
    """Write run.json atomically."""
    write_json_atomic(run.run_json, info)


def load_run_info(run: RunDir) -> RunInfo:
    """run.json as an object; RunDirError when missing, damaged or not an object."""
    info = read_json(run.run_json)
    if not isinstance(info, dict):
        raise RunDirError(f"{run.run_json}: not a JSON object")
    return info  # type: ignore[return-value]


def world_size_of(info: RunInfo | dict[str, Any]) -> int:
    """The run's world size, 1 when absent or damaged (not an integer, or outside
    1..MAX_WORLD_SIZE)."""
    size = info.get("world_size")
    valid = isinstance(size, int) and not isinstance(size, bool) and 0 < size <= MAX_WORLD_SIZE
    return size if valid else 1  # type: ignore[return-value]


def world_size_problem(info: RunInfo | dict[str, Any]) -> str | None:
    """What is wrong with run.json's world_size, None when it is valid or absent."""
    size = info.get("world_size")
    if size is None or world_size_of(info) == size:
        return None
    shown = repr(size) if len(repr(size)) < 40 else repr(size)[:40] + "..."
    return f"world_size {shown} is not an integer in 1..{MAX_WORLD_SIZE}; read as 1"


def node_ranks_of(info: RunInfo | dict[str, Any]) -> list[int]:
    """The node of each rank (-1 unknown), [] when absent or damaged."""
    nodes = info.get("node_ranks")
    if not isinstance(nodes, list):
        return []
    return [
        n if isinstance(n, int) and not isinstance(n, bool) and 0 <= n < MAX_WORLD_SIZE else -1
        for n in nodes[:MAX_WORLD_SIZE]
    ]


def hosts_of(info: RunInfo | dict[str, Any]) -> list[str]:
    """The host of each rank, [] when absent or damaged."""
    hosts = info.get("hosts")
    if not isinstance(hosts, list):
        return []
    return [h if isinstance(h, str) else str(h)[:200] for h in hosts[:MAX_WORLD_SIZE]]
