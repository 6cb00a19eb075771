"""The hang record's view of PyTorch's Flight Recorder: a bounded per-group summary.

Flight Recorder keeps the last `TORCH_FR_BUFFER_SIZE` (or `TORCH_NCCL_TRACE_BUFFER_SIZE`)
collectives of every process group of this process, with their sequence ids; it is
switched on by that variable being set before the first process group exists (NCCL and,
in torch 2.13, gloo). `dump_flight_recorder` reads it through
`torch._C._distributed_c10d._dump_fr_trace_json` (no process group needed, so it works
while the script's group is stuck) and `summarize_fr` keeps per group the in-flight
collectives and the latest few. Called by the hang watch's thread only, never per step.
distanom's own consensus group is left out: it is built directly, not registered with
torch.distributed, so its entries carry an empty group name (every registered group,
the default one included, has a name).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from distanom.records.hangs import Collective, GroupCollectives

__all__ = ["dump_flight_recorder", "summarize_fr"]

log = logging.getLogger(__name__)

# A dump larger than this is not parsed (a buffer of a few thousand entries is ~1 MB).
MAX_DUMP_BYTES = 64 << 20


def dump_flight_recorder(max_per_group: int) -> tuple[list[GroupCollectives] | None, str | None]:
    """This process's Flight Recorder summary per process group and, when there is
    none, why (not enabled, not in this torch, failed)."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None, "torch has no distributed support"
    dump = getattr(c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return None, "this torch has no Flight Recorder JSON dump"
    try:
        raw = dump(includeCollectives=True, onlyActive=False)
    except Exception as err:  # the C++ side raises RuntimeError subclasses
        return None, f"Flight Recorder dump failed: {err}".splitlines()[0]
    if not raw:
        return None, "Flight Recorder is off (set TORCH_FR_BUFFER_SIZE before the job starts)"
    if len(raw) > MAX_DUMP_BYTES:
        return None, f"Flight Recorder dump of {len(raw)} bytes not read (over {MAX_DUMP_BYTES})"
    try:
        doc = json.loads(raw)
    except ValueError as err:
        return None, f"Flight Recorder dump is not JSON ({err})"
    groups = summarize_fr(doc, max_per_group)
    if not groups:
        return None, "Flight Recorder is off or recorded no collective of the script's groups"
    return groups, None


def summarize_fr(doc: Any, max_per_group: int) -> list[GroupCollectives]:
    """Per process group of the script: last enqueued / completed sequence ids, the
    collectives in flight and the latest `max_per_group` entries (p2p entries skipped:
    they have their own sequence)."""
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        return []
    by_group: dict[str, list[Collective]] = {}
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("is_p2p"):
            continue
        group = _group_name(entry.get("process_group"))
        if group is None:
            continue
        try:
            collective = Collective(
                seq=int(entry.get("collective_seq_id", -1)),
                op=str(entry.get("profiling_name", "?")),
                state=str(entry.get("state", "?")),
                completed=bool(entry.get("retired")) or entry.get("state") == "completed",
                created_ns=int(entry.get("time_created_ns", 0)),
                sizes=list(entry.get("input_sizes") or [])[:4],
            )
        except (TypeError, ValueError):
            continue
        by_group.setdefault(group, []).append(collective)
    out = []
    for group, collectives in sorted(by_group.items()):
        collectives.sort(key=lambda c: c.seq)
        done = [c.seq for c in collectives if c.completed]
        out.append(
            GroupCollectives(
                group=group,
                last_enqueued=collectives[-1].seq,
                last_completed=max(done) if done else -1,
                in_flight=[c for c in collectives if not c.completed][-max_per_group:],
                recent=collectives[-max_per_group:],
            )
        )
    return out


def _group_name(value: Any) -> str | None:
    """A group's readable name from an entry's (name, description) pair; None for an
    unnamed group (distanom's own)."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    name = str(value[0])
    if not name:
        return None
    desc = str(value[1]) if len(value) > 1 and value[1] else ""
    if desc == "default_pg":
        return desc
    # names are unique and the same on every rank; descriptions need not be unique
    return f"group {name}" + (f" ({desc})" if desc and desc != "undefined" else "")
