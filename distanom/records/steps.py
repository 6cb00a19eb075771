"""steps/rank<R>.csv read back (the report, tools): rows with their damage counted, or
numpy columns. The format and the writer are `records.step_rows` (re-exported here).
Files written before the last columns existed still read: missing columns read as 0 /
none.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from distanom.records.step_rows import (
    MAX_DURATION_MS,
    MAX_ROW_CHARS,
    MAX_SKIP_CHARS,
    MAX_STEP,
    MAX_STEP_ROWS,
    NO_PHASE_VALUES,
    PHASE_COLUMNS,
    ROW_FORMAT,
    STEPS_CSV_HEADER,
    StepFields,
    StepRow,
    StepsWriter,
)
from distanom.safe_io import open_regular

__all__ = [  # the format's names, re-exported: readers import them from here
    "MAX_DURATION_MS",
    "MAX_ROW_CHARS",
    "MAX_SKIP_CHARS",
    "MAX_STEP",
    "MAX_STEP_ROWS",
    "NO_PHASE_VALUES",
    "PHASE_COLUMNS",
    "ROW_FORMAT",
    "STEPS_CSV_HEADER",
    "StepColumns",
    "StepFields",
    "StepRow",
    "StepsFile",
    "StepsWriter",
    "read_step_columns",
    "read_steps",
]


@dataclass(frozen=True)
class StepsFile:
    """What could be read of one steps file: its rows in file order, and how many were
    unreadable (a repeated step appears twice; the later row wins)."""

    rows: list[StepRow]
    bad: int


WIDTH = 8 + len(PHASE_COLUMNS)  # the columns a row has today; older rows have fewer
_DEFAULTS = np.array([np.nan, np.nan, 0, 0, 0, 0, np.nan, 0] + [np.nan] * len(PHASE_COLUMNS))
_REQUIRED = (0, 1, 4)  # step, duration, self_ms: a row whose cell is unreadable is damaged


@dataclass(frozen=True)
class StepColumns:
    """One steps file read into columns (one entry per readable row, in file order) and
    the number of damaged rows: the report's form, a few tens of bytes a row."""

    step: np.ndarray  # int64
    duration_ms: np.ndarray  # float64
    traced: np.ndarray  # bool
    after_flush: np.ndarray  # bool
    self_ms: np.ndarray  # float64
    gc_ms: np.ndarray  # float64, 0 where no collection ran
    gc_generation: np.ndarray  # int8, -1 where no collection ran
    skipped: np.ndarray  # bool
    phases: np.ndarray  # float32, one row of PHASE_COLUMNS per step, NaN: not known
    bad: int

    def __len__(self) -> int:
        return len(self.step)

    def rows(self) -> list[StepRow]:
        """The rows as `StepRow`s (an object per row: for small files and tests); an
        unknown phase is `math.nan` itself, as rows made in memory hold it."""
        return [
            StepRow(
                int(self.step[i]),
                float(self.duration_ms[i]),
                bool(self.traced[i]),
                bool(self.after_flush[i]),
                float(self.self_ms[i]),
                float(self.gc_ms[i]),
                int(self.gc_generation[i]),
                bool(self.skipped[i]),
                tuple(v if v == v else math.nan for v in self.phases[i].tolist()),
            )
            for i in range(len(self.step))
        ]


def read_steps(path: Path) -> StepsFile:
    """Every readable row of a steps file as `StepRow`s (`read_step_columns`' rules)."""
    columns = read_step_columns(path)
    return StepsFile(columns.rows(), columns.bad)


