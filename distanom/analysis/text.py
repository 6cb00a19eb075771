"""Wording shared by every rendering of the report: numbers, ms phrases, rank lists, tables.

Pure string helpers with no knowledge of the report's structure; the verdict's
sentences, the text report, `distanom analyze` and the HTML page all phrase numbers
through them so the same value reads the same everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "change",
    "comparisons_words",
    "fmt",
    "ms",
    "rank_list",
    "ranks_word",
    "short",
    "signed",
    "span",
    "table",
    "unmeasured_words",
]

# a measured tracing overhead from fewer traced/untraced comparisons is called rough
ROUGH_BELOW_COMPARISONS = 3


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell: "-" for None, a float with `digits` decimals, anything else as str."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns two spaces apart, header first, trailing blanks stripped."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=False)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(header, widths, strict=True))]
    lines += [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    return [line.rstrip() for line in lines]


def short(text: str, width: int) -> str:
    """`text` cut to `width` characters, ending in "..." when cut."""
    return text if len(text) <= width else text[: width - 3] + "..."


def rank_list(ranks: Iterable[int]) -> str:
    """Ranks as "0-2,4,6-7"."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = prev = None
    for rank in [*ordered, None]:
        if rank is not None and prev is not None and rank == prev + 1:
            prev = rank
            continue
        if start is not None and prev is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = rank
    return ",".join(parts)


def culprit_words(rank: int | None, cause: str) -> str:
    """A verdict's who and why for people: "rank 2 — host stall", "no single rank — ..."."""
    who = "no single rank" if rank is None else f"rank {rank}"
    return f"{who} — {cause.replace('_', ' ')}"


def ranks_word(ranks: Iterable[int]) -> str:
    """ "rank 3" for one rank, "ranks 0-2,5" for several."""
    ordered = sorted(ranks)
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {rank_list(ordered)}"


def ms(value: float) -> str:
    """A duration in ms: one decimal from 10 ms up, two below."""
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def span(values: Sequence[float]) -> str:
    """The range of `values` in ms ("1.20-3.40 ms", "-2.00 to 1.00 ms", or one value)."""
    low, high = min(values), max(values)
    if abs(high - low) < 0.05:
        return f"{ms(low)} ms"
    return f"{ms(low)} to {ms(high)} ms" if low < 0 else f"{ms(low)}-{ms(high)} ms"


def signed(value: float) -> str:
    """A duration with its sign ("+1.20", "-0.50", "0.00")."""
    return ("+" if value > 0 else "") + ms(value)


def change(values: Sequence[float], where: str) -> str:
    """How values changed over `where`: "grew ... by 1.2-3.4 ms" when none shrank, else
    signed ("changed ... by -2.54 to +1.43 ms"), so a negative growth never reads as one."""
    if min(values) > -0.005:  # a sum's rounding noise around 0 is not a shrink
        return f"grew over {where} by {span([max(v, 0.0) for v in values])}"
    low, high = min(values), max(values)
    amount = f"{signed(low)}" if abs(high - low) < 0.05 else f"{signed(low)} to {signed(high)}"
    return f"changed over {where} by {amount} ms"


def comparisons_words(count: Any) -> str:
    """How many traced/untraced comparisons a measured overhead rests on ("" unknown)."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return ""
    if count < ROUGH_BELOW_COMPARISONS:
        return (
            f" (from {count} comparison{'s' if count > 1 else ''} with an untraced window: rough)"
        )
    return f" (from {count} comparisons with untraced windows)"


def unmeasured_words(duty: dict[str, Any]) -> str:
    """Why a run has no measured tracing overhead: too short, with its window counts."""
    traced, untraced = duty.get("complete_traced_windows"), duty.get("complete_untraced_windows")
    if not (isinstance(traced, int) and isinstance(untraced, int)):  # a status before them
        return "overhead not measured (no traced window compared with an untraced one)"
    size = duty.get("window_steps")
    steps = f" of {size} steps" if isinstance(size, int) else ""
    return (
        f"run too short to measure tracing overhead: {traced} whole traced and {untraced} "
        f"untraced windows{steps} so far, needs an untraced window after a whole traced one"
    )
