"""Several copies of one run, reported as one: the run directories of every node of a
job that had no shared filesystem (docs/multinode.md).

`open_copies` opens each directory given (a base resolves to its `latest`, as
everywhere), drops a directory given twice, refuses copies of different runs with one
line (a copy's run: its run.json's id, else the one its node files name, else its
folder's name; a node file naming another run is set aside with a problem line, so a
file planted in a shared run directory cannot make the report refuse it), and picks the
primary copy: the one holding run.json (node 0's, where rank 0
writes run.json, status.json and the anomaly journal). Every rank's own files (steps,
traces, index lines, hang records) are then read from whichever copy holds them.
`missing_nodes` says which node's ranks left no step file in any copy given. Reads only
run.json's id and the node files (`records.nodes`), bounded; no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from distanom.analysis.text import ranks_word
from distanom.errors import DistanomError, RunDirError
from distanom.records.nodes import NodeInfo, read_nodes
from distanom.records.run_info import load_run_info
from distanom.rundir import RunDir

__all__ = ["RunCopies", "missing_nodes", "node_of_ranks", "open_copies"]

MAX_COPIES = 4096  # directories on one command line: far more than a job's nodes


@dataclass(frozen=True)
class RunCopies:
    """The copies of one run: the primary first, each once, and every node file read."""

    copies: tuple[RunDir, ...]
    nodes: dict[int, NodeInfo] = field(default_factory=dict)  # by node rank
    problems: list[str] = field(default_factory=list)

    @property
    def primary(self) -> RunDir:
        """The copy holding run.json (else the first given)."""
        return self.copies[0]


def open_copies(paths: Sequence[str | Path]) -> RunCopies:
    """Open the copies of one run; DistanomError (one line) when a directory is not a
    run or the copies belong to different runs."""
    if len(paths) > MAX_COPIES:
        raise DistanomError(f"report: {len(paths)} run directories given; at most {MAX_COPIES}")
    runs: list[RunDir] = []
    for path in paths:
        run = RunDir.open(path)
        if all(run.path != seen.path for seen in runs):
            runs.append(run)
    nodes: dict[int, NodeInfo] = {}
    problems: list[str] = []
    identities: list[tuple[str, RunDir]] = []
    with_run_json: list[RunDir] = []
    for run in runs:
        found, read_problems = read_nodes(run)
        problems += read_problems
        run_id = _run_json_id(run)
        if run_id is not None:
            with_run_json.append(run)
        identity = run_id or _node_files_id(run, found)
        for node in found:
            if node.run_id != identity:  # planted, or left by another run: not this run's
                problems.append(
                    f"{run.path}/nodes/node{node.node_rank}.json: names run "
                    f"{node.run_id!r}, not {identity!r}; ignored"
                )
                continue
            nodes.setdefault(node.node_rank, node)
        identities.append((identity, run))
    distinct = {run_id for run_id, _ in identities}
    if len(distinct) > 1:
        shown = "; ".join(f"{run.path}: {run_id}" for run_id, run in identities[:4])
        raise DistanomError(f"report: the run directories are not copies of one run ({shown})")
    primary = with_run_json[0] if with_run_json else runs[0]
    ordered = (primary, *(run for run in runs if run is not primary))
    if len(runs) > 1 and not with_run_json:
        problems.append(
            "no run.json in the run directories given: rank 0 writes it into node 0's copy"
        )
    return RunCopies(ordered, dict(sorted(nodes.items())), problems)


def _node_files_id(run: RunDir, found: list[NodeInfo]) -> str:
    """The run a copy without run.json belongs to, by its node files: the folder's own
    name when a node file names it (the run id is the folder's name as every node made
    it), else the one run they all name (a copy fetched under another name), else the
    folder's name."""
    named = {node.run_id for node in found}
    if run.run_id in named or len(named) != 1:
        return run.run_id
    return next(iter(named))


def _run_json_id(run: RunDir) -> str | None:
    """run.json's run id; '' when the file is there without a usable id, None when
    there is no readable run.json."""
    if not run.run_json.is_file():
        return None
    try:
        info = load_run_info(run)
    except RunDirError:
        return None
    run_id = info.get("run_id")
    return run_id if isinstance(run_id, str) and run_id else ""


def node_of_ranks(
    world_size: int, node_ranks: Sequence[int], nodes: Mapping[int, NodeInfo]
) -> dict[int, int]:
    """The node of each rank whose node is known: run.json's `node_ranks`, else the node
    files."""
    known = {rank: node for rank, node in enumerate(node_ranks[:world_size]) if node >= 0}
    for node in nodes.values():
        for rank in node.ranks:
            known.setdefault(rank, node.node_rank)
    return dict(sorted(known.items()))


def missing_nodes(
    world_size: int,
    with_steps: set[int],
    node_of: Mapping[int, int],
    nodes: Mapping[int, NodeInfo],
) -> list[str]:
    """A line per node whose ranks left no step file in any copy given, naming the node
    whose copy was not given; [] when nothing is known of the nodes (a run of an older
    version) or every rank has its file."""
    if not node_of and not nodes:
        return []
    missing = [rank for rank in range(world_size) if rank not in with_steps]
    by_node: dict[int, list[int]] = {}
    unknown: list[int] = []
    for rank in missing:
        node = node_of.get(rank)
        if node is None:
            unknown.append(rank)
        else:
            by_node.setdefault(node, []).append(rank)
    lines = []
    for node, ranks in sorted(by_node.items()):
        info = nodes.get(node)
        host = f" ({info.host})" if info is not None and info.host else ""
        why = "" if info is not None else f"; node {node}'s run directory was not given"
        lines.append(f"{ranks_word(ranks)} of node {node}{host}: no step files{why}")
    if unknown:
        counts = {node.node_count for node in nodes.values()}
        absent = sorted(set(range(max(counts))) - set(nodes)) if counts else []
        word = "node" if len(absent) == 1 else "nodes"
        which = f"; not given: the run directory of {word} {', '.join(map(str, absent))}"
        which = which if absent else ""
        lines.append(f"{ranks_word(unknown)}: no step files, node unknown{which}")
    return lines
