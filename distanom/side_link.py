"""The rank's end of its side process (`side_main`): starting it, handing it work, and
doing that work in this process instead when it cannot (control thread).

`SideSteps` is the rank's steps file as the control loop sees it (`open`, `write`,
`flush`, `close`, as `step_log.StepLog`): with `control.side_process` on, the rows are
formatted and written by the side process, which the control loop feeds frames of up
to `FRAME_STEPS` steps (`side_frames`); otherwise, and until the side process says it
reads (the control loop never waits for it), or once it cannot take the work, the same
`StepLog` writes the file here.

The side process is started with `exec` (never a bare fork: the rank may hold CUDA) as
`python -c`, with this distanom's folder in place of the working directory on its path.
It ends at the `END` the rank's close sends, or when the socket ends (`side_main`); a
child the rank forks (a DataLoader worker) closes its copies of the sockets at once
(`os.register_at_fork`), and a forked copy of `SideSteps` does nothing. Writes do not
block the control loop: what the socket cannot take now waits in a backlog sent with
the next write (stopping a side process, a kill and its reaping, is the one wait). The
rank writes the file itself when the side process did not start or was not ready within
`READY_TIMEOUT_S`, when it ended, when it took nothing of a backlog past
`MAX_BACKLOG_BYTES` for `STALL_S` (or the backlog passed `HARD_BACKLOG_BYTES`), or when
it had not taken the last rows `EXIT_TIMEOUT_S` into the close: it is stopped, and the
frames it got none of are written here, then every row after. Said once; training goes
on. Rows already sent to a side process that died are lost.
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

READY_TIMEOUT_S = 30.0  # imports on a loaded node; the control loop does not wait for it
EXIT_TIMEOUT_S = 5.0  # at the end: the side process writes the last rows and exits
# A backlog past MAX_BACKLOG_BYTES that the side process has taken nothing of for
# STALL_S stops it (a healthy one catching up after a long stall is left to); past
# HARD_BACKLOG_BYTES it is stopped whatever (the rank's memory)
MAX_BACKLOG_BYTES = 16 << 20
STALL_S = 10.0
HARD_BACKLOG_BYTES = 256 << 20
FRAME_STEPS = 1024  # steps per frame (~180 kB): a frame is never much of a backlog
SEND_BUFFER_BYTES = 1 << 20  # asked of the kernel (it caps it at net.core.wmem_max)
_NO_SIGPIPE = getattr(socket, "MSG_NOSIGNAL", 0)  # Linux; elsewhere Python ignores SIGPIPE
# The side process's interpreter, started with -c so that the working directory is not
# on its path (`python -m` puts it first: a distanom/ there would be imported instead)
_SIDE_MAIN = (
    "import sys; sys.path[0] = {root!r}; from distanom.side_main import main; "
    "raise SystemExit(main())"
)

# sockets of this process's links (both ends while one starts), closed in any child it
# forks (a DataLoader worker): the child must neither write to them nor keep the side
# process's socket open after the rank ends
_SOCKETS: weakref.WeakSet[socket.socket] = weakref.WeakSet()
_LINKS: weakref.WeakSet[SideLink] = weakref.WeakSet()


def _close_in_child() -> None:
    for link in list(_LINKS):
        link.forked()
    for sock in list(_SOCKETS):
        with contextlib.suppress(OSError):
            sock.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def _wait(sock: socket.socket, *, write: bool, timeout_s: float) -> bool:
    """Whether `sock` is ready to read (or write) within `timeout_s` (poll: any fd
    number; select refuses those past 1023, which a busy rank reaches)."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT if write else select.POLLIN)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))


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
        self._progress_at = time.monotonic()  # the backlog was last empty or taken from
        self._ready = False  # it said it reads (`ready`)
        self.spawned_at = time.monotonic()
        self.cpu_ns = 0  # its CPU time as last read (`read_cpu`)
        # its CPU time when it said it reads (start-up, imports); None until it has
        self.startup_cpu_ns: int | None = None
        self.down: str | None = None  # why it can take no more work
        _LINKS.add(self)

    @classmethod
    def spawn(cls, label: str) -> SideLink:
        """Start a side process (not waiting for it: `ready`); OSError, or ValueError where
        passing a descriptor is not supported, when it cannot be started."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        _SOCKETS.add(ours)  # from now on: a fork meanwhile must not keep them
        _SOCKETS.add(theirs)
        root = str(Path(__file__).resolve().parent.parent)
        command = [
            sys.executable, "-c", _SIDE_MAIN.format(root=root), "--fd", str(theirs.fileno()),
            "--parent-pid", str(os.getpid()), "--label", label,
        ]  # fmt: skip
        try:
            process = subprocess.Popen(
                command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL
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
            said = sock.recv(1) if _wait(sock, write=False, timeout_s=wait_s) else b"?"
        if said == READY:
            self._ready = True
            self.startup_cpu_ns = _process_cpu_ns(self.process.pid)
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
                self._progress_at = time.monotonic()
                if self._first_sent < len(first):
                    break  # the buffer is full: the rest goes with a later send
                frames.popleft()
                self._first_sent = 0
        except BlockingIOError:
            pass
        except OSError as err:  # EPIPE, ECONNRESET: it ended, or is ending
            self.down = f"it ended ({self._exit_status(wait_s=1.0)}; {err.strerror or err})"
            if self.process.returncode is None:  # its socket is gone: of no more use
                self.stop()
            return False
        if not frames:
            self._progress_at = time.monotonic()
        backlog = self._backlog_bytes
        stalled = time.monotonic() - self._progress_at > STALL_S
        if backlog > HARD_BACKLOG_BYTES or (backlog > MAX_BACKLOG_BYTES and stalled):
            self.down = f"it took nothing of a {backlog >> 20} MiB backlog and was stopped"
            self.stop()
            return False
        return True

    def unsent(self) -> list[bytes]:
        """The frames the side process got none of (after `down`: the rank does their
        work itself; a frame it got part of is lost)."""
        frames = list(self._frames)
        return frames[1:] if frames and self._first_sent else frames

    def finish(self, timeout_s: float | None = None) -> bool:
        """Send what is left and `END`, close the socket and wait for the side process to
        exit, within `timeout_s` (`EXIT_TIMEOUT_S`) in all; whether it did. One that has not taken
        everything by then is stopped (`down` says so: the rank writes the rest)."""
        timeout_s = EXIT_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        self.send(frame(END, b""))
        while self.down is None and self._frames and self._sock is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                self.down = f"it had not taken the last rows after {timeout_s:.0f} s; stopped"
                self.stop()
                return False
            _wait(self._sock, write=True, timeout_s=left)
            self.send(b"")
        self._close()
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        finally:
            self.read_cpu()
        return True

    def stop(self) -> None:
        """Kill the side process (it takes no more work) and reap it."""
        self._close()
        with contextlib.suppress(OSError):
            self.process.kill()
        self.read_cpu()  # a killed process keeps its figures until it is reaped
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(EXIT_TIMEOUT_S)

    def read_cpu(self) -> int:
        """Its CPU time so far (ns; Linux's /proc), kept once it has been reaped."""
        if self.process.returncode is None:
            self.cpu_ns = max(self.cpu_ns, _process_cpu_ns(self.process.pid) or 0)
        return self.cpu_ns

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

    def _exit_status(self, wait_s: float = 0.0) -> str:
        """ "exit status N", or "still running"; waits up to `wait_s` for an exit under
        way (its socket closes a moment before it can be reaped)."""
        self.read_cpu()  # before it is reaped
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(wait_s) if wait_s else self.process.poll()
        code = self.process.returncode
        return "still running" if code is None else f"exit status {code}"

    def _close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class SideSteps:
    """This rank's steps file, written by the side process or, failing it, here; the
    same calls as `StepLog` (see the module docstring). Never raises."""

    def __init__(self, health: Health, label: str, *, use_side: bool) -> None:
        self._health = health
        self._label = label
        self._use_side = use_side
        self.here = StepLog(health)  # the writer in this process, when the side has none
        self.link: SideLink | None = None  # the side process that writes the file
        self._starting: SideLink | None = None  # started, not yet ready
        self._path: Path | None = None
        self._lock = threading.Lock()  # `close` at exit against an abandoned control thread
        self._pid = os.getpid()  # a forked child's copy (its lock maybe held) does nothing
        # where the rows are written, for status.json (`agent_cost`): one short phrase
        self.state = "side process" if use_side else "control thread (control.side_process off)"
        self._ran: SideLink | None = None  # the side process that ran, for its CPU time

    def open(self, path: Path) -> None:
        """Start the file here (raises OSError: the caller says what it means for the run)
        and start a side process, which takes the file over once it says it reads (the
        control loop does not wait for it: rows are written here until then)."""
        self.here.open(path)  # made and checked here: the header, the permissions
        self._path = path
        if not self._use_side:
            return
        try:
            self._starting = self._ran = SideLink.spawn(self._label)
        except Exception as err:  # OSError; ValueError where pass_fds is not supported
            self._not_started((err.strerror if isinstance(err, OSError) else None) or str(err))

    def write(self, items: list[StepRecord]) -> None:
        """Append the steps' rows (frames of up to FRAME_STEPS steps for the side process)."""
        if not items or os.getpid() != self._pid:
            return
        with self._lock:
            try:
                link = self.link or self._handed_over()
                if link is None:
                    self.here.write(items)
                    return
                for at in range(0, len(items), FRAME_STEPS):
                    if not link.send(frame(STEPS, pack_steps(items[at : at + FRAME_STEPS]))):
                        self._take_over(link)
                        self.here.write(items[at + FRAME_STEPS :])
                        return
            except Exception as err:  # never into the control loop
                self._failed(err)

    def flush(self) -> None:
        """Hand what was written to the OS (readers see it)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            try:
                link = self.link or self._handed_over()
                if link is None:
                    self.here.flush()
                elif not link.send(frame(FLUSH, b"")):
                    self._take_over(link)
            except Exception as err:
                self._failed(err)

    def close(self) -> None:
        """The last rows out, the side process ended (within `EXIT_TIMEOUT_S`; else
        stopped, and the rows it had not taken written here), the file closed; never
        raises (at exit)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            link, self.link = self.link, None
            starting, self._starting = self._starting, None
            try:
                if starting is not None:  # never said it reads: nothing of the file is its
                    starting.stop()
                if link is not None and not link.finish() and link.down is None:
                    log.debug("side process still exiting at the end; left to end on its own")
                if link is not None and link.down is not None:  # the last rows are not its
                    self._take_over(link)
            except Exception as err:
                self.link = link  # `_failed` stops it
                self._failed(err)
            self.here.close()

    def cpu_ns(self) -> tuple[int, int] | None:
        """CPU time the side process has used so far, and of that its start-up's (until
        it said it reads); ns, Linux's /proc (its last reading once it has ended). None
        where none ran, it never said it reads (all it did was start up) or /proc
        cannot be read."""
        ran = self._ran
        if ran is None or ran.startup_cpu_ns is None:
            return None
        used = ran.read_cpu()
        return (used, min(ran.startup_cpu_ns, used)) if used else None

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

    def _not_started(self, why: str) -> None:
        self.state = f"control thread (side process not started: {why})"
        self._health.warn_once(
            "side", "distanom: side process not started (%s); its work runs in this process", why
        )

    def _failed(self, err: Exception) -> None:
        """Something unforeseen in handing rows over: the side process is stopped and the
        rank writes the file itself from here (said once)."""
        link, self.link = self.link, None
        starting, self._starting = self._starting, None
        for side in (link, starting):
            if side is not None:
                with contextlib.suppress(Exception):
                    side.stop()
        self.state = f"control thread (side process: failed: {err})"
        self._health.warn_once(
            "side-down", "distanom: side process: failed (%s); its work runs in this process", err
        )
        if self._path is not None and link is not None:
            with contextlib.suppress(OSError):
                self.here.open(self._path)

    def _take_over(self, link: SideLink) -> None:
        """The side process took no more: write the file here from now on, starting with
        the rows it was not sent."""
        self.link = None
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
