"""The `cupti` tracer backend: CUPTI's activity ring buffer, read back per captured step.

Import `CuptiTracer` and `probe_cupti` from here. Modules, bottom up:
`library` (finding and binding libcupti), `callbacks` (CUPTI's process-wide buffer
callbacks), `buffers` (the raw buffer pool), `session` (attach, enable, flush, detach),
`names` (kernel names), `records` (record layouts, indexing, decoding), `events`
(Kineto-shaped chrome-trace events), `marker` (the step-marker kernel), `matching`
(marker records -> steps), `resolver` (one step's records -> `StepTrace`), `calibration`
(start-up checks), `probe` (can it run here?), `tracer` (`CuptiTracer`).

No module here imports torch or loads libcupti at import time (`start` and `probe_cupti`
do). The design and the measurements behind it are in docs/cupti.md.
"""

from __future__ import annotations

from distanom.tracers.cupti.probe import probe_cupti
from distanom.tracers.cupti.tracer import CuptiTracer

__all__ = ["CuptiTracer", "probe_cupti"]
