"""File locks: the per-key build lock, short internal locks, and in-progress temp files.

Every lock here is an ``flock`` on an open file, so the kernel drops it when the holder
dies, however it dies: a writer killed with SIGKILL never leaves a lock behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from cachebuild.errors import LockTimeout

log = logging.getLogger("cachebuild.store")

#: How long a short lock is waited for before the wait is said (its holders keep it for
#: milliseconds: a longer wait is another process stopped while holding it).
SAY_WAIT_AFTER_S = 2.0


@contextlib.contextmanager
def build_lock(path: Path, key: str, timeout: float) -> Iterator[None]:
    """Hold the build lock at ``path`` for ``key``; LockTimeout after ``timeout`` seconds.

    A negative timeout waits forever.
    """
    import filelock  # here: a process that only loads takes no build lock, nor pays the import

    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _clear_odd(path)
    lock = filelock.FileLock(str(path), timeout=timeout)
    try:
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            if timeout == 0:
                raise
            # Another build of the same target (a second `warm`, a server's background
            # build): said, so that a wait of minutes is not taken for this one building.
            log.warning("cachebuild: waiting for another build of %s (a process or thread that holds "
                        "its build lock, %s): used from the store once that build ends", key, path)
            lock.acquire()
    except filelock.Timeout:
        raise LockTimeout(
            f"timed out after {timeout:g}s waiting for the build lock of {key}: another "
            f"process (or thread) holds it, most likely while building the same target "
            f"(lock file {path}). Wait for it to finish, or raise the lock timeout.") from None
    try:
        yield
    finally:
        lock.release()


def _clear_odd(path: Path) -> None:
    """Remove what sits at ``path`` where it is no regular file (a folder, a link, left by
    damage or a hand): a lock file is made again, and the key could otherwise never be
    built. Only the store's owner can write there (the locks folder is private)."""
    import shutil
    import stat

    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    log.warning("cachebuild: removed %s, which is no lock file (%s)", path,
                "a folder" if stat.S_ISDIR(mode) else
                "a link" if stat.S_ISLNK(mode) else "not a regular file")
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)


@contextlib.contextmanager
def flocked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if needed) for a short critical section."""
    # Read-only is enough for flock, and still works on a read-only file system.
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        _wait_saying(fd, path)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the flock


def _wait_saying(fd: int, path: Path) -> None:
    """Take the exclusive flock on ``fd``; a wait longer than ``SAY_WAIT_AFTER_S`` is said
    once, naming the lock file, before waiting on (never silently for long)."""
    deadline = time.monotonic() + SAY_WAIT_AFTER_S
    while not try_flock(fd):
        if time.monotonic() >= deadline:
            log.warning("cachebuild: waiting for the lock %s, which another process holds (a cachebuild "
                        "command or server using this store, stopped or busy): it goes on "
                        "once that process releases it or ends", path)
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        time.sleep(0.05)


@contextlib.contextmanager
def flocked_shared(path: Path) -> Iterator[None]:
    """Hold a shared flock on ``path`` (created if needed) while the block runs: many
    holders at once, none while someone holds it exclusively (``try_flock``)."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def try_flock(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` without waiting; False if someone else holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def open_temp(tmp_dir: Path, stem: str) -> tuple[int, Path]:
    """Create a fresh temp file in ``tmp_dir`` and hold an flock on it while it is written.

    The flock is how cleaners tell abandoned temp files from ones still being written
    (see ``remove_if_abandoned``). Returns ``(fd, path)``; the caller writes, fsyncs and
    renames the file, then closes ``fd``.
    """
    while True:
        path = tmp_dir / f"{stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # A cleaner may have removed the file between open and flock (it saw no lock);
        # then our descriptor points at an unlinked inode, so start again.
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd, path
        except FileNotFoundError:
            pass
        os.close(fd)


def remove_if_abandoned(path: Path) -> bool:
    """Remove temp file ``path`` if no live process holds its flock; True if removed.

    A writer holds the flock from creation until after the rename, so a temp file whose
    lock can be taken belongs to a writer that died (or one that is between create and
    flock, which ``open_temp`` detects and retries).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if not try_flock(fd):
            return False
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                return False
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)
