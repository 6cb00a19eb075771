"""How the control thread shares the GIL with the training thread between a round's
phases (used by `distanom.control_loop`; nothing else here).

A round of up to 128 steps is a few ms of Python on the control thread. In one piece it
stretches one training step by all of it: the step then looks like an anomaly (1.5x on
4.4 ms CPU steps, once per round, in `bench/probes/boundary_cost_probe.py`'s spike
census). A bare `time.sleep(0)` between phases does not prevent that: it drops the GIL
and takes it back before a waiting thread has woken up. Sleeping about one training step
between phases puts each phase in a different step (docs/agent.md).
"""

from __future__ import annotations

import math
import time

PACE_MIN_S = 0.001
PACE_MAX_S = 0.01


def yield_gil(pause_s: float = 0.0) -> None:
    """Drop the GIL for `pause_s` (0: only let a thread already waiting go first)."""
    time.sleep(pause_s)


def pace_s(median_ms: float | None) -> float:
    """The pause between a round's phases: about one step at the median step time,
    within PACE_MIN_S..PACE_MAX_S (longer steps hide a phase anyway)."""
    if median_ms is None or not math.isfinite(median_ms):
        return PACE_MIN_S
    return min(PACE_MAX_S, max(PACE_MIN_S, median_ms / 1e3))
