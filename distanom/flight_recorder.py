"""PyTorch's Flight Recorder: switching it on before the job starts, and reading it back.

Flight Recorder is a ring buffer inside torch's process groups (NCCL, and gloo in torch
2.13) that records every collective: its sequence id, op, state and host enqueue time
(`time_created_ns`, on the `time.time_ns()` clock). Recording costs nothing measurable
per collective (docs/evidence.md); reading costs about 10 us per buffered entry, so
readers keep the buffer small and read it rarely.

- `enable_from_env` runs in `distanom.launch` before the script (and so before any
  process group exists): it sets `TORCH_FR_BUFFER_SIZE` unless the user set it or
  `TORCH_NCCL_TRACE_BUFFER_SIZE` already, and says which in the log. Never overrides.
- `read_dump` is the one reader: the buffer as `FrEntry` values, bounded and tolerant
  of versions that lack a field (missing numbers read as -1 / 0), and when there are
  none, why. `read_entries` is its quiet form, for the evidence tier's per-round read.
- `StepCollectives` is the per-step O(1) summary the evidence tier carries.
- `read_groups` / `group_summaries` are the hang record's view (docs/hangs.md): per
  process group of the script, the last enqueued and completed sequence ids, the
  collectives in flight and the latest few. The dump needs no process group, so it
  works while the script's group is stuck. distanom's own consensus group is left out:
  it is built directly, not registered with torch.distributed, so its entries carry an
  empty group name (every registered group, the default one included, has a name).

Imports torch only inside `read_dump` (agent side; the report never calls it).
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from distanom.records.hangs import Collective, GroupCollectives

log = logging.getLogger(__name__)

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
NCCL_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
OFF_ENV = "DISTANOM_FLIGHT_RECORDER"  # "0": distanom leaves Flight Recorder off
# Entries distanom asks for: a read walks the whole buffer (about 10 us an entry), and
# the reader re-reads before half of it has been overwritten, so this bounds a read.
DEFAULT_BUFFER = 256
# what enable_from_env did, for the start line ("" before it ran)
_START_NOTE = ""
# The most entries one read converts, whatever size the user chose for the buffer.
MAX_ENTRIES = 4096
# A dump larger than this is not parsed (a buffer of a few thousand entries is ~1 MB).
MAX_DUMP_BYTES = 64 << 20
# The recorders read, as (source, dump function of torch._C._distributed_c10d).
DUMPS = (("generic", "_dump_fr_trace"), ("nccl", "_dump_nccl_trace"))
# Input sizes kept per entry: enough to tell collectives apart, bounded whatever the op.
MAX_SIZES = 4


@dataclass(frozen=True)
class FrEntry:
    """One Flight Recorder entry, as far as this torch version records it."""

    record_id: int
    pg_name: str
    seq_id: int  # collective_seq_id (p2p_seq_id for point-to-point ops)
    op: str  # profiling_name, e.g. "gloo:all_reduce"
    state: str  # "scheduled", "started", "completed"
    time_created_ns: int
    time_started_ns: int  # 0 where not discovered (gloo)
    time_completed_ns: int  # 0 where not discovered
    thread_id: str
    is_p2p: bool = False
    retired: bool = False  # the process group is done with it (it completed or failed)
    pg_desc: str = ""  # the group's description, e.g. "default_pg"
    input_sizes: tuple[Any, ...] = ()  # the first MAX_SIZES input shapes (read on request)
    source: str = ""  # which recorder: "nccl" or "generic" (each numbers its records)

    @property
    def completed(self) -> bool:
        """Whether the collective is over on this rank."""
        return self.retired or self.state == "completed"


@dataclass(frozen=True)
class FrDump:
    """One read of the buffer: its entries and, when there are none, why."""

    entries: tuple[FrEntry, ...]
    note: str | None = None


def enable_from_env(environ: MutableMapping[str, str] | None = None) -> str:
    """Switch Flight Recorder on for the script unless the user decided; returns the
    log line saying what was done (also logged)."""
    env = os.environ if environ is None else environ
    if env.get(OFF_ENV, "").strip() in ("0", "off", "false"):
        note = f"flight recorder: left off ({OFF_ENV}={env[OFF_ENV]})"
    elif BUFFER_ENV in env or NCCL_BUFFER_ENV in env:
        name = BUFFER_ENV if BUFFER_ENV in env else NCCL_BUFFER_ENV
        note = f"flight recorder: the user's {name}={env[name]} is kept"
    else:
        env[BUFFER_ENV] = str(DEFAULT_BUFFER)
        note = f"flight recorder: on ({BUFFER_ENV}={DEFAULT_BUFFER}) for collective arrival"
    global _START_NOTE
    _START_NOTE = note  # said once, in the rank's start line
    log.debug(note)
    return note


def start_note() -> str:
    """What `enable_from_env` did, for the rank's start line ("" before it ran)."""
    return _START_NOTE


