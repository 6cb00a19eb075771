"""Exception types of distanom: one base class, one subclass per kind of failure.

Every error a user can cause (a bad config key, a damaged trace, an unusable run
directory) is a `DistanomError`; entry points print its message on one line and exit
with `exit_code`, so no traceback ever reaches the user for their own mistake.
Nothing here imports torch.
"""

from __future__ import annotations


class DistanomError(Exception):
    """Base class; `str(err)` is a complete one-line message for the user."""

    exit_code = 2


class ConfigError(DistanomError):
    """The configuration (YAML file, `--set` override or launch flag) is invalid."""


class RunDirError(DistanomError):
    """The run directory is missing, unwritable, or not a distanom run directory."""


class TraceFormatError(DistanomError):
    """A trace file cannot be read as a Kineto chrome trace (or has no usable events)."""


class CaptureRequestError(DistanomError):
    """An on-demand capture request is invalid or cannot reach a running job."""


class TracerUnavailableError(DistanomError):
    """A tracer backend cannot run here (no GPU, no CUPTI, CUPTI already in use...)."""


class AnalysisEngineError(DistanomError):
    """The requested analysis engine cannot run (TraceLens not importable, or it failed)."""
