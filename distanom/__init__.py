"""distanom: catch the rare slow step of a torchrun job on every rank and say why.

Public API for training scripts (all optional: under `python -m distanom.launch` the
optimizer's step ends each step with no change to the script):

- `distanom.step()`: end a step by hand, at the end of each iteration (loops without an
  optimizer, or `step.source: manual`); beside an optimizer, the first call takes over
  the counting without ending a second step, so steps keep the loop's numbers.
- `distanom.use_optimizer(opt)`: this optimizer's `step()` ends a step, when there are
  several (or `step.optimizer` / `step.optimizer_index` in the config). A
  `GradScaler.step(opt)` that skips `opt.step()` still ends the step.
- `distanom.current_step()`: the index of the step in progress (None without an agent).

Every call is a no-op when no agent is installed, so a script keeps running unchanged
without distanom.
"""

from __future__ import annotations

from typing import Any

from distanom.version import __version__

__all__ = ["__version__", "current_step", "step", "use_optimizer"]


def step() -> None:
    """Mark the end of a training step (no-op without an agent)."""
    from distanom.agent import active_agent

    active = active_agent()
    if active is not None:
        active.manual_step()


def use_optimizer(optimizer: Any) -> None:
    """Count only `optimizer.step()` as the end of a step (no-op without an agent)."""
    from distanom.agent import active_agent

    active = active_agent()
    if active is not None:
        active.use_optimizer(optimizer)


def current_step() -> int | None:
    """The index of the step in progress, counted from 0; None without an agent."""
    from distanom.agent import active_agent

    active = active_agent()
    return None if active is None else active.current_step