def buffer_size(environ: Mapping[str, str] | None = None) -> int:
    """The Flight Recorder buffer size in force (0: off)."""
    env = os.environ if environ is None else environ
    for name in (BUFFER_ENV, NCCL_BUFFER_ENV):
        text = env.get(name, "").strip()
        if text:
            try:
                return max(0, int(text))
            except ValueError:
                return 0
    return 0


def read_entries(
    limit: int = MAX_ENTRIES, after: Mapping[str, int] | None = None
) -> tuple[FrEntry, ...]:
    """This process's Flight Recorder entries, oldest first, at most `limit` of the newest
    of each recorder (() where torch has none or the read fails); with `after` (the last
    record id seen, per recorder) only the newer ones are converted."""
    return read_dump(limit, after=after).entries


def read_dump(
    limit: int = MAX_ENTRIES, *, sizes: bool = False, after: Mapping[str, int] | None = None
) -> FrDump:
    """This process's Flight Recorder entries (as `read_entries`; input sizes only with
    `sizes`) and, when there are none, why (not in this torch, the dump failed or was
    too large, recording is off).

    NCCL groups keep their own recorder (`_dump_nccl_trace`), gloo ones the generic one
    (`_dump_fr_trace`): both are read, each entry tagged with its `source`, since each
    numbers its records on its own."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return FrDump((), "torch has no distributed support")
    entries: list[FrEntry] = []
    problems: list[str] = []
    for source, name in DUMPS:
        dump = getattr(c10d, name, None)  # private, absent on some builds and versions
        if dump is None:
            continue
        got, problem = _read_one(dump, source, limit, sizes, (after or {}).get(source, -1))
        entries += got
        if problem:
            problems.append(problem)
    if entries:
        # `limit` per recorder, not overall: a cut across both would drop one recorder's
        # older entries and read as an overwrite
        entries.sort(key=lambda e: (e.time_created_ns, e.source, e.record_id))
        return FrDump(tuple(entries))
    if problems:
        return FrDump((), problems[0])
    if not any(hasattr(c10d, name) for _, name in DUMPS):
        return FrDump((), "this torch has no Flight Recorder dump")
    return FrDump(
        (), "Flight Recorder is off or empty (set TORCH_FR_BUFFER_SIZE before the job starts)"
    )


def _read_one(
    dump: Any, source: str, limit: int, sizes: bool, after: int = -1
) -> tuple[list[FrEntry], str]:
    """One recorder's entries, tagged with `source`, and what went wrong ("" if nothing)."""
    try:
        raw = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    except TypeError:  # an older signature
        try:
            raw = dump()
        except Exception as err:
            return [], _failed(err)
    except Exception as err:  # the C++ side raises RuntimeError subclasses
        return [], _failed(err)
    if isinstance(raw, (bytes, bytearray)) and len(raw) > MAX_DUMP_BYTES:
        return [], f"Flight Recorder dump of {len(raw)} bytes not read (over {MAX_DUMP_BYTES})"
    return list(parse_dump(raw, limit, sizes=sizes, source=source, after=after)), ""


def _failed(err: BaseException) -> str:
    return f"Flight Recorder dump failed: {err}".splitlines()[0]


def parse_dump(
    raw: bytes | Mapping[str, Any],
    limit: int = MAX_ENTRIES,
    *,
    sizes: bool = False,
    source: str = "",
    after: int = -1,
) -> tuple[FrEntry, ...]:
    """Entries of one dump (pickled bytes or the unpickled dict), tagged with `source`;
    () where unreadable. Input sizes are read only with `sizes` (they cost about as much
    as the rest of an entry, and the per-round read has no use for them). Entries whose
    record id is at most `after` (seen at an earlier read) are not converted: the dump
    repeats the whole buffer, and the per-round read holds the GIL while it converts."""
    try:
        data = pickle.loads(raw) if isinstance(raw, (bytes, bytearray)) else raw
    except Exception:
        return ()
    entries = data.get("entries") if isinstance(data, Mapping) else None
    if not isinstance(entries, list):
        return ()
    chosen = entries[-limit:]
    if after >= 0:
        chosen = [item for item in chosen if _record_id(item) > after]
    out = [e for e in (_entry(item, sizes, source) for item in chosen) if e is not None]
    return tuple(out)


