"""Timing shared by the whole-job workloads: the script's own steady-state step time.

A workload calls `StepTimer.step_end()` after each optimizer step (from its loop, or a
Trainer callback). After `warmup` steps the timer synchronizes the GPU once and starts
its clock; every `chunk` steps it synchronizes again and records the chunk's time, so
the result holds both the whole timed loop and its spread. The result goes to the JSON
file named by WHOLE_JOB_RESULT (rank 0 only). Knows nothing of distanom, except with
WHOLE_JOB_AB_SEGMENT=N: then the timed steps are segments of N steps with the installed
agent switched on and off in turn (ab_switch.py, an in-process A/B).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch


class StepTimer:
    """Steady-state time per step of the loop it is told about."""

    def __init__(self, warmup: int = 100, chunk: int = 100) -> None:
        self.warmup = warmup
        self.chunk = chunk
        self.steps = 0
        self.started: float | None = None
        self.last: float | None = None
        self.chunks_ms: list[float] = []
        self.ab: Any = None
        segment = int(os.environ.get("WHOLE_JOB_AB_SEGMENT", "0") or 0)
        if segment > 0:
            from ab_switch import SegmentedAB

            self.ab = SegmentedAB(int(os.environ.get("WHOLE_JOB_AB_WARMUP", warmup)), segment)

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def step_end(self) -> None:
        """One optimizer step ended."""
        if self.ab is not None:
            self.ab.step_end()
            return
        self.steps += 1
        if self.steps == self.warmup:
            self.started = self.last = self._now()
        elif self.steps > self.warmup and (self.steps - self.warmup) % self.chunk == 0:
            now = self._now()
            assert self.last is not None
            self.chunks_ms.append((now - self.last) * 1000 / self.chunk)
            self.last = now

    def finish(self, **extra: Any) -> dict[str, Any]:
        """Write (rank 0) and return the result: ms per step over the timed chunks."""
        if self.ab is not None:
            result = {"steps": self.ab.steps, **self.ab.finish(), **extra}
            self._write(result)
            return result
        timed = len(self.chunks_ms) * self.chunk
        result = {
            "steps": self.steps,
            "timed_steps": timed,
            "ms_per_step": (sum(self.chunks_ms) / len(self.chunks_ms)) if self.chunks_ms else None,
            "chunks_ms": [round(c, 4) for c in self.chunks_ms],
            **extra,
        }
        self._write(result)
        return result

    @staticmethod
    def _write(result: dict[str, Any]) -> None:
        path = os.environ.get("WHOLE_JOB_RESULT")
        if path and int(os.environ.get("RANK", "0")) == 0:
            with open(path, "w", encoding="utf-8") as handle:
                json.dump(result, handle)
