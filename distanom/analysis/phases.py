"""Where a slow step's time went, for the report: each rank's step phases (read from its
steps file by `run.load_steps`) and the rule that names the phase of a verdict.

A verdict's culprit rank, chosen from the evidence or the trace, is looked up here at
its step: its host parts (data, forward, backward, tail, optimizer), the time inside the
batch fetch and, with CUDA, the GPU's parts, against the same rank's usual values (the
median of its last `USUAL_STEPS` steps before it). `with_phase` then names the phase and
makes the cause more specific where a phase signal explains the slowdown (in order):

1. a Python GC pause stays `python_gc` (the collector ran, whichever phase it hit);
2. the batch fetch grew by at least `PHASE_SHARE` of the slowdown: `data_loading`, in
   the `data` phase;
3. a part's GPU time grew by `PHASE_SHARE` of the slowdown more than its host time did:
   `gpu_work` in that phase. The host only launched that work; where it then waited
   for it (a synchronize: a GradScaler's inf check, `.item()`) its CPU time grew too
   while spinning, which alone would read as `host_busy`;
4. otherwise the cause stands, in the phase whose host time grew most (the GPU's, for
   `gpu_work`).

The tail (from the backward's end to the optimizer step) is reported as part of the
`backward` phase. Pure: numpy arrays in, a verdict out; no files.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

PHASES = ("data", "forward", "backward", "optimizer")
PARTS = 5  # data, forward, backward, tail, optimizer (distanom.phases.PARTS)
TAIL = 3
FETCH = 5  # column of the batch fetch in a table's values
GPU_AT = 6  # first GPU part column
COLUMNS = 11
USUAL_STEPS = 64  # the steps before an anomaly whose median is "usual"
MIN_USUAL = 4  # steps with a value needed for a usual value
PHASE_SHARE = 0.5  # a phase signal explains a slowdown when it grew by this share of it
PHASE_CAUSES = ("python_gc", "host_busy", "host_stall", "gpu_work", "data_loading")


def phase_of_part(part: int) -> str:
    """The phase a part belongs to (the tail is the backward phase's)."""
    return ("data", "forward", "backward", "backward", "optimizer")[part]


@dataclass(frozen=True)
class PhaseTable:
    """One rank's phase columns by step: `steps` ascending, `values` one row per step
    (`records.steps.PHASE_COLUMNS`, NaN where not known)."""

    steps: np.ndarray
    values: np.ndarray

    @classmethod
    def of_rows(cls, rows: dict[int, tuple[float, ...]]) -> PhaseTable | None:
        """A table of (step -> phase columns), None when no row has a known phase."""
        if not rows:
            return None
        steps = np.fromiter(sorted(rows), dtype=np.int64, count=len(rows))
        values = np.array([rows[int(s)] for s in steps], dtype=np.float32)
        if values.ndim != 2 or values.shape[1] != COLUMNS or not np.isfinite(values).any():
            return None
        return cls(steps, values)

    def row(self, step: int) -> np.ndarray | None:
        """The step's columns, None when the step has no row."""
        at = int(np.searchsorted(self.steps, step))
        if at < len(self.steps) and int(self.steps[at]) == step:
            return np.asarray(self.values[at], dtype=np.float64)
        return None

    def usual(self, step: int) -> np.ndarray | None:
        """Per column, the median of the `USUAL_STEPS` rows before `step` (NaN for a
        column with fewer than `MIN_USUAL` known values); None without such rows."""
        at = int(np.searchsorted(self.steps, step))
        window = self.values[max(0, at - USUAL_STEPS) : at]
        if len(window) < MIN_USUAL:
            return None
        known = np.isfinite(window).sum(axis=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
            medians = np.asarray(np.nanmedian(window, axis=0), dtype=np.float64)
        medians[known < MIN_USUAL] = np.nan
        return medians

    def over(self, first: int, last: int) -> np.ndarray | None:
        """Per column, the median over steps first..last (None without rows there)."""
        lo = int(np.searchsorted(self.steps, first))
        hi = int(np.searchsorted(self.steps, last, side="right"))
        window = self.values[lo:hi]
        if not len(window):
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.asarray(np.nanmedian(window, axis=0), dtype=np.float64)


def phases_json(values: np.ndarray, offset: int = 0) -> dict[str, float | None]:
    """The four phases (ms) of a row's host (`offset` 0) or GPU (`GPU_AT`) parts, the
    tail folded into backward; null where not known."""
    parts = [float(v) for v in values[offset : offset + PARTS]]
    folded = [parts[0], parts[1], parts[2] + parts[TAIL], parts[4]]
    return {name: _ms(value) for name, value in zip(PHASES, folded, strict=True)}


@dataclass(frozen=True)
class PhaseFinding:
    """The phase a verdict's time went to, a more specific cause where one applies, the
    words that say so, and the numbers behind them (for the JSON)."""

    phase: str | None
    cause: str | None  # None: the verdict's cause stands
    words: str
    facts: dict[str, Any]


def find_phase(
    cause: str, now: np.ndarray, usual: np.ndarray, slowdown: float
) -> PhaseFinding | None:
    """The rule of the module docstring for one rank's step (`now`) against its usual
    values, for a verdict of `cause` and a slowdown of `slowdown` ms; None when the step
    has no phase known."""
    host_growth = now[:PARTS] - usual[:PARTS]
    gpu_growth = now[GPU_AT : GPU_AT + PARTS] - usual[GPU_AT : GPU_AT + PARTS]
    if not np.isfinite(host_growth).any() and not math.isfinite(float(now[FETCH])):
        return None
    facts: dict[str, Any] = {
        "phases_ms": phases_json(now),
        "median_phases_ms": phases_json(usual),
        "fetch_ms": _ms(float(now[FETCH])),
        "median_fetch_ms": _ms(float(usual[FETCH])),
    }
    if np.isfinite(now[GPU_AT : GPU_AT + PARTS]).any():
        facts["gpu_phases_ms"] = phases_json(now, GPU_AT)
        facts["median_gpu_phases_ms"] = phases_json(usual, GPU_AT)
    share = PHASE_SHARE * slowdown
    fetch, fetch_usual = float(now[FETCH]), float(usual[FETCH])
    if cause != "python_gc" and _grew(fetch, fetch_usual) >= share:
        return PhaseFinding(
            "data",
            "data_loading",
            f"it waited {fetch:.1f} ms for its next batch (usually {fetch_usual:.1f} ms): "
            "data loading",
            facts,
        )
    device = np.where(np.isfinite(gpu_growth), gpu_growth - np.nan_to_num(host_growth), np.nan)
    if cause != "python_gc" and np.isfinite(device).any():
        part = int(np.nanargmax(device))
        if float(device[part]) >= share:
            phase = phase_of_part(part)
            gpu_now, gpu_usual = float(now[GPU_AT + part]), float(usual[GPU_AT + part])
            host_now = float(now[part])
            return PhaseFinding(
                phase,
                "gpu_work",
                f"its GPU's {_part_words(part)} took {gpu_now:.1f} ms (usually "
                f"{gpu_usual:.1f}) while its host launched it in {host_now:.1f} ms: the "
                f"device's work grew in the {phase} phase",
                facts,
            )
    growth = gpu_growth if cause == "gpu_work" and np.isfinite(gpu_growth).any() else host_growth
    if not np.isfinite(growth).any():
        return PhaseFinding(None, None, "", facts)
    part = int(np.nanargmax(growth))
    offset = GPU_AT if growth is gpu_growth else 0
    phase = phase_of_part(part)
    where = "its GPU's" if offset else "its"
    return PhaseFinding(
        phase,
        None,
        f"{where} {phase} phase took {float(now[offset + part]):.1f} ms in the "
        f"{_part_words(part)} (usually {float(usual[offset + part]):.1f})",
        facts,
    )


def straggler_phase(tables: dict[int, PhaseTable], rank: int, first: int, last: int) -> str | None:
    """The phase in which a straggler's host time exceeds the other ranks' most over
    steps first..last (their median per phase); None when not known."""
    mine = tables.get(rank)
    own = mine.over(first, last) if mine is not None else None
    if own is None:
        return None
    others = [t.over(first, last) for r, t in tables.items() if r != rank]
    rows = [row for row in others if row is not None]
    if not rows:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        typical = np.nanmedian(np.stack(rows), axis=0)
    excess = own[:PARTS] - typical[:PARTS]
    excess[np.isnan(excess)] = -np.inf
    if not np.isfinite(excess).any() or float(np.max(excess)) <= 0:
        return None
    return phase_of_part(int(np.argmax(excess)))


def _part_words(part: int) -> str:
    return (
        "data phase",
        "forward",
        "backward pass",
        "time between backward and the optimizer step",
        "optimizer step",
    )[part]


def _grew(value: float, usual: float) -> float:
    if not math.isfinite(value):
        return -math.inf
    return value - (usual if math.isfinite(usual) else 0.0)


def _ms(value: float) -> float | None:
    return round(value, 3) if math.isfinite(value) else None