def read_step_columns(path: Path) -> StepColumns:
    """Every readable row of a steps file, in columns; damaged rows are counted, never
    raised.

    The header (first line) and rows past `MAX_STEP_ROWS` are skipped. A row needs a step
    (an integer in 0..MAX_STEP), a duration and a self_ms (0..MAX_DURATION_MS; a missing
    self_ms reads as 0); flags read as set only when exactly 1; garbage collection columns
    that are missing, unreadable, not finite or not positive read as none; a phase cell
    that is unreadable, negative or not finite reads as NaN. Rows longer than
    MAX_ROW_CHARS are damaged and skipped unread; a damaged row past MAX_SKIP_CHARS ends
    the read. OSError when the file cannot be opened or is not a regular file (a FIFO or a
    device is refused without blocking).
    """
    reader = _BlockReader()
    fd = open_regular(path)  # a FIFO or a device in its place: OSError, never a hang
    with os.fdopen(fd, encoding="ascii", errors="replace", newline="") as handle:
        while not reader.done:
            block = handle.read(BLOCK_CHARS)
            if not block:
                reader.end()
                break
            reader.feed(block)
    return _joined(reader.parsed, reader.bad)


BLOCK_CHARS = 1 << 20  # read at a time: a line with no end costs at most this much more


class _BlockReader:
    """Cuts blocks of a steps file into rows and parses them a run of equally wide rows
    at a time, within the file's bounds (row length, damaged-row skip, row count)."""

    def __init__(self) -> None:
        self.parsed: list[StepColumns] = []  # a block's rows each, already checked
        self.bad = 0
        self.done = False
        self._lines = 0  # lines met so far, the header included
        self._carry = ""  # the unfinished line of the last block
        self._skipped = -1  # chars skipped of a damaged (too long) line; -1: none

    def feed(self, block: str) -> None:
        """Take the next block of the file."""
        parts = block.split("\n")
        if self._skipped >= 0:  # inside a damaged line: skip to its end
            if len(parts) == 1:
                self._skip(len(block))
                return
            self._skipped = -1
            parts = parts[1:]
        else:
            parts[0] = self._carry + parts[0]
        self._carry = parts.pop()
        self._rows(parts)
        if len(self._carry) > MAX_ROW_CHARS:  # a line that will not end in time: damage
            self._damaged()
            self._skip(len(self._carry))
            self._carry = ""

    def end(self) -> None:
        """The file ended: its last line (one without a newline) is a row too."""
        if self._skipped < 0 and self._carry:
            self._rows([self._carry])
        self.done = True

    def _skip(self, chars: int) -> None:
        self._skipped = max(self._skipped, 0) + chars
        if self._skipped > MAX_SKIP_CHARS:  # no row is this long: the rest is not read
            self.done = True

    def _damaged(self) -> None:
        self.bad += self._lines > 0  # a damaged header is not a row
        self._lines += 1

    def _rows(self, lines: list[str]) -> None:
        if self.done:
            return
        if not self._lines and lines:  # the header
            lines = lines[1:]
            self._lines = 1
        if self._lines + len(lines) > MAX_STEP_ROWS + 1:  # the file's own bound
            lines = lines[: max(0, MAX_STEP_ROWS + 1 - self._lines)]
            self.done = True
        self._lines += len(lines)
        if max(map(len, lines), default=0) > MAX_ROW_CHARS:
            self.bad += sum(len(line) > MAX_ROW_CHARS for line in lines)
            lines = [line for line in lines if len(line) <= MAX_ROW_CHARS]
        if not lines:
            return
        commas = list(map(str.count, lines, itertools.repeat(",")))
        if commas.count(commas[0]) == len(commas):  # one width: the usual file
            self.parsed.append(_columns(_parse_rows(lines, commas[0] + 1)))
            return
        # rows of several widths: one parse per width, put back in file order (the later
        # row of a repeated step wins); one array per block, never one per row
        widths = np.array(commas)
        block = np.empty((len(lines), WIDTH))
        for count in np.unique(widths).tolist():
            at = np.flatnonzero(widths == count)
            block[at] = _parse_rows([lines[i] for i in at.tolist()], count + 1)
        self.parsed.append(_columns(block))


def _widened(values: np.ndarray) -> np.ndarray:
    """`values` cut or padded to WIDTH columns (missing ones at their defaults)."""
    width = values.shape[1]
    if width >= WIDTH:
        return values[:, :WIDTH]
    out = np.empty((len(values), WIDTH))
    out[:, :width] = values
    out[:, width:] = _DEFAULTS[width:]
    return out


