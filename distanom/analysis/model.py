"""The report's typed model: a run read once, everything every rendering shows.

Frozen values only. `distanom.analysis.build` makes a `Report` from a loaded run;
`render_json`, `render_text` and `html_report` render it, and `outputs` writes the
files it carries (summary.json, merged traces, cached table CSVs) into the run directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distanom.analysis.anomalies import Anomaly
from distanom.analysis.engine import TraceTables
from distanom.analysis.evidence import Verdict
from distanom.analysis.hangs import Hang
from distanom.analysis.kernel_diff import RankDiff
from distanom.analysis.lost_time import LostTime
from distanom.analysis.tables import Timeline

__all__ = [
    "BREAKDOWN_ROWS",
    "Capture",
    "CaptureCost",
    "CaptureState",
    "GcPause",
    "KernelDiff",
    "MergedTrace",
    "RankEntry",
    "Report",
    "RunFacts",
    "StepStats",
    "StepTimes",
]

# The four parts of a step a user compares first, then the total, in report order.
BREAKDOWN_ROWS = (
    "computation_time",
    "exposed_comm_time",
    "exposed_memcpy_time",
    "idle_time",
    "total_time",
)


@dataclass(frozen=True)
class RunFacts:
    """Who and where the run is: from run.json and status.json."""

    run_id: str
    run_dir: str
    world_size: int
    hosts: list[str]
    state: str
    started_at: Any
    torch: Any
    argv: Any
    node_of: dict[int, int] = field(default_factory=dict)
    """torchrun's node (GROUP_RANK) of each rank whose node is known."""
    node_hosts: dict[int, str] = field(default_factory=dict)
    """Each known node's host."""
    copies: list[str] = field(default_factory=list)
    """Every node's copy of the run the report read, where it read more than one."""

    @property
    def several_nodes(self) -> bool:
        """Whether the ranks ran on more than one node."""
        return len(set(self.node_of.values())) > 1

    def node_ranks(self) -> dict[int, list[int]]:
        """Each known node's ranks, by node; a rank's local rank is its place there."""
        nodes: dict[int, list[int]] = {}
        for rank, node in sorted(self.node_of.items()):
            nodes.setdefault(node, []).append(rank)
        return dict(sorted(nodes.items()))

    def where(self, rank: int) -> str:
        """Where `rank` ran, for people: "node 1, local rank 0, host gpu-7" ('' unknown)."""
        node = self.node_of.get(rank)
        if node is None:
            return ""
        local = self.node_ranks()[node].index(rank)
        host = self.node_hosts.get(node)
        return f"node {node}, local rank {local}" + (f", host {host}" if host else "")


@dataclass(frozen=True)
class StepStats:
    """The run's step count and median, and the detector's threshold and its median."""

    count: int
    last: int | None
    median_ms: float | None
    threshold_ms: Any
    multiplier: Any
    detector_median_ms: Any
    """The detector's latest rolling median, the one its threshold multiplies."""
    optimizer_skipped: int = 0
    """Steps whose optimizer step a GradScaler skipped (inf/nan gradients)."""


@dataclass(frozen=True)
class StepTimes:
    """Every step's time (slowest rank) and the threshold it was judged by, for charts."""

    steps: list[int]
    step_ms: list[float]
    threshold_ms: list[float]


@dataclass(frozen=True)
class CaptureState:
    """The job's capture counters and why it stopped capturing, from status.json."""

    written: Any
    skipped_disk: Any
    missed: Any
    capture_off: Any
    consensus_error: Any


@dataclass(frozen=True)
class CaptureCost:
    """What writing a capture cost one rank's capture worker (median over files)."""

    files: int
    median_ms: float
    max_ms: float
    parts_median_ms: dict[str, float]


@dataclass(frozen=True)
class GcPause:
    """A rank's Python garbage collection during a captured step."""

    ms: float
    generation: int


