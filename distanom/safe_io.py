"""File access that a hostile run directory cannot redirect, block or blow up.

Owns the low-level rules every run-directory writer and reader follows (docs/trust.md):

- Writers walk from a directory they trust (the run directory) one component at a time
  with `O_NOFOLLOW | O_DIRECTORY`, so a symlink planted in place of a folder distanom
  made (steps/, captures/step_N/, requests/) is refused, never written through; files are
  created or appended with `O_NOFOLLOW` relative to that folder's descriptor, and a
  temporary file is renamed into place within the same descriptor.
- Readers open with `O_NONBLOCK` (a FIFO never blocks), accept regular files only (a
  symlink to /dev/zero is a character device: refused) and read at most a cap.
- JSON is parsed only after its nesting depth is checked, so a deeply nested file is a
  one-line error, never a RecursionError.

Reads and writes only the paths it is given; no distanom import (every module may use it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

MAX_JSON_DEPTH = 64  # distanom's own files nest a few levels; deeper is damage
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


class UnsafePathError(OSError):
    """A path component is a symlink or not what distanom made (refused, not followed)."""


def _refused(path: Path | str, what: str) -> UnsafePathError:
    return UnsafePathError(errno.ELOOP, f"{what} (refused)", str(path))


@contextlib.contextmanager
def open_dir(root: Path, parts: Sequence[str] = (), *, create: bool = False) -> Iterator[int]:
    """A descriptor of `root`/`parts...`; every component in `parts` must be a real
    directory (a symlink raises UnsafePathError); `create` makes missing ones (mode 0777
    less the umask, as mkdir does). `root` itself is trusted as given."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refused(root.joinpath(*parts), "a symlink or not a directory") from None
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def write_atomic_at(
    dir_fd: int, name: str, data: bytes, mode: int, *, durable: bool = True
) -> None:
    """Write `data` to `name` in the folder `dir_fd` through a temporary file (created
    exclusively, never through a link, fsynced when `durable`) renamed over it."""
    temp = f".{name}.{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise


def write_atomic(path: Path, data: bytes, mode: int, *, durable: bool = True) -> None:
    """`write_atomic_at` into `path`'s folder, whose last component must not be a link."""
    try:
        fd = os.open(path.parent, _DIR_FLAGS)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refused(path.parent, "a symlink or not a directory") from None
        raise
    try:
        write_atomic_at(fd, path.name, data, mode, durable=durable)
    finally:
        os.close(fd)


def open_append_at(dir_fd: int, name: str, mode: int, *, read: bool = False) -> int:
    """A descriptor appending to the regular file `name` in `dir_fd` (created if missing);
    a link, a FIFO or a device there raises UnsafePathError without blocking."""
    access = os.O_RDWR if read else os.O_WRONLY
    flags = access | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO):
            raise _refused(name, "a symlink or a FIFO") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(name, "not a regular file")
    os.set_blocking(fd, True)
    return fd


def unlink_at(dir_fd: int, name: str) -> int | None:
    """Remove the file `name` from `dir_fd` (a link itself, never its target); its size,
    or None when it was not there."""
    try:
        size = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    return size


def take_lock(dir_fd: int, name: str, timeout_s: float) -> int:
    """An exclusive flock on the lock file `name` (mode 0600, ours, never a link), waited
    for at most `timeout_s`; its descriptor (closing it releases the lock).

    Raises TimeoutError when another process holds it that long, UnsafePathError when the
    file is a link, not regular, or readable by others and not ours to repair."""
    fd = open_append_at(dir_fd, name, 0o600)
    try:
        info = os.fstat(fd)
        if info.st_mode & 0o077:
            if info.st_uid != os.geteuid():
                raise _refused(name, "a lock file owned by someone else and open to others")
            os.fchmod(fd, 0o600)
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{name}: lock held longer than {timeout_s:.0f} s") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: Path, *, follow: bool = True) -> int:
    """A read-only descriptor of the regular file `path`, opened without blocking (a
    FIFO, a device, a directory, or a link when `follow` is False: UnsafePathError)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _refused(path, "a symlink") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(path, "not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_capped(path: Path, max_bytes: int, *, follow: bool = True) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` (OSError beyond, or for a
    FIFO, a device or a directory; a link is refused too when `follow` is False)."""
    fd = open_regular(path, follow=follow)
    try:
        if os.fstat(fd).st_size > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))
        chunks: list[bytes] = []
        left = max_bytes + 1  # the file may be growing: bounded again
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def json_depth(data: bytes) -> int:
    """The deepest nesting of `[`/`{` in JSON text (strings skipped; an unterminated one
    counts its brackets, an upper bound)."""
    depth = deepest = 0
    for byte in _STRING.sub(b"", data).translate(None, _BRACKETS):
        depth += 1 if byte in (0x5B, 0x7B) else -1
        deepest = max(deepest, depth)
    return deepest


def parse_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON text whose nesting is at most `max_depth`; ValueError otherwise (and for
    NaN/Infinity, which distanom never writes)."""
    if json_depth(data) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON number")
