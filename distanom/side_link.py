"""The rank's end of its side process (`side_main`): starting it, handing it work, and
doing that work in this process instead when it cannot (control thread).

`SideSteps` is the rank's steps file as the control loop sees it (`open`, `write`,
`flush`, `close`, as `step_log.StepLog`): with `control.side_process` on, the rows are
formatted and written by the side process, which the control loop feeds one frame per
round (`side_frames`); otherwise, and until the side process says it reads (the control
loop never waits for it), or once it cannot take the work, the same `StepLog` writes
the file here.

The side process is started with `exec` (never a bare fork: the rank may hold CUDA),
with the distanom it was imported from first on its path. It ends at the `END` the
rank's close sends, or when the socket ends (`side_main`); a child the rank forks (a
DataLoader worker) closes its copy of the socket at once (`os.register_at_fork`), so it
neither writes to it nor keeps it open. Writes never block the control loop: what the
socket cannot take now waits in a backlog sent with the next write. The rank writes the
file itself when the side process did not start or was not ready within
`READY_TIMEOUT_S`, when it ended, or when its backlog passes `MAX_BACKLOG_BYTES` (it is
then stopped, and the frames it got none of are written here): each said once, training
goes on. Rows already sent to a side process that died are lost.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from distanom.health import Health
from distanom.side_frames import (
    END,
    FLUSH,
    FRAME_HEAD,
    OPEN,
    READY,
    STEPS,
    frame,
    pack_steps,
    unpack_steps,
)
from distanom.step_log import StepLog
from distanom.step_record import StepRecord

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0  # imports on a loaded node; the control loop waits, training does not
EXIT_TIMEOUT_S = 5.0  # at the end: the side process writes the last rows and exits
MAX_BACKLOG_BYTES = 16 << 20  # ~1,300 rounds of 64 steps: a side process that stopped reading
SEND_BUFFER_BYTES = 1 << 20  # asked of the kernel (it caps it at net.core.wmem_max)
_NO_SIGPIPE = getattr(socket, "MSG_NOSIGNAL", 0)  # Linux; elsewhere Python ignores SIGPIPE


# links of this process, closed in any child it forks (a DataLoader worker): the child
# must neither write to them nor keep the side process's socket open after the rank ends
_LINKS: weakref.WeakSet[SideLink] = weakref.WeakSet()


def _close_in_child() -> None:
    for link in list(_LINKS):
        link.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class SideLink:
    """A running side process and the socket to it (a socketpair: a write to a side
    process that died fails with EPIPE and never raises SIGPIPE, whatever the script did
    with that signal). Not thread-safe: its one user holds `SideSteps`' lock."""

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.process = process
        self._sock: socket.socket | None = sock
        self._frames: collections.deque[bytes] = collections.deque()  # not yet sent whole
        self._first_sent = 0  # bytes of the first frame already sent
        self._backlog_bytes = 0
        self._ready = False  # it said it reads (`ready`)
        self.spawned_at = time.monotonic()
        self.down: str | None = None  # why it can take no more work
        _LINKS.add(self)

    @classmethod
    def spawn(cls, label: str) -> SideLink:
        """Start a side process (not waiting for it: `ready`); OSError, or ValueError where
        passing a descriptor is not supported, when it cannot be started."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
        command = [
            sys.executable, "-m", "distanom.side_main", "--fd", str(theirs.fileno()),
            "--parent-pid", str(os.getpid()), "--label", label,
        ]  # fmt: skip
        try:
            process = subprocess.Popen(
                command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(process, ours)

    @classmethod
    def start(cls, label: str, ready_timeout_s: float = READY_TIMEOUT_S) -> SideLink:
        """`spawn`, then wait until it reads; OSError when it cannot start or is not ready
        within `ready_timeout_s` (it is then stopped)."""
        link = cls.spawn(label)
        deadline = time.monotonic() + ready_timeout_s
        while not link.ready(max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                link.stop()
                raise OSError(errno.ETIMEDOUT, f"not ready within {ready_timeout_s:.0f} s")
        return link

    def ready(self, wait_s: float = 0.0) -> bool:
        """Whether the side process has said it reads (waiting up to `wait_s` for it);
        OSError when it ended before it did."""
        if self._ready:
            return True
        sock = self._sock
        if sock is None:
            raise OSError(errno.EPIPE, "stopped")
        said = b""
        with contextlib.suppress(OSError):
            readable, _, _ = select.select([sock], [], [], wait_s)
            said = sock.recv(1) if readable else b"?"
        if said == READY:
            self._ready = True
            sock.setblocking(False)
            with contextlib.suppress(OSError):  # a bigger buffer: fewer backlogs
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            return True
        if said != b"?" or self.process.poll() is not None:  # the socket ended: it did
            self.stop()
            raise OSError(errno.EPIPE, f"it ended before it was ready ({self._exit_status()})")
        return False

    def send(self, data: bytes) -> bool:
        """Queue `data` (a whole frame, or b"" to retry) and send what the socket takes
        now; False once the link is down (`down` says why)."""
        if self.down is not None:
            return False
        frames = self._frames
        if data:
            frames.append(data)
            self._backlog_bytes += len(data)
        sock = self._sock
        try:
            while frames and sock is not None:
                first = frames[0]
                sent = sock.send(memoryview(first)[self._first_sent :], _NO_SIGPIPE)
                self._first_sent += sent
                self._backlog_bytes -= sent
                if self._first_sent < len(first):
                    break  # the buffer is full: the rest goes with a later send
                frames.popleft()
                self._first_sent = 0
        except BlockingIOError:
            pass
        except OSError as err:  # EPIPE, ECONNRESET: it ended
            self.down = f"it ended ({self._exit_status()}; {err.strerror or err})"
            return False
        if self._backlog_bytes > MAX_BACKLOG_BYTES:
            self.down = f"it fell {self._backlog_bytes >> 20} MiB behind and was stopped"
            self.stop()
            return False
        return True

    def unsent(self) -> list[bytes]:
        """The frames the side process got none of (after `down`: the rank does their
        work itself; a frame it got part of is lost)."""
        frames = list(self._frames)
        return frames[1:] if frames and self._first_sent else frames

    def finish(self, timeout_s: float = EXIT_TIMEOUT_S) -> bool:
        """Send what is left and `END`, close the socket and wait for the side process to
        exit, within `timeout_s` in all; whether it exited (else it is left to end alone)."""
        deadline = time.monotonic() + timeout_s
        self.send(frame(END, b""))
        while self.down is None and self._frames and self._sock is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            select.select([], [self._sock], [], left)
            if not self.send(b""):
                break
        self._close()
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self) -> None:
        """Kill the side process (it takes no more work) and reap it."""
        self._close()
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(EXIT_TIMEOUT_S)

    def forked(self) -> None:
        """In a child this process forked: the link is the parent's; this copy lets go of
        its socket and takes no work."""
        self.down = "the rank's, not this forked child's"
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        # as if reaped: `Popen` then never waits for, signals or warns about the parent's
        # side process from here
        self.process.returncode = 0

    def _exit_status(self) -> str:
        code = self.process.poll()
        return "still running" if code is None else f"exit status {code}"

    def _close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class SideSteps:
    """This rank's steps file, written by the side process or, failing it, here; the
    same calls as `StepLog` (see the module docstring)."""

    def __init__(self, health: Health, label: str, *, use_side: bool) -> None:
        self._health = health
        self._label = label
        self._use_side = use_side
        self.here = StepLog(health)  # the writer in this process, when the side has none
        self.link: SideLink | None = None  # the side process that writes the file
        self._starting: SideLink | None = None  # started, not yet ready
        self._path: Path | None = None
        self._lock = threading.Lock()  # `close` at exit against an abandoned control thread
        # where the rows are written, for status.json (`agent_cost`): one short phrase
        self.state = "side process" if use_side else "control thread (control.side_process off)"
        self._cpu_ns = 0  # the side process's CPU time, as last read

    def open(self, path: Path) -> None:
        """Start the file here (raises OSError: the caller says what it means for the run)
        and start a side process, which takes the file over once it says it reads (the
        control loop does not wait for it: rows are written here until then)."""
        self.here.open(path)  # made and checked here: the header, the permissions
        self._path = path
        if not self._use_side:
            return
        try:
            self._starting = SideLink.spawn(self._label)
        except Exception as err:  # OSError; ValueError where pass_fds is not supported
            self._not_started((err.strerror if isinstance(err, OSError) else None) or str(err))

    def write(self, items: list[StepRecord]) -> None:
        """Append the steps' rows (one frame for the side process)."""
        if not items:
            return
        with self._lock:
            link = self.link or self._handed_over()
            if link is None:
                self.here.write(items)
            elif not link.send(frame(STEPS, pack_steps(items))):
                self._take_over(link)

    def flush(self) -> None:
        """Hand what was written to the OS (readers see it)."""
        with self._lock:
            link = self.link or self._handed_over()
            if link is None:
                self.here.flush()
            elif not link.send(frame(FLUSH, b"")):
                self._take_over(link)

    def close(self) -> None:
        """The last rows out, the side process ended (within `EXIT_TIMEOUT_S`), the file
        closed; never raises (at exit)."""
        with self._lock:
            link, self.link = self.link, None
            starting, self._starting = self._starting, None
            if starting is not None:  # never said it reads: nothing of the file is its
                starting.stop()
            if link is not None and not link.finish():
                log.debug("side process still writing at exit; left to end on its own")
            if link is not None and link.down is not None:  # it ended before the last rows
                self._take_over(link)
            self.here.close()

    def _handed_over(self) -> SideLink | None:
        """The side process, if it has just said it reads: the file is closed here and
        handed to it (lock held)."""
        starting = self._starting
        if starting is None or self._path is None:
            return None
        try:
            if not starting.ready():
                if time.monotonic() - starting.spawned_at < READY_TIMEOUT_S:
                    return None
                starting.stop()
                raise OSError(errno.ETIMEDOUT, f"not ready within {READY_TIMEOUT_S:.0f} s")
        except OSError as err:
            self._starting = None
            self._not_started(err.strerror or str(err))
            return None
        self._starting = None
        self.here.close()  # flushed: the side process appends after these rows
        self.link = starting
        starting.send(frame(OPEN, os.fsencode(self._path)))
        return starting

    def cpu_ns(self) -> int | None:
        """CPU time the side process has used so far (Linux's /proc; its last reading
        once it has ended), None where it never ran or it cannot be read."""
        link = self.link or self._starting
        if link is not None:
            self._cpu_ns = max(self._cpu_ns, _process_cpu_ns(link.process.pid) or 0)
        return self._cpu_ns if self._cpu_ns or link is not None else None

    def _not_started(self, why: str) -> None:
        self.state = f"control thread (side process not started: {why})"
        self._health.warn_once(
            "side", "distanom: side process not started (%s); its work runs in this process", why
        )

    def _take_over(self, link: SideLink) -> None:
        """The side process took no more: write the file here from now on, starting with
        the rows it was not sent."""
        self.link = None
        self.cpu_ns()  # its last reading, kept
        self.state = f"control thread (side process: {link.down})"
        self._health.warn_once(
            "side-down", "distanom: side process: %s; its work runs in this process", link.down
        )
        if self._path is None:
            return
        try:
            self.here.open(self._path)
        except OSError as err:
            self._health.warn_write_failed(
                "steps", "steps file: %s; step times not recorded", err.strerror or err
            )
            return
        for records in _unsent_steps(link.unsent()):
            self.here.write(records)


def _unsent_steps(frames: list[bytes]) -> list[list[StepRecord]]:
    """The step records in whole frames the side process never got."""
    out = []
    for whole in frames:
        kind, _size = FRAME_HEAD.unpack_from(whole)
        if kind == STEPS:
            with contextlib.suppress(ValueError):
                out.append(unpack_steps(whole[FRAME_HEAD.size :]))
    return out


def _process_cpu_ns(pid: int) -> int | None:
    """User and system CPU time of process `pid` (ns) from /proc/<pid>/stat; None where
    there is no such file (not Linux, the process reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read(4096).rsplit(b")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
        return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
