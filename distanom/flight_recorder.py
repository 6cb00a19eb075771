"""PyTorch's Flight Recorder: switching it on before the job starts, and reading it back.

Flight Recorder is a ring buffer inside torch's process groups (NCCL, and gloo in torch
2.13) that records every collective: its sequence id, op, state and host enqueue time
(`time_created_ns`, on the `time.time_ns()` clock). Recording costs nothing measurable
per collective (docs/evidence.md); reading costs about 10 us per buffered entry, so
readers keep the buffer small and read it rarely.

- `enable_from_env` runs in `distanom.launch` before the script (and so before any
  process group exists): it sets `TORCH_FR_BUFFER_SIZE` unless the user set it or
  `TORCH_NCCL_TRACE_BUFFER_SIZE` already, and says which in the log. Never overrides.
- `read_entries` returns the buffer as `FrEntry` values, bounded and tolerant of
  versions that lack a field (missing numbers read as -1 / 0); it returns () where
  torch has no Flight Recorder. General on purpose: the hang diagnosis reads it too.
- `StepCollectives` is the per-step O(1) summary the evidence tier carries.

Imports torch only inside `read_entries` (agent side; the report never calls it).
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

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


def read_entries(limit: int = MAX_ENTRIES) -> tuple[FrEntry, ...]:
    """This process's Flight Recorder entries, oldest first, at most `limit` of the newest
    (() where torch has none or the read fails)."""
    try:
        from torch._C import _distributed_c10d as c10d

        dump = getattr(c10d, "_dump_fr_trace")  # noqa: B009 (private, absent on old torch)
    except (ImportError, AttributeError):
        return ()
    try:
        raw = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    except TypeError:  # an older signature
        try:
            raw = dump()
        except Exception:
            return ()
    except Exception:
        return ()
    return parse_dump(raw, limit)


def parse_dump(raw: bytes | Mapping[str, Any], limit: int = MAX_ENTRIES) -> tuple[FrEntry, ...]:
    """Entries of one dump (pickled bytes or the unpickled dict); () where unreadable."""
    try:
        data = pickle.loads(raw) if isinstance(raw, (bytes, bytearray)) else raw
    except Exception:
        return ()
    entries = data.get("entries") if isinstance(data, Mapping) else None
    if not isinstance(entries, list):
        return ()
    out = [e for e in (_entry(item) for item in entries[-limit:]) if e is not None]
    return tuple(out)


def _int(value: Any) -> int:
    try:
        return int(value) if value is not None else 0
    except (TypeError, ValueError):
        return 0


def _entry(item: Any) -> FrEntry | None:
    if not isinstance(item, Mapping):
        return None
    group = item.get("process_group")
    pg_name = str(group[0]) if isinstance(group, (list, tuple)) and group else str(group or "")
    p2p = bool(item.get("is_p2p", False))
    seq = item.get("p2p_seq_id") if p2p else item.get("collective_seq_id")
    return FrEntry(
        record_id=_int(item.get("record_id", -1)),
        pg_name=pg_name,
        seq_id=_int(seq),
        op=str(item.get("profiling_name", "")),
        state=str(item.get("state", "")),
        time_created_ns=_int(item.get("time_created_ns")),
        time_started_ns=_int(item.get("time_discovered_started_ns")),
        time_completed_ns=_int(item.get("time_discovered_completed_ns")),
        thread_id=str(item.get("thread_id", "")),
        is_p2p=p2p,
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
