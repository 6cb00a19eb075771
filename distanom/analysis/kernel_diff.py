"""Kernel diff: what a captured step ran that its healthy reference step did not.

Owns: the per-rank op table a diff compares (GPU traces: every `kernel` event grouped by
name and launch shape, i.e. the `grid` and `block` args Kineto records, with count and
total µs; CPU-only traces: cpu_op / user_annotation spans grouped by name), the choice
of reference capture for a step, the diff itself (ops that appeared, vanished, grew or
shrank, ranked by added µs, plus the change of idle time) and its text rendering.

Reads: parsed trace events and the report's per-capture dicts. Hands on: `RankDiff`s,
as JSON, to the report (`kernel_diff` of a capture) and the HTML page. Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from distanom.analysis.text import short
from distanom.analysis.trace_io import is_finite_number

__all__ = [
    "TOP_CHANGES",
    "KernelChange",
    "OpKey",
    "OpStats",
    "RankDiff",
    "diff_ops",
    "kernel_diff_lines",
    "op_table",
    "pick_reference",
    "top_changes",
]

OpKind = Literal["gpu", "cpu"]
Shape = tuple[int, ...] | None


@dataclass(frozen=True, order=True)
class OpKey:
    """What a diff matches on: the name and, for kernels, the launch shape."""

    name: str
    grid: Shape = None
    block: Shape = None

    def label(self) -> str:
        """The op's name with its launch shape, for text."""
        if self.grid is None and self.block is None:
            return self.name
        return f"{self.name} {_shape(self.grid)}x{_shape(self.block)}"


@dataclass(frozen=True)
class OpStats:
    """How often an op ran in a step and its total µs."""

    count: int
    total_us: float


TOP_CHANGES = 10
"""Changes kept per rank in the report (the rest are summed into `other_added_us`)."""

_HOST_CATEGORIES = frozenset(("cpu_op", "user_annotation"))
# Step markers: the profiler's cycle counter and distanom's own step span would make
# every diff say "the step grew".
_SKIPPED_HOST = re.compile(r"ProfilerStep#\d+|distanom.*")


def _shape(value: Shape) -> str:
    return "?" if value is None else "(" + ",".join(str(v) for v in value) + ")"


def _launch_shape(value: Any) -> Shape:
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return tuple(value)
    return None


def op_table(events: Iterable[Mapping[str, Any]]) -> tuple[OpKind, dict[OpKey, OpStats]]:
    """Count and total µs per kernel (name, grid, block); per CPU op name when the trace
    has no kernel at all (kind "cpu"). Host spans nest, so CPU totals are inclusive."""
    kernels: dict[OpKey, list[float]] = {}
    host: dict[OpKey, list[float]] = {}
    for event in events:
        dur, name, cat = event.get("dur"), event.get("name"), event.get("cat")
        if not is_finite_number(dur) or not isinstance(name, str):
            continue
        if cat == "kernel":
            args = event.get("args")
            args = args if isinstance(args, dict) else {}
            key = OpKey(name, _launch_shape(args.get("grid")), _launch_shape(args.get("block")))
            kernels.setdefault(key, []).append(float(dur))
        elif (
            cat in _HOST_CATEGORIES and event.get("ph") == "X" and not _SKIPPED_HOST.fullmatch(name)
        ):
            host.setdefault(OpKey(name), []).append(float(dur))
    kind: OpKind = "gpu" if kernels else "cpu"
    chosen = kernels if kernels else host
    return kind, {key: OpStats(len(durs), math.fsum(durs)) for key, durs in chosen.items()}


@dataclass(frozen=True)
class KernelChange:
    """One op in a step against the same op in the reference step."""

    key: OpKey
    count: int
    total_us: float
    ref_count: int
    ref_total_us: float

    @property
    def added_us(self) -> float:
        """µs this op added over the reference (negative: it shrank)."""
        return self.total_us - self.ref_total_us

    @property
    def status(self) -> str:
        """ "appeared", "vanished", "grew" or "shrank"."""
        if self.ref_count == 0:
            return "appeared"
        if self.count == 0:
            return "vanished"
        return "grew" if self.added_us >= 0 else "shrank"

    def as_json(self) -> dict[str, Any]:
        """The change as the report's JSON holds it."""
        return {
            "name": self.key.name,
            "grid": list(self.key.grid) if self.key.grid is not None else None,
            "block": list(self.key.block) if self.key.block is not None else None,
            "status": self.status,
            "count": self.count,
            "ref_count": self.ref_count,
            "total_us": round(self.total_us, 3),
            "ref_total_us": round(self.ref_total_us, 3),
            "added_us": round(self.added_us, 3),
        }


