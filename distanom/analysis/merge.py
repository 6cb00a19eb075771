"""One Perfetto-loadable trace of a captured step with every rank in it.

Owns: the clock alignment of the ranks' traces and the merged chrome-trace document
(`captures/step_<N>/merged.trace.json.gz`). Each rank's processes get their own pids
(`(rank + 1) * PID_STRIDE + i`, so ranks never collide) and are named
"rank R (host) CPU" / "rank R (host) GPU 0"; flow ids are renumbered so one rank's
launch arrows never bind to another's.

Clocks. Every rank's `ts` is first put on rank `ref`'s time base through
`baseTimeNanoseconds` (coarse: Kineto rounds it to the second). The residual offset of
each host is then estimated from the ends of matched collectives, since all ranks leave
a collective at about the same time: offset = median over collectives of (reference
host's end - this host's end). Ranks of one host share one clock and get one offset, so
the alignment never adds the collectives' own end jitter (milliseconds on a busy CPU)
between them. A host with no collective matched to the reference host keeps offset 0,
and the metadata says so (`distanom.clock_alignment`).

Reads: parsed trace documents and matched collectives. Hands on: the merged document as
gzipped bytes (the caller writes it atomically) with the offsets in its metadata. Pure.
"""

from __future__ import annotations

import gzip
import io
import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distanom.analysis.collectives import MatchedCollective

__all__ = [
    "MERGED_NAME",
    "PID_STRIDE",
    "ClockAlignment",
    "MergeWriter",
    "estimate_offsets",
]

MERGED_NAME = "merged.trace.json.gz"
PID_STRIDE = 1000
"""pids per rank in the merged trace (a rank has one host pid and one per GPU)."""
_REPLACED_META = frozenset(("process_name", "process_sort_index"))


@dataclass(frozen=True)
class ClockAlignment:
    """How the ranks' clocks were put on the reference rank's clock."""

    offsets_us: dict[int, float]
    """Added to every `ts` of the rank: its time on the reference rank's clock."""
    reference_rank: int
    method: str
    """"shared host clock", "collective ends" or "none" (offsets 0, clocks trusted)."""
    per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """The alignment as the merged trace's metadata holds it."""
        return {
            "method": self.method,
            "reference_rank": self.reference_rank,
            "offsets_us": {str(r): round(v, 3) for r, v in sorted(self.offsets_us.items())},
            "ranks": {str(r): v for r, v in sorted(self.per_rank.items())},
            "notes": self.notes,
        }


def estimate_offsets(
    ranks: Sequence[int],
    hosts: Mapping[int, str | None],
    base_time_ns: Mapping[int, int | None],
    collectives: Sequence[MatchedCollective],
) -> ClockAlignment:
    """Per-rank offsets (µs) putting every rank on the lowest rank's clock."""
    ordered = sorted(ranks)
    ref = ordered[0]
    notes: list[str] = []
    if all(base_time_ns.get(r) is not None for r in ordered):
        ref_base = base_time_ns[ref] or 0
        shift = {r: ((base_time_ns[r] or 0) - ref_base) / 1000 for r in ordered}
    else:
        shift = {r: 0.0 for r in ordered}
        notes.append("baseTimeNanoseconds missing on some rank: trace clocks taken as they are")

    def group(rank: int) -> str:
        host = hosts.get(rank)
        return f"host {host}" if host is not None else f"rank {rank}"

    members: dict[str, list[int]] = {}
    for rank in ordered:
        members.setdefault(group(rank), []).append(rank)
    ref_group = group(ref)

    def end(coll: MatchedCollective, name: str) -> float | None:
        ends = [coll.end_us[r] + shift[r] for r in members[name] if r in coll.end_us]
        return float(statistics.median(ends)) if ends else None

    residual: dict[str, float | None] = {ref_group: 0.0}
    counts: dict[str, int] = {ref_group: 0}
    for name in members:
        if name == ref_group:
            continue
        deltas = []
        for coll in collectives:
            mine, theirs = end(coll, name), end(coll, ref_group)
            if mine is not None and theirs is not None:
                deltas.append(theirs - mine)
        residual[name] = float(statistics.median(deltas)) if deltas else None
        counts[name] = len(deltas)
        if not deltas:
            notes.append(
                f"{name}: no collective matched with rank {ref}'s {ref_group}; offset 0 "
                "(its clock trusted as it is)"
            )
    offsets: dict[int, float] = {}
    per_rank: dict[int, dict[str, Any]] = {}
    for rank in ordered:
        name = group(rank)
        extra = residual[name]
        offsets[rank] = shift[rank] + (extra or 0.0)
        if name == ref_group:
            how = "reference" if rank == ref else f"same host as rank {ref}"
        elif extra is None:
            how = "none: offset 0"
        else:
            how = f"collective ends ({counts[name]} matched)"
        per_rank[rank] = {
            "host": hosts.get(rank),
            "base_shift_us": round(shift[rank], 3),
            "residual_us": None if extra is None else round(extra, 3),
            "aligned_by": how,
        }
    others = [name for name in members if name != ref_group]
    if not others:
        method = "shared host clock"
    elif any(residual[name] is not None for name in others):
        method = "collective ends"
    else:
        method = "none"
    return ClockAlignment(offsets, ref, method, per_rank, notes)


