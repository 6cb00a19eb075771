"""Collective operations in per-rank traces, and their matching across ranks.

Owns: picking the collectives out of one rank's trace events and pairing the k-th
collective of a group on one rank with the k-th of the same group on every other rank
(the matching NCCL's own semantics guarantee: within one process group, and within one
communication stream, every rank issues the same collectives in the same order).

- GPU traces: `kernel` events whose name holds nccl / rccl / cross_device_reduce (the
  same rule that makes them communication in the timeline). Group: the kernel's
  `Process Group Name` arg when PyTorch recorded it, else its stream; when the ranks'
  NCCL stream ids differ, the i-th NCCL stream of each rank (by first use) is matched.
- CPU-only traces: the gloo worker's spans (`gloo:<op>`: they start when the rank
  joins the collective and end when it leaves); without them the `c10d::<op>` calls.
  Group: the span's name.

Reads: parsed trace events (dicts). Hands on: `MatchedCollective`s, times in each
rank's own trace clock (µs), to `distanom.analysis.verdict` (arrival order) and
`distanom.analysis.merge` (clock offsets). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from distanom.analysis.tables import _GPU_COMM  # one rule for "is this kernel communication"
from distanom.analysis.trace_io import is_finite_number

__all__ = [
    "CollectiveCall",
    "MatchResult",
    "MatchedCollective",
    "collective_calls",
    "match_collectives",
]

CallKind = Literal["gpu", "cpu"]

_HOST_CATEGORIES = frozenset(("user_annotation", "cpu_op"))
_GLOO_PREFIX = "gloo:"
_C10D_PREFIX = "c10d::"


@dataclass(frozen=True)
class CollectiveCall:
    """One collective on one rank, in that rank's trace clock (µs)."""

    group: str
    """What it is matched within: "pg:<name>", "stream:<id>" or the CPU span's name."""
    name: str
    ts: float
    dur: float

    @property
    def end(self) -> float:
        """The call's end on the rank's clock (µs)."""
        return self.ts + self.dur


@dataclass(frozen=True)
class MatchedCollective:
    """The `index`-th collective of `group`, on every rank that issued it."""

    group: str
    index: int
    name: str
    start_us: Mapping[int, float]
    end_us: Mapping[int, float]

    @property
    def ranks(self) -> list[int]:
        """The ranks that took part, in order."""
        return sorted(self.start_us)

    def label(self) -> str:
        """The collective's name and ordinal, for evidence."""
        return f"{self.name} #{self.index + 1}"


@dataclass(frozen=True)
class MatchResult:
    """Collectives matched across ranks, and how many calls stayed unmatched."""

    matched: list[MatchedCollective]
    unmatched: list[str] = field(default_factory=list)
    """One note per group that could not be matched (counts differ between ranks)."""


def collective_calls(events: Iterable[Mapping[str, Any]]) -> tuple[CallKind, list[CollectiveCall]]:
    """The rank's collectives in start order, and whether they are GPU kernels or CPU spans.

    A trace with any NCCL-like kernel gives "gpu" calls; otherwise the gloo spans, or
    failing those the c10d calls, give "cpu" calls. Events without a finite ts/dur are
    skipped.
    """
    kernels: list[CollectiveCall] = []
    gloo: list[CollectiveCall] = []
    c10d: list[CollectiveCall] = []
    for event in events:
        ts, dur, name = event.get("ts"), event.get("dur"), event.get("name")
        if not (is_finite_number(ts) and is_finite_number(dur) and isinstance(name, str)):
            continue
        cat = event.get("cat")
        if cat == "kernel":
            if _GPU_COMM.search(name):
                args = event.get("args")
                args = args if isinstance(args, dict) else {}
                pg = args.get("Process Group Name")
                group = f"pg:{pg}" if pg is not None else f"stream:{args.get('stream')}"
                kernels.append(CollectiveCall(group, name, float(ts), float(dur)))
        elif cat in _HOST_CATEGORIES and event.get("ph") == "X":
            if name.startswith(_GLOO_PREFIX):
                gloo.append(CollectiveCall(name, name, float(ts), float(dur)))
            elif name.startswith(_C10D_PREFIX):
                c10d.append(CollectiveCall(name, name, float(ts), float(dur)))
    if kernels:
        return "gpu", sorted(kernels, key=lambda c: c.ts)
    return "cpu", sorted(gloo or c10d, key=lambda c: c.ts)


def _stream_ordinals(calls: Sequence[CollectiveCall]) -> list[CollectiveCall]:
    """Stream groups renamed "stream#<i>": the i-th stream the rank used for NCCL."""
    order: dict[str, int] = {}
    out = []
    for call in calls:  # in start order
        if call.group.startswith("stream:"):
            index = order.setdefault(call.group, len(order))
            call = CollectiveCall(f"stream#{index}", call.name, call.ts, call.dur)
        out.append(call)
    return out


def match_collectives(per_rank: Mapping[int, Sequence[CollectiveCall]]) -> MatchResult:
    """Pair collectives across ranks by (group, order within the group).

    A group is matched over the ranks that issued it (at least two) when they all
    issued it the same number of times; otherwise it is left out with a note, since
    pairing by order would then pair different operations.
    """
    stream_sets = {
        frozenset(c.group for c in calls if c.group.startswith("stream:"))
        for calls in per_rank.values()
    }
    if len(stream_sets) > 1:  # stream ids differ between ranks: match by order of first use
        per_rank = {rank: _stream_ordinals(calls) for rank, calls in per_rank.items()}
    grouped: dict[str, dict[int, list[CollectiveCall]]] = {}
    for rank, calls in per_rank.items():
        for call in calls:
            grouped.setdefault(call.group, {}).setdefault(rank, []).append(call)
    matched: list[MatchedCollective] = []
    unmatched: list[str] = []
    for group in sorted(grouped):
        by_rank = grouped[group]
        if len(by_rank) < 2:
            continue
        counts = {rank: len(calls) for rank, calls in by_rank.items()}
        if len(set(counts.values())) != 1:
            detail = ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items()))
            unmatched.append(f"{group}: different counts ({detail})")
            continue
        for index in range(next(iter(counts.values()))):
            first = by_rank[min(by_rank)][index]
            matched.append(
                MatchedCollective(
                    group=group,
                    index=index,
                    name=first.name,
                    start_us={rank: calls[index].ts for rank, calls in by_rank.items()},
                    end_us={rank: calls[index].end for rank, calls in by_rank.items()},
                )
            )
    return MatchResult(matched, unmatched)
