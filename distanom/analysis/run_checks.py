"""Shape checks of run.json and status.json before the report uses them.

Both files are read from a directory others may write (docs/trust.md): a field of the
wrong type (a list where a number belongs, a 400-digit integer, a nested object where a
name belongs) would crash whatever formats it. `checked` keeps each field whose value
has the shape distanom writes and drops the others with a problem line naming the file
and the field. Reads nothing itself; used by `distanom.analysis.run`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_ITEMS = 100_000  # list/object entries kept per field
Check = Callable[[Any], bool]


def _num(value: Any) -> bool:
    """A finite number a float holds (bool excluded), or None."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return -1e18 < value < 1e18 and not (isinstance(value, float) and math.isnan(value))


def _int(value: Any) -> bool:
    return value is None or (isinstance(value, int) and _num(value))


def _str(value: Any) -> bool:
    return value is None or (isinstance(value, str) and len(value) <= 1_000_000)


def _scalar(value: Any) -> bool:
    return _str(value) or _num(value) or isinstance(value, bool)


def _list_of(check: Check) -> Check:
    return lambda v: isinstance(v, list) and len(v) <= MAX_ITEMS and all(map(check, v))


def _dict_of(check: Check) -> Check:
    return lambda v: (
        isinstance(v, dict) and len(v) <= MAX_ITEMS and all(check(x) for x in v.values())
    )


def _scalars(value: Any) -> bool:
    return _dict_of(_scalar)(value)


def _tracer(value: Any) -> bool:
    return _dict_of(lambda v: _scalar(v) or _scalars(v))(value)


def _config(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, dict) for v in value.values())


STATUS_FIELDS: dict[str, Check] = {
    "state": _str,
    "run_id": _str,
    "world_size": _int,
    "step": _int,
    "gathered_step": _int,
    "median_ms": _num,
    "threshold_ms": _num,
    "recent_ms": _dict_of(_list_of(_num)),
    "slowest_ranks": _list_of(_int),
    "detector": _dict_of(_num),
    "episodes": _list_of(_scalars),
    "captures": _scalars,
    "tracer": _tracer,
    "capture_off": _str,
    "consensus_error": _str,
    "status_interval_s": _num,
    "updated_at": _num,
    "pid": _int,
}
"""status.json's fields and the shape each must have."""

RUN_FIELDS: dict[str, Check] = {
    "run_id": _str,
    "distanom": _str,
    "torch": _str,
    "cuda": _str,
    "python": _str,
    "world_size": _int,
    "started_at": _num,
    "argv": _list_of(_str),
    "config": _config,
    "hosts": _list_of(_str),
    "nodes": _dict_of(_list_of(_int)),
    "node_ranks": _list_of(_int),
}
"""run.json's fields and the shape each must have."""


def checked(
    body: dict[str, Any], fields: dict[str, Check], path: Path, problems: list[str]
) -> dict[str, Any]:
    """`body` without the known fields whose shape is wrong (a problem line for each)."""
    kept: dict[str, Any] = {}
    for key, value in body.items():
        check = fields.get(key)
        if check is not None and not check(value):
            problems.append(f"{path}: field {key!r} has the wrong type or range; ignored")
            continue
        kept[key] = value
    return kept
