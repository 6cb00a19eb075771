"""The hang watch (`distanom-hang` thread): notices that this rank's training stopped
ending steps, and writes what it can see while the job is still hung.

It polls the step counter the training thread keeps (`StepBoundaries.current_step`), so
the training thread does nothing for it. A rank is judged hung when no step has ended
for `hang.after_s` (null: `hang.median_factor` x the detector's median step time, at
least `hang.floor_s`; armed once the first step has ended), or when a consensus round
timed out while this rank had ended no step for half the round's wait (a round that
times out while training goes on is a rank gone, not a hang here). Then the rank writes
its hang record (`records.hangs`: stacks of all threads, Flight Recorder summary, last
step) into the run directory and logs one warning line. Rank 0 then waits a little for
the other ranks' records and logs the verdict (`analysis.hangs`). One record per hang:
the watch re-arms when a step ends again. It never touches a process group, so a stuck
one cannot stop it; a failure inside it is logged once and the watch steps aside.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from distanom.config import HangConfig
from distanom.flight_recorder import read_groups
from distanom.records.hangs import (
    CAUSE_NO_STEP,
    CAUSE_ROUND_TIMEOUT,
    Frame,
    HangRecord,
    ThreadStack,
    hang_ranks,
    write_hang_record,
)
from distanom.rundir import RunDir
from distanom.world import WorldInfo

__all__ = ["MAX_CODE_CHARS", "MAX_THREADS", "ROUND_FAILED_AFTER_S", "HangWatch", "thread_stacks"]

log = logging.getLogger(__name__)

MAX_THREADS = 64  # threads whose stacks a record keeps (the training thread always)
MAX_CODE_CHARS = 200  # a frame's source line is cut here
# After a failed round, a rank that has also ended no step for this long (or half the
# round's wait, if longer) is hung: a peer lost at once must not make a busy rank "hung".
ROUND_FAILED_AFTER_S = 5.0


def thread_stacks(training_ident: int, max_frames: int) -> list[ThreadStack]:
    """Every thread's Python stack, innermost frame last, at most `max_frames` each and
    MAX_THREADS threads (the training thread first)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: (ident != training_ident, names.get(ident, "")))
    out = []
    for ident in order[:MAX_THREADS]:
        summary = traceback.extract_stack(frames[ident], limit=max_frames + 1)
        truncated = len(summary) > max_frames
        kept = list(summary)[-max_frames:]
        out.append(
            ThreadStack(
                ident=ident,
                name=names.get(ident, f"thread {ident}"),
                training=ident == training_ident,
                frames=[
                    Frame(f.filename, f.lineno or 0, f.name, (f.line or "")[:MAX_CODE_CHARS])
                    for f in kept
                ],
                truncated=truncated,
            )
        )
    del frames
    return out


class HangWatch:
    """One per rank, made on the training thread; see the module docstring."""

    def __init__(
        self,
        config: HangConfig,
        world: WorldInfo,
        *,
        current_step: Callable[[], int],
        median_ms: Callable[[], float],
        run: Callable[[], RunDir | None],
    ) -> None:
        self.config = config
        self.world = world
        self._current_step = current_step
        self._median_ms = median_ms
        self._run = run
        self._training_ident = threading.get_ident()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._round_timeout: tuple[str, float, int] | None = None
        self.hangs = 0  # hangs this rank detected (records written or not)
        self.hung = False  # a hang reported and no step ended since (live metrics)
        self._thread = threading.Thread(target=self._main, name="distanom-hang", daemon=True)

    def start(self) -> None:
        """Start watching (no-op when `hang.enabled` is false)."""
        if self.config.enabled:
            self._thread.start()

    def stop(self) -> None:
        """Stop watching (end of training); returns at once."""
        self._stop.set()
        self._wake.set()

    def round_timed_out(self, reason: str, waited_s: float) -> None:
        """A consensus round failed after `waited_s` (control thread): judge sooner."""
        self._round_timeout = (reason, waited_s, self._current_step())
        self._wake.set()

    def limit_s(self) -> float:
        """Seconds without a step end after which this rank counts as hung."""
        if self.config.after_s is not None:
            return self.config.after_s
        median_ms = self._median_ms()
        scaled = median_ms * self.config.median_factor / 1000.0 if median_ms > 0 else 0.0
        return max(self.config.floor_s, scaled)  # NaN median: max keeps the floor

    # -- the thread --------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._watch()
        except Exception:
            log.exception("hang watch: internal error; the watch steps aside")

    def _watch(self) -> None:
        last_step = self._current_step()
        last_change = time.monotonic()
        reported = False
        while not self._stop.is_set():
            self._wake.wait(self.config.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            step, now = self._current_step(), time.monotonic()
            if step != last_step:
                last_step, last_change, reported = step, now, False
                self.hung = False
            silent_s = now - last_change
            round_timeout = self._round_timeout
            if round_timeout is not None and step != round_timeout[2]:
                round_timeout = self._round_timeout = None  # steps go on: a rank gone
            if reported or step < 1:  # one record per hang; armed by the first step end
                continue
            limit = self.limit_s()
            if round_timeout is not None and silent_s >= max(
                0.5 * round_timeout[1], ROUND_FAILED_AFTER_S
            ):
                reason = (
                    f"a consensus round failed ({round_timeout[0]}) and no step has ended "
                    f"for {silent_s:.0f} s"
                )
                cause = CAUSE_ROUND_TIMEOUT
            elif silent_s >= limit:
                reason = f"no step has ended for {silent_s:.0f} s (limit {limit:.0f} s)"
                cause = CAUSE_NO_STEP
            else:
                continue
            reported = self.hung = True
            self.hangs += 1
            self._report(cause, reason, step - 1, silent_s, limit)

    def _report(
        self, cause: str, reason: str, last_step: int, silent_s: float, limit: float
    ) -> None:
        groups, note = read_groups(self.config.max_collectives)
        record = HangRecord(
            rank=self.world.rank,
            world_size=self.world.world_size,
            host=self.world.host,
            pid=os.getpid(),
            number=self.hangs,
            detected_at=round(time.time(), 3),
            cause=cause,
            reason=reason,
            last_step=last_step,
            silent_s=round(silent_s, 3),
            after_s=round(limit, 3),
            threads=thread_stacks(self._training_ident, self.config.max_frames),
            flight_recorder=groups,
            flight_recorder_note=note,
        )
        run = self._run()
        where = "no run directory to write the hang record to"
        if run is not None:
            try:
                where = f"hang record {write_hang_record(run, record)}"
            except (OSError, ValueError) as err:
                where = f"hang record not written ({err})"
        log.warning("HANG: %s after step %d; %s", reason, last_step, where)
        if run is not None and self.world.rank == 0:
            self._log_verdict(run, self.hangs, limit)

    def _log_verdict(self, run: RunDir, number: int, limit: float) -> None:
        """Rank 0: wait (bounded) for every rank's record of this hang, then log the verdict."""
        from distanom.analysis.hangs import judge_hang, read_hang

        deadline = time.monotonic() + min(limit, 30.0) + 2 * self.config.poll_s
        while time.monotonic() < deadline and not self._stop.is_set():
            written = hang_ranks(run, number)
            if sum(rank < self.world.world_size for rank in written) >= self.world.world_size:
                break
            self._stop.wait(self.config.poll_s)
        records, _ = read_hang(run, number)
        hang = judge_hang(number, records, self.world.world_size)
        log.warning("hang verdict: %s", hang.summary())