@dataclass(frozen=True)
class RankDiff:
    """One rank's step against the same rank in the reference step."""

    rank: int
    kind: OpKind
    changes: list[KernelChange]
    """Every op of either step, by added µs (largest growth first)."""
    idle_change_ms: float | None

    def as_json(self, top: int = TOP_CHANGES) -> dict[str, Any]:
        """The rank's diff as JSON: the `top` grown and vanished ops, the rest summed."""
        grown = [c for c in self.changes if c.added_us > 0]
        vanished = sorted(
            (c for c in self.changes if c.status == "vanished"), key=lambda c: c.added_us
        )
        return {
            "kind": self.kind,
            "idle_change_ms": (
                None if self.idle_change_ms is None else round(self.idle_change_ms, 4)
            ),
            "added_us": round(math.fsum(c.added_us for c in self.changes), 3),
            "changes": [c.as_json() for c in grown[:top]],
            "other_added_us": round(math.fsum(c.added_us for c in grown[top:]), 3),
            "vanished": [c.as_json() for c in vanished[:top]],
        }


def diff_ops(
    rank: int,
    kind: OpKind,
    current: Mapping[OpKey, OpStats],
    reference: Mapping[OpKey, OpStats],
    idle_change_ms: float | None = None,
) -> RankDiff:
    """Every op of the step against the reference, by added µs (ties by name)."""
    empty = OpStats(0, 0.0)
    changes = [
        KernelChange(
            key,
            current.get(key, empty).count,
            current.get(key, empty).total_us,
            reference.get(key, empty).count,
            reference.get(key, empty).total_us,
        )
        for key in set(current) | set(reference)
    ]
    changes.sort(key=lambda c: (-c.added_us, c.key))
    return RankDiff(rank, kind, changes, idle_change_ms)


def pick_reference(step: int, references: Iterable[int]) -> int | None:
    """The reference step for `step`: the latest at or before it, else the nearest after."""
    candidates = sorted(set(references) - {step})
    before = [s for s in candidates if s <= step]
    if before:
        return before[-1]
    return candidates[0] if candidates else None


def top_changes(kernel_diff: Mapping[str, Any], rank: int | None) -> tuple[str | None, list[Any]]:
    """The rank whose changes to show (the culprit, else the one that added most) and
    its changes, from a capture's `kernel_diff` JSON."""
    ranks: Mapping[str, Any] = kernel_diff.get("ranks") or {}
    if not ranks:
        return None, []
    key = str(rank) if rank is not None and str(rank) in ranks else None
    if key is None:
        key = max(ranks, key=lambda r: (float(ranks[r].get("added_us") or 0), -int(r)))
    return key, list(ranks[key].get("changes") or [])


def kernel_diff_lines(
    kernel_diff: Mapping[str, Any] | None, culprit: int | None, top: int = 5
) -> list[str]:
    """Text lines: the top changes of the culprit's (or the most grown) rank."""
    if not kernel_diff:
        return []
    if kernel_diff.get("reference_step") is None:
        note = kernel_diff.get("note")
        return [f"  kernel diff: {note}"] if note else []
    rank, changes = top_changes(kernel_diff, culprit)
    if rank is None:
        return []
    entry = kernel_diff["ranks"][rank]
    what = "kernels" if entry.get("kind") == "gpu" else "CPU ops"
    idle = entry.get("idle_change_ms")
    lines = [
        f"  {what} vs reference step {kernel_diff['reference_step']}, rank {rank}"
        + (f" (idle {idle:+.1f} ms)" if isinstance(idle, (int, float)) else "")
        + ":"
    ]
    if not changes:
        return [*lines, "    nothing grew"]
    rows = []
    for change in changes[:top]:
        key = OpKey(
            change["name"],
            tuple(change["grid"]) if change.get("grid") else None,
            tuple(change["block"]) if change.get("block") else None,
        )
        rows.append(
            f"    {change['added_us']:+12.1f} µs  {change['status']:<8}  "
            f"{change['ref_count']}->{change['count']}  {short(key.label(), 90)}"
        )
    return lines + rows
