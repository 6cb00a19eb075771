"""Text that is safe to print on a terminal and to open in a spreadsheet, and values a
strict JSON writer takes.

Kernel names, notes, host names and paths come from files anyone who can write the run
directory (or produce a trace) controls. `terminal_safe` makes every control character
(C0 but newline and tab, DEL, C1) and every bidirectional override visible as a `\\x..` /
`\\u....` escape, so no escape sequence reaches the terminal; `spreadsheet_safe` prefixes
a text cell a spreadsheet would evaluate as a formula with a quote (docs/trust.md);
`json_finite` turns a record read back (status.json) into values `allow_nan=False` takes.
Reads nothing, writes nothing.
"""

from __future__ import annotations

import math
from typing import Any

_BIDI = (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)
_UNSAFE = [c for c in (*range(0x20), 0x7F, *range(0x80, 0xA0), *_BIDI) if c not in (0x0A, 0x09)]
_TERMINAL = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _UNSAFE}
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""First characters that make a spreadsheet cell a formula (or hide one)."""


def terminal_safe(text: str) -> str:
    """`text` with control characters and bidi overrides shown as escapes (newlines and
    tabs kept)."""
    return text.translate(_TERMINAL)


def spreadsheet_safe(cell: str) -> str:
    """A CSV text cell with a leading `'` when a spreadsheet would evaluate it."""
    return "'" + cell if cell.startswith(FORMULA_STARTS) else cell


def spreadsheet_text(cell: str) -> str:
    """The text a `spreadsheet_safe` cell stands for (the quote it added taken off)."""
    if cell.startswith("'") and cell[1:].startswith(FORMULA_STARTS):
        return cell[1:]
    return cell


MAX_JSON_DEPTH = 32  # deeper containers in a record read back are cut (none is this deep)


def json_finite(value: Any, depth: int = 0) -> Any:
    """`value` with every float that is not finite as None and containers deeper than
    MAX_JSON_DEPTH as None, so a strict JSON writer never refuses it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (dict, list)) and depth >= MAX_JSON_DEPTH:
        return None
    if isinstance(value, dict):
        return {key: json_finite(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list):
        return [json_finite(item, depth + 1) for item in value]
    return value
