"""The tracing duty cycle shared by the agent's two threads.

The control thread feeds the overhead governor with gathered step times and schedules
requested steps; the training thread asks, at each boundary, whether the next step is
traced. Every rank computes the same schedule from the same gathered data. The governor
is guarded by one lock (it is only touched when a decision or a report needs it); the
set of requested steps is read and changed by whole-set operations, which the GIL keeps
atomic.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import Any

from distanom.config import Config
from distanom.detect import StepSample
from distanom.governor import GovernorNotReadyError, GovernorParams, OverheadGovernor


class DutyCycle:
    """Which steps are traced: requested steps always, the rest as the governor decides."""

    def __init__(self, config: Config) -> None:
        # the governor is replaced or removed only between steps (tests; a failure)
        self.governor: OverheadGovernor | None = None
        if config.tracer.backend != "none":
            # decisions wait for gathered data: with rounds of batch_steps steps, a lag
            # shorter than a round would leave the governor unready at window boundaries,
            # and the switch would come late, mid-window
            params = GovernorParams(lag_steps=config.consensus.batch_steps + 4)
            self.governor = OverheadGovernor.from_config(config.tracer, params, first_step=1)
        self._lock = threading.Lock()
        self._forced_on: set[int] = set()  # requested steps: traced whatever the governor says

    # -- training thread ---------------------------------------------------------------

    def wanted(self, next_step: int) -> bool | None:
        """Whether `next_step` should be traced; None to keep the current state (no
        governor, or its gathered data lag behind)."""
        forced = self._forced_on
        if forced:
            for past in [s for s in list(forced) if s < next_step]:
                forced.discard(past)  # scheduled after the host had passed them
            if next_step in forced:
                forced.discard(next_step)
                return True
        governor = self.governor
        if governor is None:
            return None
        with self._lock:
            if not governor.ready(next_step):
                return None
            try:
                return governor.tracing_on(next_step)
            except GovernorNotReadyError:
                return None

    # -- control thread ----------------------------------------------------------------

    def force(self, steps: Iterable[int]) -> None:
        """Trace these (requested) steps whatever the governor decides."""
        self._forced_on.update(steps)

    def record(self, samples: Iterable[StepSample]) -> None:
        """Feed gathered step times to the governor; ValueError on data it refuses."""
        governor = self.governor
        if governor is None:
            return
        with self._lock:
            for sample in samples:
                step_ms = sample.step_ms
                seconds = step_ms / 1000.0 if math.isfinite(step_ms) else None
                governor.record(sample.step, seconds, sample.traced, sample.after_flush)

    def disable(self) -> None:
        """Stop deciding: tracing stays as it is from now on."""
        self.governor = None

    def report(self) -> dict[str, Any] | None:
        """The governor's summary (duty cycle, measured overhead), None without one."""
        governor = self.governor
        if governor is None:
            return None
        with self._lock:
            return governor.report()
