"""Why the index lock is distanom's own flock and not filelock (docs/trust.md, "The
index lock"): each guarantee of the lock is checked against both. distanom's
`safe_io.take_lock` must keep every one; filelock's `FileLock` is expected to fail the
ones marked `xfail(strict=True)`, so a filelock release that starts keeping them fails
this file and the decision is looked at again. Skipped where filelock is not installed
(torch depends on it, so CI has it)."""

from __future__ import annotations

import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from distanom.safe_io import UnsafePathError, open_dir, take_lock

filelock = pytest.importorskip("filelock")

TIMEOUT_S = 0.3
LOCK_NAME = "index.jsonl.lock"

Locker = Callable[[Path], AbstractContextManager[None]]


@contextmanager
def distanom_lock(folder: Path) -> Iterator[None]:
    with open_dir(folder) as fd:
        lock = take_lock(fd, LOCK_NAME, TIMEOUT_S)
        try:
            yield
        finally:
            os.close(lock)


@contextmanager
def filelock_lock(folder: Path) -> Iterator[None]:
    with filelock.FileLock(str(folder / LOCK_NAME), timeout=TIMEOUT_S, mode=0o600):
        yield


# what either lock may raise when it refuses: distanom's UnsafePathError is an OSError,
# filelock's Timeout a TimeoutError
REFUSED = (OSError, TimeoutError)
FILELOCK_FAILS = pytest.mark.xfail(
    strict=True, raises=AssertionError, reason="filelock does not keep this guarantee"
)


def _lockers(*filelock_marks: pytest.MarkDecorator) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(
        "locker",
        [
            pytest.param(distanom_lock, id="distanom"),
            pytest.param(filelock_lock, id="filelock", marks=filelock_marks),
        ],
    )


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    old = os.umask(0o022)
    try:
        yield tmp_path
    finally:
        os.umask(old)


@_lockers()
def test_a_link_at_the_lock_path_is_refused_and_never_followed(
    locker: Locker, folder: Path
) -> None:
    victim = folder / "victim"
    victim.write_text("precious")
    victim.chmod(0o644)
    (folder / LOCK_NAME).symlink_to(victim)
    with pytest.raises(REFUSED), locker(folder):
        pass
    assert victim.read_text() == "precious"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644


@_lockers()
def test_a_new_lock_file_is_private(locker: Locker, folder: Path) -> None:
    with locker(folder):
        pass
    assert stat.S_IMODE((folder / LOCK_NAME).stat().st_mode) == 0o600


@_lockers()
def test_a_held_lock_is_waited_for_a_bounded_time(locker: Locker, folder: Path) -> None:
    with locker(folder):
        pass
    with open(folder / LOCK_NAME, "rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        started = time.monotonic()
        with pytest.raises(TimeoutError), locker(folder):
            pass
        assert time.monotonic() - started < 3.0


@_lockers(FILELOCK_FAILS)
def test_a_planted_fifo_is_refused(locker: Locker, folder: Path) -> None:
    """A FIFO is no lock file: whoever planted it (mode 0666) can open it and hold the
    flock. filelock opens it O_NONBLOCK, takes the flock on it and calls it acquired."""
    os.mkfifo(folder / LOCK_NAME, 0o666)
    started = time.monotonic()
    acquired = False
    try:
        with locker(folder):
            acquired = True
    except REFUSED:
        pass
    assert not acquired, "the lock was taken on a FIFO"
    assert time.monotonic() - started < 1.0


@_lockers(FILELOCK_FAILS)
def test_a_lock_left_open_to_others_is_made_private(locker: Locker, folder: Path) -> None:
    """A lock file of ours left 0666 (an older version, a planted copy renamed) lets any
    user open it and hold the flock, failing every index write after its wait.
    filelock sets the mode only on a file it creates, and keeps using the open one."""
    lock = folder / LOCK_NAME
    lock.write_text("")
    lock.chmod(0o666)
    with locker(folder):
        pass
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


def test_distanom_refuses_a_foreign_lock_open_to_others_at_once(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same file owned by someone else cannot be repaired: refused without a wait
    (filelock would wait its whole timeout on every index write while they hold it)."""
    lock = folder / LOCK_NAME
    lock.write_text("")
    lock.chmod(0o666)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(lock).st_uid + 1)
    started = time.monotonic()
    with pytest.raises(UnsafePathError), distanom_lock(folder):
        pass
    assert time.monotonic() - started < TIMEOUT_S