def _record_id(item: Any) -> int:
    """An entry's record id (-1 where it has none), read before the rest of it."""
    return _int(item.get("record_id", -1)) if isinstance(item, Mapping) else -1


def _shapes(sizes: Any) -> tuple[Any, ...]:
    if not isinstance(sizes, (list, tuple)):
        return ()
    return tuple(tuple(one) if isinstance(one, (list, tuple)) else one for one in sizes[:MAX_SIZES])


def _int(value: Any) -> int:
    try:
        return int(value) if value is not None else 0
    except (TypeError, ValueError):
        return 0


def _entry(item: Any, with_sizes: bool, source: str = "") -> FrEntry | None:
    if not isinstance(item, Mapping):
        return None
    get = item.get
    group = get("process_group")
    if isinstance(group, (list, tuple)) and group:
        pg_name = str(group[0])
        pg_desc = str(group[1]) if len(group) > 1 and group[1] else ""
    else:
        pg_name, pg_desc = str(group or ""), ""
    p2p = bool(get("is_p2p", False))
    sizes = get("input_sizes") if with_sizes else None
    # positional, in field order: this runs for every buffered entry at every read
    return FrEntry(
        _int(get("record_id", -1)),
        pg_name,
        _int(get("p2p_seq_id") if p2p else get("collective_seq_id")),
        str(get("profiling_name", "")),
        str(get("state", "")),
        _int(get("time_created_ns")),
        _int(get("time_discovered_started_ns")),
        _int(get("time_discovered_completed_ns")),
        str(get("thread_id", "")),
        p2p,
        bool(get("retired")),
        pg_desc,
        _shapes(sizes) if sizes else (),
        source,
    )


@dataclass
class StepCollectives:
    """The per-step summary of a rank's collectives: how many, and when the last began."""

    count: int = 0
    last_created_ns: int = 0
    last_seq: int = -1

    def add(self, entry: FrEntry) -> None:
        """Fold one collective enqueued during the step into the summary."""
        self.count += 1
        if entry.time_created_ns >= self.last_created_ns:
            self.last_created_ns, self.last_seq = entry.time_created_ns, entry.seq_id


def read_groups(max_per_group: int) -> tuple[list[GroupCollectives] | None, str | None]:
    """The hang record's Flight Recorder view per process group of the script and, when
    there is none, why."""
    dump = read_dump(MAX_ENTRIES, sizes=True)
    if not dump.entries:
        return None, dump.note
    groups = group_summaries(dump.entries, max_per_group)
    if not groups:
        return None, "Flight Recorder recorded no collective of the script's groups"
    return groups, None


def group_summaries(entries: Iterable[FrEntry], max_per_group: int) -> list[GroupCollectives]:
    """Per named process group: last enqueued / completed sequence ids, the collectives
    in flight and the latest `max_per_group` entries (p2p entries skipped: they have
    their own sequence)."""
    by_group: dict[str, list[Collective]] = {}
    for entry in entries:
        group = None if entry.is_p2p else _group_name(entry.pg_name, entry.pg_desc)
        if group is None:
            continue
        sizes = [list(one) if isinstance(one, tuple) else one for one in entry.input_sizes]
        by_group.setdefault(group, []).append(
            Collective(
                seq=entry.seq_id,
                op=entry.op or "?",
                state=entry.state or "?",
                completed=entry.completed,
                created_ns=entry.time_created_ns,
                sizes=sizes,
            )
        )
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


def _group_name(name: str, desc: str) -> str | None:
    """A group's readable name; None for an unnamed group (distanom's own)."""
    if not name:
        return None
    if desc == "default_pg":
        return desc
    # names are unique and the same on every rank; descriptions need not be unique
    return f"group {name}" + (f" ({desc})" if desc and desc != "undefined" else "")
