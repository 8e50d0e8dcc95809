"""Files made from a store's verified payloads, for loaders that need a path (a package to
dlopen), and private directories for the files a loader writes itself.

What ``Materializer`` promises, for one store:

- **A file holds the verified payload, or is not handed out.** It is made once beside its
  blob (``objects/ab/<key><suffix>``, mode 0500), written to a temp file, fsync'd and
  renamed; later calls and processes reuse it only after its size and checksum match the
  record. Anything but a regular file in its place is moved to quarantine (a writable
  store) or ignored (a read-only one), and never followed.
- **A key deleted while its file is written leaves no file** (the rename happens under the
  key's entry lock, after checking that the key is still recorded).
- **A full disk still loads.** The payload then goes to an anonymous memory file (a
  ``/proc/self/fd`` path that lives as long as the store), said once per file.
- **Scratch directories are private.** One per process (0700, made by us and checked like
  the store, removed at exit; ``gc`` removes those of processes that are gone), on disk in
  the store or in memory (``/dev/shm``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path
from typing import Any

import xxhash

from cachebuild.errors import StoreError

from .files import OddFile, Scratch, is_regular, move_to_quarantine, open_regular, write_all
from .index import Index
from .layout import Layout, check_private_dir
from .locking import flocked, open_temp
from .timekeeping import Clock

log = logging.getLogger("cachebuild.store")


class Materializer:
    """Materialized files and scratch directories of the store at ``layout`` (see the
    module doc). ``read_only``: nothing is ever written to or moved in the store."""

    def __init__(self, layout: Layout, clock: Clock, *, read_only: bool = False) -> None:
        self.layout = layout
        self.clock = clock
        self.read_only = read_only
        self._scratch: dict[tuple[int, bool], Scratch] = {}
        self._memfiles: dict[str, int] = {}  # made in memory: name → fd

    def stored(self, key: str, suffix: str, small: dict[str, Any]) -> Path | None:
        """The file of ``key`` made earlier, if it matches the record ``small``."""
        path = self.layout.materialized(key, suffix)
        return path if self._matches(path, small) else None

    def _matches(self, path: Path, small: dict[str, Any]) -> bool:
        try:
            fd = open_regular(path)
        except OddFile:
            if not self.read_only:
                with flocked(self.layout.entry_lock(path.name.split(".", 1)[0])):
                    if os.path.lexists(path) and not is_regular(path):
                        self._quarantine(path)
            return False
        if fd is None:
            return False
        with open(fd, "rb") as f:
            if os.fstat(f.fileno()).st_size != small["size"]:
                return False
            h = xxhash.xxh3_128() if len(small["checksum"]) == 32 else xxhash.xxh3_64()
            buf = bytearray(1 << 20)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])
            return h.hexdigest() == small["checksum"]

    def _quarantine(self, path: Path) -> None:
        move_to_quarantine(self.layout, path, "not-a-regular-file", self.clock.time())

    def write(self, key: str, suffix: str, payload: bytes, index: Index) -> Path | None:
        """A new file beside the blob of ``key`` holding ``payload`` (verified by the
        caller); None if the key was deleted meanwhile. In memory on a full disk, and
        always where the store is read-only."""
        if self.read_only:
            return self.in_memory(key, suffix, payload)
        path = self.layout.materialized(key, suffix)
        try:
            fd, tmp_path = open_temp(self.layout.tmp, key + suffix)
        except OSError as e:
            return self._after_write_error(key, suffix, payload, e)
        try:
            write_all(fd, (payload,))
            os.fsync(fd)
            os.fchmod(fd, 0o500)
            with flocked(self.layout.entry_lock(key)):
                if key not in index:  # deleted meanwhile: leave nothing behind
                    return None
                if os.path.lexists(path) and not is_regular(path):
                    self._quarantine(path)
                os.replace(tmp_path, path)
            return path
        except OSError as e:
            return self._after_write_error(key, suffix, payload, e)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp_path)

    def _after_write_error(self, key: str, suffix: str, payload: bytes,
                           error: OSError) -> Path:
        """The payload in memory when the disk is full; StoreError for any other error."""
        if error.errno not in (errno.ENOSPC, errno.EDQUOT) or not hasattr(os, "memfd_create"):
            raise StoreError(f"cannot materialize {key}: {error.strerror or error}") from None
        if key + suffix not in self._memfiles:
            log.warning("cachebuild: the disk holding the store at %s is full: %s is loaded from memory; "
                        "free space, e.g. with `cachebuild gc --max-size SIZE`",
                        self.layout.root, key)
        return self.in_memory(key, suffix, payload)

    def in_memory(self, key: str, suffix: str, payload: bytes) -> Path:
        """``payload`` in an anonymous memory file (made once per name), by path."""
        name = key + suffix
        fd = self._memfiles.get(name)
        if fd is None:
            fd = os.memfd_create(f"cachebuild-{name}", os.MFD_CLOEXEC)
            write_all(fd, (payload,))
            self._memfiles[name] = fd
        return Path(f"/proc/self/fd/{fd}")

    def scratch_dir(self, *, in_memory: bool = False) -> Path:
        """A directory only this process uses (see the module doc); ``in_memory``: under
        ``/dev/shm`` instead of the store."""
        slot = (os.getpid(), in_memory)
        found = self._scratch.get(slot)
        if found is not None and found.path.is_dir():
            return found.path
        if in_memory:
            parent = Path("/dev/shm")
            if not parent.is_dir():
                raise StoreError("no memory-backed directory (/dev/shm) to load from while "
                                 f"the disk holding {self.layout.root} is full; free some space")
        else:
            parent = self.layout.scratch
            parent.mkdir(mode=0o700, exist_ok=True)
            check_private_dir(parent)
        try:
            made = Scratch(parent)
        except OSError as e:
            raise StoreError(f"cannot make a private directory in {parent}: "
                             f"{e.strerror or e}") from None
        self._scratch[slot] = made
        return made.path

    def close(self) -> None:
        """Close the memory files (their paths stop working)."""
        for fd in self._memfiles.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._memfiles.clear()