class MergeWriter:
    """Streams ranks' events into one gzipped chrome trace (one rank in memory at a time)."""

    def __init__(self) -> None:
        self._buffer = io.BytesIO()
        self._gz = gzip.GzipFile(fileobj=self._buffer, mode="wb", compresslevel=6, mtime=0)
        self._gz.write(b'{"traceEvents": [\n')
        self._first = True
        self._flow_ids: dict[tuple[int, Any, Any], int] = {}
        self.ranks: dict[int, dict[str, Any]] = {}

    def _emit(self, event: Mapping[str, Any]) -> None:
        text = json.dumps(event, allow_nan=False, separators=(",", ":"), default=str)
        self._gz.write((b"" if self._first else b",\n") + text.encode())
        self._first = False

    def add_rank(
        self, rank: int, host: str | None, events: Iterable[Any], offset_us: float
    ) -> None:
        """Append one rank's events: pids remapped, processes named, flows renumbered."""
        events = [e for e in events if isinstance(e, dict)]
        pids: dict[Any, int] = {}
        labels: dict[Any, str] = {}
        names: dict[Any, str] = {}
        for event in events:
            pid = event.get("pid")
            if isinstance(pid, (dict, list)):
                continue
            pids.setdefault(pid, (rank + 1) * PID_STRIDE + min(len(pids), PID_STRIDE - 1))
            args = event.get("args") if isinstance(event.get("args"), dict) else {}
            if event.get("ph") == "M" and event.get("name") == "process_labels":
                labels[pid] = str(args.get("labels", ""))
            elif event.get("ph") == "M" and event.get("name") == "process_name":
                names[pid] = str(args.get("name", ""))
        where = f"rank {rank}" + (f" ({host})" if host else "")
        for pid, new_pid in pids.items():
            what = labels.get(pid) or names.get(pid) or str(pid)
            self._emit(_meta("process_name", new_pid, {"name": f"{where} {what}"}))
            self._emit(_meta("process_sort_index", new_pid, {"sort_index": new_pid}))
        for event in events:
            if event.get("ph") == "M" and event.get("name") in _REPLACED_META:
                continue  # replaced above
            out = dict(event)
            pid = event.get("pid")
            if not isinstance(pid, (dict, list)):
                out["pid"] = pids[pid]
            ts = event.get("ts")
            if isinstance(ts, (int, float)) and not isinstance(ts, bool):
                out["ts"] = ts + offset_us
            if "id" in event and not isinstance(event["id"], (dict, list)):
                key = (rank, event.get("cat"), event["id"])
                out["id"] = self._flow_ids.setdefault(key, len(self._flow_ids) + 1)
            self._emit(out)
        self.ranks[rank] = {
            "host": host,
            "pids": {str(old): new for old, new in pids.items()},
            "events": len(events),
        }

    def finish(self, metadata: Mapping[str, Any]) -> bytes:
        """Close the document with its top-level metadata; the gzipped bytes."""
        tail = json.dumps(dict(metadata), allow_nan=False, default=str)
        body = tail[1:-1].strip()
        self._gz.write(b"\n]" + ((", " + body).encode() if body else b"") + b"}\n")
        self._gz.close()
        return self._buffer.getvalue()


def _meta(name: str, pid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": 0, "args": args}