# a cell of nothing or only blanks: np.fromstring reads it as -1 without a warning
_BLANK_CELL = re.compile(r"(?:^|,)[ \t\r\f\v]*(?:,|$)", re.MULTILINE)


def _parse_rows(lines: list[str], width: int) -> np.ndarray:
    """Rows (no newlines) of `width` cells as a (rows, WIDTH) float array, one row per
    line, missing columns at their defaults and an unreadable row's step NaN (damage
    `_columns` counts): one vectorised parse; where a cell is not a number, each half
    again, down to a row at a time."""
    if width >= 3 and lines and not _BLANK_CELL.search("\n".join(lines)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)  # a cell it cannot read
                flat = np.fromstring(",".join(lines), sep=",")
        except (ValueError, DeprecationWarning):
            flat = None
        if flat is not None and flat.size == width * len(lines):
            return _widened(flat.reshape(len(lines), width))
    if len(lines) > 64:
        half = len(lines) // 2
        return np.concatenate([_parse_rows(lines[:half], width), _parse_rows(lines[half:], width)])
    return np.array([_parse_row(line) for line in lines], dtype=np.float64).reshape(-1, WIDTH)


def _parse_row(line: str) -> list[float]:
    """One row's cells as WIDTH floats (defaults where missing, NaN where unreadable);
    the step NaN (damage) when a required cell is missing or unreadable."""
    cells = line.rstrip("\r").split(",")[:WIDTH]
    out = list(_DEFAULTS)
    if len(cells) < 3:  # step, duration and traced at least
        return out  # the step is NaN
    for at, cell in enumerate(cells):
        try:
            out[at] = float(cell)
        except ValueError:
            if at in _REQUIRED:
                out[0] = math.nan
                return out
            out[at] = math.nan
    return out


def _columns(values: np.ndarray) -> StepColumns:
    """A block's parsed rows checked: damaged ones counted and dropped, the rest in
    columns (about half the bytes of the parsed rows: kept per block, joined at the end)."""
    step, duration, spent = values[:, 0], values[:, 1], values[:, 4]
    with np.errstate(invalid="ignore"):
        good = (
            (step >= 0) & (step < MAX_STEP) & (step == np.floor(step))
            & (duration >= 0) & (duration < MAX_DURATION_MS)
            & (spent >= 0) & (spent < MAX_DURATION_MS)
        )  # fmt: skip
        values = values[good]
        gc_ms, generation = values[:, 5], values[:, 6]
        collected = (
            np.isfinite(gc_ms) & (gc_ms > 0)
            & (generation >= -1) & (generation <= 127) & (generation == np.floor(generation))
        )  # fmt: skip
        phases = values[:, 8:]
        phases = np.where(np.isfinite(phases) & (phases >= 0) & (phases < 1e12), phases, np.nan)
    return StepColumns(
        step=values[:, 0].astype(np.int64),
        duration_ms=np.ascontiguousarray(values[:, 1]),
        traced=values[:, 2] == 1,
        after_flush=values[:, 3] == 1,
        self_ms=np.ascontiguousarray(values[:, 4]),
        gc_ms=np.where(collected, gc_ms, 0.0),
        gc_generation=np.where(collected, generation, -1).astype(np.int8),
        skipped=values[:, 7] == 1,
        phases=phases.astype(np.float32),
        bad=int(np.count_nonzero(~good)),
    )


def _joined(parts: list[StepColumns], bad: int) -> StepColumns:
    """The blocks' columns end to end, with the damage counted while reading (`bad`)."""
    if not parts:
        parts = [_columns(np.empty((0, WIDTH)))]
    columns = {
        name: np.concatenate([getattr(part, name) for part in parts])
        for name in (field.name for field in fields(StepColumns))
        if name != "bad"
    }
    return StepColumns(**columns, bad=bad + sum(part.bad for part in parts))
