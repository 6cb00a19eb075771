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

PACE_MAX_S = 0.01


def yield_gil(pause_s: float = 0.0) -> None:
    """Drop the GIL for `pause_s` (with 0 it is taken straight back: see above)."""
    time.sleep(pause_s)


# A round's pauses (three) take at most this share of the time its steps take, so the
# control thread keeps up with rounds of a few steps (`consensus.batch_steps: 1`).
ROUND_SHARE = 0.375


def pace_s(median_ms: float | None, round_steps: int) -> float:
    """The pause between a round's phases: one step at the median step time, at most
    PACE_MAX_S (longer steps hide a phase anyway) and at most an eighth of the round's
    steps; 0 before a median is known. Never more than a step: each pause delays the
    round's evidence by one step, and a round with a tracer covers half of the steps
    the tracer keeps."""
    if median_ms is None or not math.isfinite(median_ms) or median_ms <= 0:
        return 0.0
    step_s = median_ms / 1e3
    return min(PACE_MAX_S, step_s, ROUND_SHARE / 3 * round_steps * step_s)
