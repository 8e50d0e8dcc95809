"""Files in a store directory, handled so that nothing found there is trusted blindly.

- ``open_regular`` opens only a regular file: a symlink is not followed and a FIFO is not
  waited on, so neither can redirect or hang a reader (``OddFile`` says what was there).
- ``remove_any`` removes whatever sits at a path, a directory tree included;
  ``remove_stored_files`` a key's blob and the files materialized from it;
  ``move_to_quarantine`` moves what sits at a path to ``quarantine/``, named by why.
- ``Scratch``: a process's private directory (0700, ours, held by an flock while the
  process lives, removed at exit), for files a loader must hand to another library by
  path; ``remove_abandoned_scratch`` removes those of processes that are gone.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .layout import Layout, check_private_dir, others_can_write
from .locking import try_flock

# No following symlinks, no blocking on a FIFO: what is opened is then checked to be a
# regular file before a byte is read.
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


class OddFile(Exception):
    """Something other than a regular file sits where a blob or materialized file should."""

    def __init__(self, what: str, inode: int | None) -> None:
        super().__init__(what)
        self.what = what
        self.inode = inode


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str]) -> int | None:
    """A read-only fd on the regular file at ``path``, or None if nothing is there.

    Raises OddFile if something else is there: a symlink is not followed and a FIFO is
    not waited on, so neither can redirect or hang a reader; and for a file owned by
    another user than us or root, who could rewrite it, or one others may write.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENODEV):
            raise
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        raise OddFile(_kind_of(st.st_mode), st.st_ino) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OddFile(_kind_of(st.st_mode), st.st_ino)
    if st.st_uid not in (os.geteuid(), 0):
        # Its owner could rewrite it in place, whatever the folders' modes say.
        os.close(fd)
        raise OddFile(f"a file owned by another user (uid {st.st_uid})", st.st_ino)
    if others_can_write(st, fd):
        # Folders opened to readers (chmod -R a+rX) let anyone reach it.
        os.close(fd)
        raise OddFile(f"a file others may write (mode {stat.S_IMODE(st.st_mode):o})",
                      st.st_ino)
    return fd


def is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def remove_any(path: str | os.PathLike[str]) -> bool:
    """Remove whatever is at ``path`` (file, link, FIFO or directory tree, never following
    links); True if something was there."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except (IsADirectoryError, PermissionError):
        if not os.path.isdir(path) or os.path.islink(path):
            raise
    shutil.rmtree(path, ignore_errors=True)
    return True


def write_all(fd: int, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    """Write every byte of ``parts`` to ``fd``, in order."""
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            written = os.write(fd, view)
            view = view[written:]


def write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` by a temp file and a rename: no reader sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def remove_stored_files(layout: Layout, key: str) -> bool:
    """Remove the blob of ``key`` and the files materialized from it (hold the key's entry
    lock); True if the blob was there."""
    blob_path = layout.blob(key)
    removed = remove_any(blob_path)
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(blob_path.parent):
            if entry.name.startswith(key + "."):
                remove_any(entry.path)
    return removed


def move_to_quarantine(layout: Layout, path: Path, reason: str, now: float) -> None:
    """Move whatever is at ``path`` (a blob, or an odd entry in its place) to quarantine/,
    named by the time and the reason; removed outright if it cannot be moved."""
    slug = "".join(c if c.isalnum() else "-" for c in reason)[:48].strip("-")
    dest = layout.quarantine / f"{path.name}.{int(now)}.{slug}"
    try:
        os.replace(path, dest)
    except FileNotFoundError:
        pass
    except OSError:
        remove_any(path)


class Scratch:
    """A process's private directory: 0700, held by an flock for the process's lifetime
    (so that cleaners know it is in use), removed at exit."""

    LOCK = ".held"

    def __init__(self, parent: Path) -> None:
        while True:
            path = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}.", dir=parent))
            fd = os.open(path / self.LOCK, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try_flock(fd)
            # A cleaner may have removed the directory between mkdtemp and flock.
            if (path / self.LOCK).exists():
                break
            os.close(fd)
        check_private_dir(path)
        self.path, self.fd, self.pid = path, fd, os.getpid()
        atexit.register(self.remove)

    def remove(self) -> None:
        if self.pid == os.getpid():
            shutil.rmtree(self.path, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.close(self.fd)


def remove_abandoned_scratch(parent: Path) -> int:
    """Remove scratch directories under ``parent`` whose process is gone; how many."""
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(parent):
            if not entry.is_dir(follow_symlinks=False):
                continue
            try:
                fd = os.open(os.path.join(entry.path, Scratch.LOCK), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                # Being created right now, or its creator died before locking it: only
                # the latter is old.
                if time.time() - entry.stat(follow_symlinks=False).st_mtime > 3600:
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed += 1
                continue
            try:
                if try_flock(fd):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed += 1
            finally:
                os.close(fd)
    return removed
