"""The `torch.amp.GradScaler.step` wrapper: a mixed-precision loop's skipped optimizer
step (inf/nan gradients) still ends a step. The scaler's own call is the signal; no
private state of the scaler is read. Installed and removed by `boundary.StepBoundaries`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)


def patch_grad_scaler(after: Any) -> Any:
    """Wrap `torch.amp.GradScaler.step` so `after(optimizer, step_before)` runs when it
    returns (`step_before`: the boundaries' step counter before the call, read by the
    caller's closure); returns a function that undoes the wrap, or None without a scaler
    class. The wrapper never raises from `after` into training."""
    try:
        from torch.amp import GradScaler
    except ImportError:
        return None
    original = GradScaler.__dict__.get("step")
    if original is None:
        return None
    owner = getattr(after, "__self__", None)

    @functools.wraps(original)
    def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        before = getattr(owner, "current_step", -1)
        result = original(scaler, optimizer, *args, **kwargs)
        try:
            after(optimizer, before)
        except Exception as err:  # never raise into training
            log.debug("GradScaler.step follow-up failed: %s", err)
        return result

    GradScaler.step = step  # type: ignore[method-assign,assignment]

    def undo() -> None:
        if GradScaler.__dict__.get("step") is step:
            GradScaler.step = original  # type: ignore[method-assign]

    return undo
