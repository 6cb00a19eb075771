"""The wire format between a rank's process and its side process (`side_link` writes,
`side_main` reads): length-prefixed frames on a private socket, and the step records of a
round packed into one frame by columns. No torch.

A frame is a kind (one byte), the payload's length (4 bytes) and the payload:

- `OPEN`: the steps file's path (the run directory's, as bytes): the side process
  appends to it from now on;
- `STEPS`: the steps of a round (`pack_steps`): the records' fields one column each, the
  phase marks' (kind, time) pairs flattened with each step's offset (their CUDA events
  stay in the rank's process: the GPU parts were read there), the `None` of "no marks"
  kept apart from an empty list;
- `FLUSH`: hand what was written to the OS (readers see it);
- `END`: the rank is done: flush, close and exit (not waiting for the socket to end,
  which a forked child of the rank may keep open).

The socket is private to the rank and its child, so frames are trusted as to form; their
sizes are still bounded (`MAX_FRAME_BYTES`), so a damaged stream ends the reader
instead of growing it.
"""

from __future__ import annotations

import array
import itertools
import struct
from typing import Any

from distanom.step_record import StepRecord

OPEN, STEPS, FLUSH, END = 1, 2, 3, 4
READY = b"R"  # the side process's one byte back: imports done, frames are read from now on
FRAME_HEAD = struct.Struct("<BI")  # kind, payload bytes
STEPS_HEAD = struct.Struct("<II")  # steps, phase-mark array items (two per mark)
MAX_FRAME_BYTES = 64 << 20  # a round of 100k steps with 16 marks each fits in 64 MiB
_new_tuple = tuple.__new__
_FLOATS = 6  # duration, self_ms, gc_ms, three GPU parts
_INTS = 6  # flags, gc generation, phase start, phase end, fetch ns, marks known


def frame(kind: int, payload: bytes) -> bytes:
    """One frame, head and payload."""
    return FRAME_HEAD.pack(kind, len(payload)) + payload


def pack_steps(records: list[StepRecord]) -> bytes:
    """A round's records as one `STEPS` payload. By columns (`zip(*records)`, one array
    per field): the only loop per step is over its phase marks."""
    if not records:
        return STEPS_HEAD.pack(0, 0)
    steps, durations, flags, self_ms, gc_ms, gc_gen, phases = zip(*records, strict=True)
    step_marks, starts, ends, fetches, gpus = zip(*phases, strict=True)
    floats = array.array("d", durations)
    floats.extend(self_ms)
    floats.extend(gc_ms)
    floats.extend(itertools.chain.from_iterable(gpus))
    ints = array.array("q", flags)
    for column in (gc_gen, starts, ends, fetches):
        ints.extend(column)
    ints.extend([kept is not None for kept in step_marks])
    marks = array.array(
        "q", [x for kept in step_marks if kept for kind, ns, _event in kept for x in (kind, ns)]
    )
    # where each step's marks begin, in array items
    offsets = array.array(
        "Q", itertools.accumulate((2 * len(kept) if kept else 0 for kept in step_marks[:-1]),
                                  initial=0)
    )  # fmt: skip
    head = STEPS_HEAD.pack(len(steps), len(marks))
    columns = (array.array("q", steps), floats, ints, offsets, marks)
    return head + b"".join(column.tobytes() for column in columns)


def unpack_steps(payload: bytes) -> list[StepRecord]:
    """`pack_steps`' records again, their phase marks' events None. ValueError on a
    payload of the wrong size."""
    n, n_items = STEPS_HEAD.unpack_from(payload)
    sizes = (("q", n), ("d", n * _FLOATS), ("q", n * _INTS), ("Q", n), ("q", n_items))
    if STEPS_HEAD.size + sum(count * 8 for _code, count in sizes) != len(payload):
        raise ValueError(f"a steps frame of {len(payload)} bytes does not hold {n} steps")
    at = STEPS_HEAD.size
    columns = []
    for code, count in sizes:
        column = array.array(code)
        column.frombytes(payload[at : at + count * 8])
        columns.append(column)
        at += count * 8
    steps, floats, ints, offsets, marks = columns
    durations, self_ms, gc_ms = floats[:n], floats[n : 2 * n], floats[2 * n : 3 * n]
    gpus = floats[3 * n :]
    flags, gc_gen, starts, ends, fetches, known = (ints[k * n : (k + 1) * n] for k in range(_INTS))
    records = []
    for i in range(n):
        step_marks: list[tuple[int, int, Any]] | None = None
        if known[i]:
            end = offsets[i + 1] if i + 1 < n else len(marks)
            step_marks = [(marks[j], marks[j + 1], None) for j in range(offsets[i], end, 2)]
        phases = (step_marks, starts[i], ends[i], fetches[i], tuple(gpus[3 * i : 3 * i + 3]))
        fields = (steps[i], durations[i], flags[i], self_ms[i], gc_ms[i], gc_gen[i], phases)
        records.append(_new_tuple(StepRecord, fields))
    return records
