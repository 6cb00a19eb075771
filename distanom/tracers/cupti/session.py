"""One tracer's use of CUPTI's activity API: open, enable/disable, flush, detach, close.

Owns the session life cycle over a `CuptiLib` and a `BufferPool`: checking for another
CUPTI client, registering the process-wide callbacks (pointing `callbacks.active_pool`
at this session's pool), enabling the traced kinds, flushing buffers back, detaching
CUPTI from the process while tracing is off and attaching it again, and the dropped
record count. Completed buffers go to the pool, where the tracer's reader finds them.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence

import distanom.tracers.cupti.callbacks as callbacks
from distanom.errors import TracerUnavailableError
from distanom.tracers.cupti.buffers import BufferPool
from distanom.tracers.cupti.library import TRACED_KINDS, CuptiError, CuptiLib, DetachError

log = logging.getLogger(__name__)

# Only one session may be open per process: CUPTI's buffer callbacks are global.
_session_lock = threading.Lock()


class ActivitySession:
    """One tracer's use of CUPTI's activity API: registration, the enabled kinds, flushes,
    and detaching CUPTI from the process while tracing is off.

    Only one session may be open per process (CUPTI's buffer callbacks are global). The
    training thread switches tracing; the reader thread flushes; a lock keeps a flush
    from racing a detach (the race CUPTI warns about).
    """

    def __init__(
        self, lib: CuptiLib, pool: BufferPool, kinds: Sequence[int] = TRACED_KINDS
    ) -> None:
        self.lib = lib
        self.pool = pool
        self.kinds = tuple(kinds)
        self.enabled = False
        self.is_open = False
        self.attached = False
        self.dropped_records = 0
        self.flushes = 0
        self.forced_flushes = 0
        self.detaches = 0
        self._lock = threading.RLock()

    def open(self) -> None:
        """Check for another subscriber, register the callbacks, enable the kinds."""
        with _session_lock:
            if callbacks.active_pool is not None:
                raise TracerUnavailableError(
                    "another distanom CUPTI session is open in this process"
                )
            self.lib.subscriber_check()
            callbacks.active_pool = self.pool
            try:
                self.lib.register_callbacks()
                self.enable()
            except BaseException:
                callbacks.active_pool = None
                self._disable_quietly()
                raise
            self.attached = True
            self.is_open = True

    def enable(self) -> None:
        """Enable every traced kind; on a failure, disable those already enabled and raise."""
        done: list[int] = []
        with self._lock:
            try:
                for kind in self.kinds:
                    self.lib.enable(kind)
                    done.append(kind)
            except CuptiError:
                for kind in done:
                    with contextlib.suppress(CuptiError):
                        self.lib.disable(kind)
                raise
            self.enabled = True

    def disable(self) -> None:
        """Disable every kind; raise the first failure after trying them all."""
        first: CuptiError | None = None
        with self._lock:
            for kind in self.kinds:
                try:
                    self.lib.disable(kind)
                except CuptiError as err:
                    first = first or err
            self.enabled = False
        if first is not None:
            raise first

    def detach(self) -> None:
        """Disable, hand every buffer back, and detach CUPTI from the process.

        Disabled kinds alone leave CUPTI's per-launch cost in place (about as much as
        tracing itself, docs/cupti.md); detached, none is left. The caller must first
        make sure every instrumented launch has completed (a device synchronize):
        CUPTI's condition for detaching outside its callbacks.
        """
        with self._lock:
            if not self.attached:
                return
            self.disable()
            self.flush(forced=True)
            try:
                self.lib.finalize()
            except CuptiError as err:
                raise DetachError(str(err)) from None
            self.attached = False
            self.detaches += 1
            self.pool.begin_epoch()

    def attach(self) -> None:
        """Re-attach after `detach`: refuse if another CUPTI client appeared meanwhile
        (registering would take its buffers), else register the callbacks and enable."""
        with self._lock:
            if self.attached:
                self.enable()
                return
            self.lib.subscriber_check()
            self.lib.register_callbacks()
            self.attached = True
            self.enable()

    def _disable_quietly(self) -> None:
        try:
            self.disable()
        except CuptiError as err:
            log.warning("while giving CUPTI up: %s", err)

    def flush(self, forced: bool = False) -> None:
        """Hand completed (forced: all) buffers back. A no-op while detached: the detach
        flushed everything, and a CUPTI call would attach CUPTI again."""
        with self._lock:
            if not self.attached:
                return
            self.lib.flush_all(forced)
            self.flushes += 1
            self.forced_flushes += int(forced)
            self.poll_dropped()

    def record_offsets(self, address: int, valid_size: int) -> list[int]:
        """`CuptiLib.record_offsets`, only while attached and never during a detach."""
        with self._lock:
            if not self.attached:
                raise CuptiError("cuptiActivityGetNextRecord", -1, "CUPTI is detached")
            return self.lib.record_offsets(address, valid_size)

    def poll_dropped(self) -> int:
        """Add the records CUPTI dropped since the last poll (while attached); returns the running
        total."""
        with self._lock:
            if self.attached:
                self.dropped_records += self.lib.dropped_records()
            return self.dropped_records

    def close(self) -> None:
        """Disable, hand every buffer back (forced flush), detach the pool. Idempotent;
        logs CUPTI errors instead of raising, since it runs on the way out."""
        if not self.is_open:
            return
        self.is_open = False
        if self.attached:
            self._disable_quietly()
            try:
                self.flush(forced=True)
            except CuptiError as err:
                log.warning("final CUPTI flush: %s", err)
        with _session_lock:
            if callbacks.active_pool is self.pool:
                callbacks.active_pool = None
        held = self.pool.release()
        if held:
            log.warning("CUPTI still holds %d activity buffer(s); kept alive until exit", held)