@dataclass(frozen=True)
class RankEntry:
    """One rank's trace of a capture, with its table when it could be read."""

    rank: int
    trace: str
    """Relative to the run directory."""
    host: str | None
    bytes: int
    tracer: str | None
    tracer_stats: dict[str, Any]
    timeline: Timeline | None = None
    timeline_kind: str | None = None
    """"gpu" (gpu_timeline) or "cpu" (host breakdown of a CPU-only trace)."""
    outside_ms: float | None = None
    """Step window outside the ops' span (CPU-only traces), which the verdict counts idle."""
    computed: TraceTables | None = None
    """Tables computed from the trace (not read from their CSV): cached by `outputs`."""
    run_dir: str | None = None
    """The copy of the run that holds `trace` where it is not the report's run directory
    (another node's copy; docs/multinode.md)."""

    def breakdown(self) -> dict[str, float] | None:
        """The rank's computation / exposed comm / exposed memcpy / idle / total in ms."""
        if self.timeline is None:
            return None
        return {row: float(self.timeline.ms(row)) for row in BREAKDOWN_ROWS}


@dataclass(frozen=True)
class KernelDiff:
    """Every rank's ops against the same rank in the reference step."""

    reference_step: int | None
    ranks: dict[int, RankDiff] = field(default_factory=dict)
    note: str | None = None
    """Why there is no diff (set only when `reference_step` is None)."""


@dataclass(frozen=True)
class MergedTrace:
    """All ranks of a capture in one trace: its path and, when stale, the bytes to write."""

    relative: str
    path: Path
    content: bytes | None
    """None: the file on disk is newer than every rank trace, nothing to write."""
    problem_at: int
    """Where a failure to write it goes in `Report.problems`."""


@dataclass(frozen=True)
class Capture:
    """One captured step: its index facts, its ranks, and the cross-rank analysis."""

    step: int
    kinds: list[str]
    step_ms: float | None
    median_ms: float | None
    threshold_ms: float | None
    ratio: float | None
    slowest_rank: int | None
    request: str | None
    ranks: dict[int, RankEntry]
    missing_ranks: list[int]
    python_gc: dict[int, GcPause]
    verdict: Verdict
    kernel_diff: KernelDiff
    merged: MergedTrace | None
    unreadable_ranks: list[int]
    optimizer_skipped: bool = False
    """The step's optimizer step was skipped (a GradScaler found inf/nan gradients)."""

    @property
    def merged_trace(self) -> str | None:
        """The merged trace's path relative to the run directory, if there is one."""
        return self.merged.relative if self.merged is not None else None

    @property
    def shows_outside(self) -> bool:
        """Whether the breakdown table gets the "outside ops" column: the verdict counts
        time outside the ops' span as idle, so the table shows it too."""
        return any(entry.outside_ms is not None for entry in self.ranks.values())


@dataclass(frozen=True)
class Report:
    """A run's report: facts, steps, detector and tracer state, captures, problems."""

    facts: RunFacts
    steps: StepStats
    step_times: StepTimes | None
    tracer: dict[str, Any]
    detector: dict[str, Any]
    episodes: list[Any]
    capture_state: CaptureState
    captures: list[Capture]
    capture_cost: CaptureCost | None
    problems: list[str]
    detect_config: Mapping[str, Any] = field(default_factory=dict)
    """The run's `detect` config section (multiplier, windows) as run.json holds it."""
    hangs: list[Hang] = field(default_factory=list)
    """Every hang the ranks recorded, with its verdict (`distanom.analysis.hangs`)."""
    anomalies: list[Anomaly] = field(default_factory=list)
    """Every step judged anomalous, traced or not, with its verdict (anomalies.jsonl)."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """Ranks the others kept waiting for, most severe first (stragglers.json)."""
    earlier_stragglers: list[dict[str, Any]] = field(default_factory=list)
    """Ranks named stragglers during the run that later caught up (stragglers.json)."""
    drift: dict[str, Any] | None = None
    """The whole job's slowdown from its first to its last steps, when there was one."""
    agent_cost: dict[str, Any] = field(default_factory=dict)
    """distanom's own time per step on rank 0, as status.json's `agent_cost` holds it."""
    lost_time: LostTime | None = None
    """The run's time lost to slow steps by culprit, cause and phase (`analysis.lost_time`)."""

    @property
    def has_slowness(self) -> bool:
        """Anything for the anomalies-and-stragglers section of the text and HTML."""
        return bool(self.anomalies or self.stragglers or self.earlier_stragglers or self.drift)
