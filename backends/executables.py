"""Whether an executable (a C++ compiler) can be run without trusting another user.

A build runs the C++ compiler the toolchain probe chose, often as root on a build host.
If anyone else could replace that file, or rename a directory on the way to it, they
would choose what runs. ``replaceable`` says who could: the file (after every symlink)
must be a regular file owned by root or by us that nobody else may write, and every
directory on the way to it, and to each symlink that leads there, must be owned by root
or by us and writable by nobody else unless it is sticky (``/tmp``) and the entry in it
is ours or root's. ``content_hash`` identifies what the file holds, so that a verdict
made for one compiler is never applied to another file put in its place.
"""

from __future__ import annotations

import hashlib
import os
import stat

from cachebuild.store import others_can_write

#: Symlinks followed at most, as the kernel does (ELOOP past 40).
_MAX_LINKS = 40
_HASHES: dict[tuple[int, int, int, int, int], str] = {}


def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _dir_problem(directory: str, entry: str) -> str | None:
    """Why another user could rename ``entry`` in ``directory`` or change ``directory``."""
    try:
        st, below = os.lstat(directory), os.lstat(os.path.join(directory, entry))
    except OSError as e:
        return f"{directory} cannot be checked ({e.strerror or e})"
    if not _trusted_owner(st.st_uid):
        return f"{directory} is owned by uid {st.st_uid}"
    if others_can_write(st) and not (st.st_mode & stat.S_ISVTX and _trusted_owner(below.st_uid)):
        return f"{directory} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _chain_problem(path: str) -> str | None:
    """Why another user could replace an entry on the way to ``path`` (absolute,
    lexical: each directory above it as written)."""
    child = path
    parent = os.path.dirname(child)
    while child != parent:
        why = _dir_problem(parent, os.path.basename(child))
        if why is not None:
            return why
        child, parent = parent, os.path.dirname(parent)
    return None


def replaceable(path: str) -> str | None:
    """Why a user other than root and us could change what running ``path`` runs, in
    words ("/opt/tools is owned by uid 1000"); None if nobody else can."""
    current = os.path.abspath(path)
    for _ in range(_MAX_LINKS):
        why = _chain_problem(current)
        if why is not None:
            return why
        try:
            st = os.lstat(current)
        except OSError as e:
            return f"{current} cannot be checked ({e.strerror or e})"
        if stat.S_ISLNK(st.st_mode):
            # The link itself is safe where its directory is; what it points to is next.
            target = os.readlink(current)
            current = os.path.normpath(os.path.join(os.path.dirname(current), target))
            continue
        if not stat.S_ISREG(st.st_mode):
            return f"{current} is not a regular file"
        if not _trusted_owner(st.st_uid):
            return f"{current} is owned by uid {st.st_uid}"
        if others_can_write(st):
            return f"{current} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
        return None
    return f"{path}: too many symlinks"


def content_hash(path: str) -> str | None:
    """The SHA-256 of the file ``path`` runs (after symlinks), or None if it cannot be
    read. Hashed once per file version in a process (by inode, size and times)."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    found = _HASHES.get(ident)
    if found is not None:
        return found
    digest = hashlib.sha256()
    try:
        with open(real, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError:
        return None
    _HASHES[ident] = digest.hexdigest()
    return _HASHES[ident]
