"""What distanom prints on a rank's stderr at `log.level: INFO`: a start line, an end
line, and a line per anomaly capture on rank 0. Everything else at INFO (tracer details,
reference captures, other ranks' capture lines) appears at `log.level: DEBUG`; warnings
and errors always appear.

Reads log records (from `distanom.launch`'s handler) and the agent's counters at exit;
writes nothing but the lines it formats.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distanom.config import StepConfig

__all__ = ["HEADLINE", "QuietFilter", "end_line", "start_notes", "step_source"]

# `extra=` of the start and end lines: they pass the filter at INFO
HEADLINE: dict[str, Any] = {"distanom_headline": True}
CAPTURE_LOGGER = "distanom.capture"
CAPTURE_PREFIX = "captured step"


class QuietFilter(logging.Filter):
    """Lets through warnings and errors, the start and end lines, and on rank 0 the line of
    each capture that is not a reference; at DEBUG, everything."""

    def __init__(self, rank: int, level: str | int) -> None:
        super().__init__()
        self.rank = rank
        self.verbose = logging.getLevelName(level) == logging.DEBUG or level == logging.DEBUG

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether the record is printed."""
        if self.verbose or record.levelno != logging.INFO:
            return True
        if getattr(record, "distanom_headline", False):
            return True
        if record.name == CAPTURE_LOGGER and str(record.msg).startswith(CAPTURE_PREFIX):
            # every rank captures the same steps: one line for the job is enough
            args = record.args if isinstance(record.args, tuple) else ()
            return self.rank == 0 and "reference" not in args[1:2]
        return False


def step_source(manual: bool, optimizer: str | None, step: StepConfig, scaler_seen: bool) -> str:
    """What ends a step, for the start line: `distanom.step()` (`manual`) or which
    optimizer (its class name; None before one stepped), as `step` configures it."""
    if manual:
        return "steps end at distanom.step()"
    if optimizer is None:
        return "steps end at optimizer.step() (no optimizer has stepped yet)"
    which = ""
    if step.optimizer is not None and step.optimizer_index:
        which = f" #{step.optimizer_index} (step.optimizer_index, from 0)"
    scaler = " or its GradScaler.step() when skipped" if scaler_seen else ""
    return f"steps end at {optimizer}{which}.step(){scaler}"


def start_notes(tracer_note: str, tracing: bool, budget_pct: float | None) -> str:
    """The start line's notes: the tracer chosen (`tracer_note`), how much it may trace
    (where a tracer runs: `tracing`), and what was done about Flight Recorder."""
    from distanom.flight_recorder import start_note

    duty = None
    if tracing:
        duty = (
            "tracing nearly every step (tracer.overhead_budget_pct: null)"
            if budget_pct is None
            else f"tracing duty-cycled to {budget_pct:g}% of step time (tracer.overhead_budget_pct)"
        )
    return "; ".join(note for note in (tracer_note, duty, start_note()) if note)


def end_line(
    *,
    outcome: str,
    steps: int,
    skipped: int,
    kept: int,
    bytes_written: int,
    missed: int,
    where: str | None,
    overhead_pct: float | None,
    capture_ms: float = 0.0,
    replaced: int = 0,
) -> str:
    """The rank's last line: how training ended, what was captured, where, at what cost.
    `kept`: the trace files in the run (`CaptureStats.kept`), whose size `bytes_written`
    is; `replaced`: those written and removed since."""
    parts = [f"{outcome}: {steps} steps"]
    if skipped:
        parts[0] += f" ({skipped} with the optimizer step skipped)"
    size = (
        f"{bytes_written / 1e6:.1f} MB" if bytes_written >= 1e6 else f"{bytes_written / 1e3:.0f} kB"
    )
    captured = f"{kept} trace files ({size})"
    if replaced:
        captured += f" after {replaced} replaced"
    if missed:
        captured += f", {missed} capture{'s' if missed != 1 else ''} missed"
    parts.append(captured + (f" in {where}" if where else ""))
    parts.append(f"{capture_ms:.1f} ms of capture work")
    if overhead_pct is not None:
        parts.append(f"tracing cost {overhead_pct:.1f}% of step time")
    return "; ".join(parts)
