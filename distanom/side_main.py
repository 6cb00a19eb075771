"""A rank's side process (started by `side_link` with `python -c`, this module's `main`):
the work of the rank's agent that needs nothing of the training process but its data,
done where it does not hold the training process's GIL. Today that is the rank's steps
file (steps/rank<R>.csv): the rows of each round, formatted and appended here
(`step_log.StepLog`, the same writer and bytes as in the process), flushed when the
rank asks. No torch is imported here.

It reads `side_frames` frames from its socket until the rank sends `END` or the socket
ends, then flushes, closes the file and exits. It never outlives the rank by more than
a second: besides the socket's end (which a child of the rank holding its end open
would delay) it checks every second that its parent is still the rank. Signals that
end a job's processes (Ctrl-C's SIGINT, a scheduler's SIGTERM to every process of the
job) are ignored: the rank's end ends it, after the rows it was sent, so a rank that
outlives the signal loses none. A stream it cannot read is logged once (stderr, with
the rank's prefix) and ends it; the rank then writes the file itself (`side_link`). A
failed write (a full disk, a removed run directory) is said once here and rows stop,
as they would in the rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
from pathlib import Path

from distanom.health import Health
from distanom.side_frames import (
    END,
    FLUSH,
    FRAME_HEAD,
    MAX_FRAME_BYTES,
    OPEN,
    READY,
    STEPS,
    unpack_steps,
)
from distanom.step_log import StepLog

log = logging.getLogger("distanom.side")

PARENT_CHECK_S = 1.0
READ_BYTES = 1 << 20


class SideProcess:
    """The side process's state: its steps file and the bytes of a frame not yet whole."""

    def __init__(self) -> None:
        self.health = Health()
        self.steps = StepLog(self.health)
        self._pending = bytearray()
        self.ended = False  # the rank sent END: nothing more comes

    def feed(self, data: bytes) -> None:
        """Act on every whole frame in `data` (with what was left of the last read).
        ValueError on a damaged stream."""
        pending = self._pending
        pending += data
        at = 0
        while len(pending) - at >= FRAME_HEAD.size and not self.ended:
            kind, size = FRAME_HEAD.unpack_from(pending, at)
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"a frame of {size} bytes")
            end = at + FRAME_HEAD.size + size
            if end > len(pending):
                break
            self._act(kind, bytes(pending[at + FRAME_HEAD.size : end]))
            at = end
        del pending[:at]

    def _act(self, kind: int, payload: bytes) -> None:
        if kind == STEPS:
            self.steps.write(unpack_steps(payload))
        elif kind == FLUSH:
            self.steps.flush()
        elif kind == END:
            self.ended = True
        elif kind == OPEN:
            path = Path(os.fsdecode(payload))
            self.health.run_dir = path.parent.parent
            try:
                self.steps.open(path)
            except OSError as err:
                self.health.warn_once("open", "steps file %s: %s", path, err.strerror or err)
        else:
            raise ValueError(f"a frame of unknown kind {kind}")

    def close(self) -> None:
        """Hand what was written to the OS and close the file."""
        self.steps.flush()
        self.steps.close()


def serve(read_fd: int, parent_pid: int, side: SideProcess) -> None:
    """Read frames until the rank says it is done (END), the socket ends, or the parent
    is gone."""
    poller = select.poll()  # any fd number (select refuses those past 1023)
    poller.register(read_fd, select.POLLIN)
    while True:
        if not poller.poll(int(PARENT_CHECK_S * 1000)):
            if os.getppid() != parent_pid:  # the rank died; a child of it holds its end
                return
            continue
        data = os.read(read_fd, READ_BYTES)
        if not data:
            return
        side.feed(data)
        if side.ended:
            return


def main(argv: list[str] | None = None) -> int:
    """The side process's life: its signals and log, ready, frames until the end."""
    parser = argparse.ArgumentParser(prog="python -m distanom.side_main")
    parser.add_argument("--fd", type=int, required=True)  # its end of the socketpair
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--label", default="side")
    args = parser.parse_args(argv)
    for ended_by_the_rank in (signal.SIGINT, signal.SIGTERM):  # the module docstring
        signal.signal(ended_by_the_rank, signal.SIG_IGN)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"[distanom {args.label} side] %(levelname)s %(message)s")
    )
    root = logging.getLogger("distanom")
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    root.propagate = False
    side = SideProcess()
    try:
        os.write(args.fd, READY)
        serve(args.fd, args.parent_pid, side)
    except (OSError, ValueError) as err:
        log.warning("side process: %s; the rank does its work itself from now on", err)
        return 1
    finally:
        side.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
