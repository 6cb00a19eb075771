"""Where a slow step's time went, for the report: each rank's step phases (read from its
steps file by `run.load_steps`) and the rule that names the phase of a verdict.

A verdict's culprit rank, chosen from the evidence or the trace, is looked up here at
its step: its host parts (data, forward, backward, tail, optimizer), the time inside the
batch fetch and, with CUDA, the GPU's parts, against the same rank's usual values (the
median of its last `USUAL_STEPS` steps before it). `with_phase` then names the phase and
makes the cause more specific where a phase signal explains the slowdown (in order):

1. a Python GC pause stays `python_gc` (the collector ran, whichever phase it hit),
   unless distanom's own work ran in the step (`self_ms`: capture work, and consensus
   rounds heavy enough to be charged): its decoding, writing and gathering allocate,
   and the pause is named `distanom`, with its own share; so is a host stall or busy
   host of which that work is `PHASE_SHARE` of the slowdown or more;
2. the batch fetch grew by at least `PHASE_SHARE` of the slowdown: `data_loading`, in
   the `data` phase;
3. a GPU part (up to the forward's end, the backward, after the backward's end) grew by
   `PHASE_SHARE` of the slowdown more than the host's time for the same span: `gpu_work`
   in that phase (forward, backward, optimizer). The host only launched that work;
   where it then waited for it (a synchronize: a GradScaler's inf check, `.item()`) its
   CPU time grew too while spinning, which alone would read as `host_busy`;
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
PARTS = 5  # data, forward, backward, tail, optimizer (distanom.phase_split.PARTS)
TAIL = 3
FETCH = 5  # column of the batch fetch in a table's values
GPU_AT = 6  # first GPU part column: to the forward's end, backward, after the backward
GPU_PARTS = 3
SELF = 9  # distanom's own work in the step: capture, heavy rounds (steps file `self_ms`)
# the host parts each GPU part spans, and the phase its device work is named by
GPU_SPANS = (((0, 1), "forward"), ((2,), "backward"), ((3, 4), "optimizer"))
COLUMNS = 10
USUAL_STEPS = 64  # the steps before an anomaly whose median is "usual"
MIN_USUAL = 4  # steps with a value needed for a usual value
PHASE_SHARE = 0.5  # a phase signal explains a slowdown when it grew by this share of it
PHASE_CAUSES = ("python_gc", "host_busy", "host_stall", "gpu_work", "data_loading", "distanom")
HOST_CAUSES = ("host_busy", "host_stall")  # distanom's own work may explain these


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
        """A table of (step -> phase columns, then `self_ms`), None when no row has a known
        phase."""
        if not rows:
            return None
        steps = np.fromiter(sorted(rows), dtype=np.int64, count=len(rows))
        values = np.array([rows[int(s)] for s in steps], dtype=np.float32)
        if values.ndim != 2 or values.shape[1] != COLUMNS or not np.isfinite(values).any():
            return None
        return cls(steps, values)

    @classmethod
    def of_columns(cls, steps: np.ndarray, values: np.ndarray) -> PhaseTable | None:
        """A table of steps (ascending, each once) and their rows (the phase columns, then
        `self_ms`), None when no row has a known value (as `of_rows`)."""
        if not len(steps) or values.ndim != 2 or values.shape[1] != COLUMNS:
            return None
        if not np.isfinite(values).any():
            return None
        return cls(np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float32))

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


def phases_json(values: np.ndarray) -> dict[str, float | None]:
    """The four phases (ms) of a row's host parts, the tail folded into backward; null
    where not known."""
    parts = [float(v) for v in values[:PARTS]]
    folded = [parts[0], parts[1], parts[2] + parts[TAIL], parts[4]]
    return {name: _ms(value) for name, value in zip(PHASES, folded, strict=True)}


def gpu_json(values: np.ndarray) -> dict[str, float | None]:
    """A row's GPU parts (ms): up to the forward's end (data and forward), the
    backward, after the backward's end (tail and optimizer)."""
    names = ("to_forward_end", "backward", "after_backward")
    return {name: _ms(float(values[GPU_AT + i])) for i, name in enumerate(names)}


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
    gpu_growth = now[GPU_AT : GPU_AT + GPU_PARTS] - usual[GPU_AT : GPU_AT + GPU_PARTS]
    if not np.isfinite(host_growth).any() and not math.isfinite(float(now[FETCH])):
        return None
    facts: dict[str, Any] = {
        "phases_ms": phases_json(now),
        "median_phases_ms": phases_json(usual),
        "fetch_ms": _ms(float(now[FETCH])),
        "median_fetch_ms": _ms(float(usual[FETCH])),
    }
    if np.isfinite(now[GPU_AT : GPU_AT + GPU_PARTS]).any():
        facts["gpu_phases_ms"] = gpu_json(now)
        facts["median_gpu_phases_ms"] = gpu_json(usual)
    share = PHASE_SHARE * slowdown
    own = float(now[SELF]) if len(now) > SELF else math.nan
    ours = math.isfinite(own) and own > 0
    # distanom's own work must explain half the slowdown, a collection's too: a collection
    # that distanom's allocations triggered ran inside that work (its CPU time holds it),
    # while a script's 1.6 s gc.collect() beside a 7 ms status write is the script's
    if ours and own >= share and (cause == "python_gc" or cause in HOST_CAUSES):
        part = int(np.nanargmax(host_growth)) if np.isfinite(host_growth).any() else None
        what = (
            "the collection ran while distanom's own work (capture, consensus rounds) took "
            f"{own:.1f} ms of the step (its decoding, writing and gathering allocate)"
            if cause == "python_gc"
            else f"distanom's own work (capture, consensus rounds) took {own:.1f} ms of the "
            "step, holding the interpreter the training thread needs"
        )
        return PhaseFinding(
            None if part is None else phase_of_part(part),
            "distanom",
            f"{what}: distanom's, not the script's",
            {**facts, "distanom_ms": round(own, 3)},
        )
    fetch, fetch_usual = float(now[FETCH]), float(usual[FETCH])
    if cause != "python_gc" and _grew(fetch, fetch_usual) >= share:
        return PhaseFinding(
            "data",
            "data_loading",
            f"it waited {fetch:.1f} ms for its next batch (usually {fetch_usual:.1f} ms): "
            "data loading",
            facts,
        )
    spans = [(group, name) for group, name in GPU_SPANS]
    host_spans = np.array([np.nansum(host_growth[list(group)]) for group, _ in spans])
    device = np.where(np.isfinite(gpu_growth), gpu_growth - host_spans, np.nan)
    if cause != "python_gc" and np.isfinite(device).any():
        part = int(np.nanargmax(device))
        if float(device[part]) >= share:
            group, phase = spans[part]
            gpu_now, gpu_usual = float(now[GPU_AT + part]), float(usual[GPU_AT + part])
            host_now = float(np.nansum(now[list(group)]))
            return PhaseFinding(
                phase,
                "gpu_work",
                f"its GPU took {gpu_now:.1f} ms {_gpu_words(part)} (usually {gpu_usual:.1f}) "
                f"while its host went through it in {host_now:.1f} ms: the device's work "
                f"grew in the {phase} phase",
                facts,
            )
    if cause == "gpu_work" and np.isfinite(gpu_growth).any():
        part = int(np.nanargmax(gpu_growth))
        phase = spans[part][1]
        return PhaseFinding(
            phase,
            None,
            f"its GPU took {float(now[GPU_AT + part]):.1f} ms {_gpu_words(part)} (usually "
            f"{float(usual[GPU_AT + part]):.1f})",
            facts,
        )
    if not np.isfinite(host_growth).any():
        return PhaseFinding(None, None, "", facts)
    part = int(np.nanargmax(host_growth))
    phase = phase_of_part(part)
    return PhaseFinding(
        phase,
        None,
        f"its {phase} phase took {float(now[part]):.1f} ms in the {_part_words(part)} "
        f"(usually {float(usual[part]):.1f})",
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


def _gpu_words(part: int) -> str:
    return ("up to its forward's end", "in its backward pass", "after its backward pass")[part]


def _grew(value: float, usual: float) -> float:
    if not math.isfinite(value):
        return -math.inf
    return value - (usual if math.isfinite(usual) else 0.0)


def _ms(value: float) -> float | None:
    return round(value, 3) if math.isfinite(value) else None
