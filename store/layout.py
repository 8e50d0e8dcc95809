"""Where things live in a store directory, and the check that it is safe to use.

::

    <path>/v1/
      index/        diskcache database: key -> record
      objects/ab/   blobs (objects/ab/<key>) and files materialized from them
                    (objects/ab/<key>.so)
      locks/ab/     one build lock per key (locks/ab/<key>.lock), plus a few striped
                    internal locks (locks/entry/<xx>.lock) that order puts and deletes
      quarantine/   blobs that failed verification, kept for inspection
      tmp/          blobs being written; renamed into objects/ when complete
      scratch/      one private directory per live process, for files a loader hands to
                    another library by path (Inductor's kernels); removed at exit
      probe/        toolchain verdicts an earlier version kept here (now in the user's
                    environment folder; ``gc --environments`` removes it)
      work/         what compilers write while a target builds (Inductor's and Triton's
                    caches and precompiled headers, temp files): ``gc`` removes it
                    when no build is running
      built/        records of what builds put into the work folder (which folder they
                    made, each kept C++ object's SHA-256), checked before anything there
                    is reused; kept here where the environment folder is not ours to write
      reserve       1 MiB kept free for a full disk (see LocalStore)

``ab`` is the first two hex digits of the key, so no directory grows past a few
thousand files.

Artifacts are code that runs when loaded, so a store is used only where no one else can
change what a path in it names: the directory and every one below it are ours and only
ours to write, and every directory above it belongs to us or root and, if others may
write it, is sticky (like ``/tmp``), so that no one else can rename our entry in it. The
store is then used through its real path, so a symlink on the way cannot be re-aimed.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import stat
import struct
from pathlib import Path

from cachebuild.errors import StoreError

FORMAT_DIR = "v1"
SUBDIRS = ("index", "objects", "locks", "quarantine", "tmp")
_KEY_RE = re.compile(r"[0-9a-f]{16,128}")
_SUFFIX_RE = re.compile(r"\.[A-Za-z0-9_.-]{1,32}")


class UnsafeStore(StoreError):
    """A store path that cannot be used as given: missing, not a directory, or open to
    others (bad input from the user's point of view: exit code 2)."""

    exit_code = 2


class InvalidKey(StoreError, ValueError):
    """A string that is not a store key was given where a key was expected."""

    exit_code = 2


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid store key (16-128 lowercase hex digits), else raise.

    Keys become file names, so anything else (``..``, ``/``) is refused before it gets
    near the file system.
    """
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise InvalidKey(f"not a store key: {key!r} (expected lowercase hex, e.g. 32 chars "
                         "from cachebuild.keys.make_key)")
    return key


def check_suffix(suffix: str) -> str:
    """Return ``suffix`` if it is a safe file suffix such as ``.so``, else raise ValueError."""
    if not _SUFFIX_RE.fullmatch(suffix):
        raise ValueError(f"bad materialization suffix {suffix!r}: expected e.g. '.so'")
    return suffix


class Layout:
    """Paths inside one store root (``<path>/v1``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.index = root / "index"
        self.objects = root / "objects"
        self.locks = root / "locks"
        self.quarantine = root / "quarantine"
        self.tmp = root / "tmp"
        self.probe = root / "probe"  # verdicts an earlier version kept in the store
        self.scratch = root / "scratch"  # per-process private directories (made on use)
        self.work = root / "work"  # compilers' working files during builds (made on use)
        self.built = root / "built"  # records of what builds left in the work folder
        self.reserve = root / "reserve"
        self._objects_str = str(self.objects)

    def blob(self, key: str) -> Path:
        return self.objects / key[:2] / key

    def blob_str(self, key: str) -> str:
        """``blob(key)`` as a string, built without pathlib: it is on every read's path."""
        return f"{self._objects_str}/{key[:2]}/{key}"

    def materialized(self, key: str, suffix: str) -> Path:
        return self.objects / key[:2] / (key + suffix)

    def build_lock(self, key: str) -> Path:
        return self.locks / key[:2] / f"{key}.lock"

    def entry_lock(self, key: str) -> Path:
        return self.locks / "entry" / f"{key[:2]}.lock"


#: Where the operator names each folder a message may be about.
SET_BY = {"store directory": "--cache-dir, CACHEBUILD_DIR", "work folder": "CACHEBUILD_WORK_DIR",
          "environment folder": "CACHEBUILD_PROBE_DIR", "overlay folder": "CACHEBUILD_OVERLAY_DIR"}


def others_can_write(st: os.stat_result, where: int | str | os.PathLike[str] | None = None
                     ) -> bool:
    """Whether a user other than the owner of what ``st`` describes (and root) may write
    it: its mode lets others write, or its group, unless that group is its owner's own
    (``_private_group``: what a umask of 002 gives every folder a user makes on systems
    that give each user a group of their own), or, where ``where`` (its path or an open
    descriptor) is given, an access ACL lets a named user or group write it."""
    if st.st_mode & stat.S_IWOTH:
        return True
    if not st.st_mode & stat.S_IWGRP:
        return False  # with an ACL, the group bits are its mask: no named entry writes
    if not _private_group(st.st_gid, st.st_uid):
        return True
    return where is not None and _acl_lets_others_write(where, st)


#: ``system.posix_acl_access``: a 4-byte version, then entries of (tag u16, perm u16,
#: id u32), little-endian. Tags of the entries that name someone, and the write bit.
_ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_WRITE = 0x02, 0x04, 0x08, 0x02


def _acl_lets_others_write(where: int | str | os.PathLike[str], st: os.stat_result) -> bool:
    """Whether the access ACL of ``where`` lets a user other than its owner write it (a
    named user, a named group or its owning group that is not the owner's own); False
    where it has none, or the file system keeps none."""
    try:
        raw = os.getxattr(where, "system.posix_acl_access")
    except OSError:
        return False
    for offset in range(4, len(raw) - 7, 8):
        tag, perm, ident = struct.unpack_from("<HHI", raw, offset)
        if not perm & _ACL_WRITE:
            continue
        if (tag == _ACL_USER and ident != st.st_uid) or \
                (tag == _ACL_GROUP and not _private_group(ident, st.st_uid)) or \
                (tag == _ACL_GROUP_OBJ and not _private_group(st.st_gid, st.st_uid)):
            return True
    return False


@functools.lru_cache(maxsize=64)
def _private_group(gid: int, uid: int) -> bool:
    """Whether group ``gid`` is the user-private group of ``uid``: the user's primary
    group, named as the user is, listing no other member, and the primary group of no
    other user this machine can list. (A directory service need not list every user or
    member, so a group by any other name is never taken for private.)"""
    import grp
    import pwd

    try:
        owner, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:  # a user or group this machine does not name: not known to be private
        return False
    if owner.pw_gid != gid or group.gr_name != owner.pw_name:
        return False
    if any(member != owner.pw_name for member in group.gr_mem):
        return False
    return all(user.pw_uid == uid for user in pwd.getpwall() if user.pw_gid == gid)


def check_private_dir(path: Path, what: str = "store directory") -> None:
    """Refuse ``path`` unless it is a directory owned by us that only we can write.

    Artifacts in a store are code that runs when loaded; a directory someone else can
    write to would let them run code in every process that loads from it. ``what`` names
    the folder in messages (the store's work folder is checked the same way).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafeStore(f"{what} {path} does not exist") from None
    except PermissionError as e:
        raise UnsafeStore(f"cannot access {what} {path}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeStore(f"refusing {what} {path}: it is a symlink; give the directory "
                         "it points to")
    if not stat.S_ISDIR(st.st_mode):
        hint = f": give it a folder ({SET_BY[what]})" if what in SET_BY else ""
        raise UnsafeStore(f"{what} {path} is not a directory{hint}")
    euid = os.geteuid()
    if st.st_uid != euid:
        raise UnsafeStore(
            f"refusing {what} {path}: it is owned by uid {st.st_uid}, not by you "
            f"(uid {euid}); stored artifacts contain code that runs when loaded, so a store "
            "must belong to the user who loads from it. Use a directory you own "
            f"({SET_BY.get(what, 'the variable that names it')}).")
    if others_can_write(st, path):
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH))
                           if st.st_mode & bit)
        raise UnsafeStore(
            f"refusing {what} {path}: it is writable by {who} "
            f"(mode {stat.S_IMODE(st.st_mode):o}); stored artifacts contain code that runs "
            f"when loaded, so only you may write there. Fix with: chmod 700 {path}")


def check_private_file(path: Path, what: str) -> None:
    """Refuse the file at ``path`` (nothing there is fine) unless it is a regular file that
    only we (or root) can write: where the folders above it let others reach it, a file
    others may write is as open as a folder they may write (``check_private_dir``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeStore(f"refusing {what} {path}: it is not a regular file; move it aside")
    if st.st_uid not in (os.geteuid(), 0):
        raise UnsafeStore(f"refusing {what} {path}: it is owned by uid {st.st_uid}, who could "
                          "rewrite what the store serves; give it back to the store's owner "
                          f"(chown {os.geteuid()} {path})")
    if others_can_write(st, path):
        raise UnsafeStore(f"refusing {what} {path}: others may write it (mode "
                          f"{stat.S_IMODE(st.st_mode):o}) and so change what the store serves. "
                          f"Fix with: chmod go-w {path}")


def make_private_dir(path: Path, what: str = "store directory") -> None:
    """Create ``path`` and its missing parents, each with mode 0700 (whatever the umask
    would give: a folder made group-writable would be refused next), then check it.
    Nothing is made, not even an empty folder, where it would be refused: under a
    directory someone else could change (UnsafeStore), or where this user may not write
    (UnsafeStore too: the path given is the thing to change)."""
    if not os.path.lexists(path):
        check_where_made(path, what)
        missing = [path, *(p for p in path.parents if not os.path.lexists(p))]
        try:
            for folder in reversed(missing):
                try:
                    folder.mkdir(mode=0o700)  # the umask can take bits away, never add
                except FileExistsError:  # made meanwhile by another process: the folder
                    continue             # is checked below, those above by check_parents
                os.chmod(folder, 0o700)
        except OSError as e:
            # ENOENT: a file system that makes no folders there (``/proc``).
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR,
                           errno.ENOENT):
                where = f" ({SET_BY[what]})" if what in SET_BY else ""
                raise UnsafeStore(f"cannot create {what} {path}: {e.strerror}; give a folder "
                                  f"this user may write{where}") from None
            raise StoreError(f"cannot create {what} {path}: {e.strerror}") from None
    check_private_dir(path, what)


#: Why a store must be a folder only its owner (or root) can change, and what to do.
STORE_FIX = ("stored artifacts contain code that runs when loaded, so no one else may be "
             "able to swap the store for another directory; use a store under a "
             "directory that only you or root can change (e.g. ~/.cache/cachebuild)")


def check_parents(path: Path, what: str = "store directory", fix: str = STORE_FIX) -> None:
    """Refuse ``path`` (a real path: no symlinks) if anyone but us or root could rename it,
    or a directory above it, and put something else there (``fix``: why that matters for
    ``what``, and what to do).

    A directory above the store may be writable by others only if it is sticky (``/tmp``)
    and the entry in it on our way is ours or root's: then only its owner may rename it.
    """
    euid = os.geteuid()
    trusted = {0, euid}
    child = path
    for parent in path.parents:
        try:
            st, below = os.lstat(parent), os.lstat(child)
        except OSError as e:
            raise UnsafeStore(f"cannot check {parent}, above the {what} {path}: "
                             f"{e.strerror or e}") from None
        if st.st_uid not in trusted:
            raise UnsafeStore(f"refusing {what} {path}: {parent} above it is owned by "
                             f"uid {st.st_uid}, who could rename it; {fix}")
        if others_can_write(st, parent) and not (st.st_mode & stat.S_ISVTX
                                                 and below.st_uid in trusted):
            raise UnsafeStore(f"refusing {what} {path}: {parent} above it is writable "
                             f"by others (mode {stat.S_IMODE(st.st_mode):o}), who could "
                             f"rename {child.name} in it; {fix}")
        child = parent


def check_links(path: Path, what: str = "store directory") -> None:
    """Refuse ``path`` where a symlink the kernel follows on the way to it is someone
    else's (one in the path as given, or in what a link points to): its owner could point
    it at another directory later (a link in ``/tmp`` to one of our stores today, to
    another of ours tomorrow, which ``gc`` would then empty). The path is walked as the
    kernel walks it, a component at a time (``..`` after a link goes up from where the
    link led); the real path is then checked by ``check_parents``."""
    trusted = {0, os.geteuid()}
    given = Path(os.path.expanduser(path))
    if not given.is_absolute():
        given = Path(os.getcwd()) / given
    todo = list(given.parts[1:])
    current = Path("/")
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        try:
            st = os.lstat(candidate)
        except OSError:
            return  # not there (yet): nothing further on the way to check
        if not stat.S_ISLNK(st.st_mode):
            current = candidate
            continue
        if st.st_uid not in trusted:
            raise UnsafeStore(f"refusing {what} {path}: the link {candidate} on the way is "
                              f"owned by uid {st.st_uid}, who could point it elsewhere; "
                              "give the real path, or a link of your own")
        hops += 1
        if hops > 40:
            return  # a loop of links: opening the path says so
        target = Path(os.readlink(candidate))
        if target.is_absolute():
            current = Path("/")
        todo = [p for p in target.parts if p != "/"] + todo


def checked_real_dir(path: Path, what: str, make: bool = False) -> Path:
    """The real path of the folder ``path`` once it is checked as a store is: no link on
    the way that someone else owns (``check_links``), a directory of ours that no one else
    may write (``check_private_dir``), under directories no one but us or root could
    rename (``check_parents``). With ``make``, a missing folder is made (0700) first.
    UnsafeStore (exit 2) where a check fails; ``what`` names the folder in the message."""
    path = path.expanduser().absolute()
    check_links(path, what)
    if make and not os.path.lexists(path):
        make_private_dir(path, what)
    real = Path(os.path.realpath(path))
    check_private_dir(real, what)
    check_parents(real, what)
    return real


def prepare_work_dir(path: Path) -> Path:
    """The build work folder at ``path``, made (0700) if missing and checked like the store:
    a directory of ours that no one else may write, under directories that no one but us
    or root could rename. Returns its real path; UnsafeStore (exit 2) if it is not a
    directory, cannot be made, or fails a check. Compilers write there and builds reuse
    what they wrote, so a folder another user could change would put their code into
    targets."""
    return checked_real_dir(path, "work folder", make=True)


def check_where_made(path: Path, what: str = "store directory") -> None:
    """Refuse ``path`` (absent) where it would be made under a directory someone else could
    change (``_check_ancestor`` on the nearest directory of it that exists); UnsafeStore."""
    existing = path.parent
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    _check_ancestor(Path(os.path.realpath(existing)), path, what)


def _check_ancestor(real: Path, path: Path, what: str) -> None:
    """Refuse to make ``path`` under ``real`` (the nearest directory of it that exists)
    unless ``real`` and every directory above it belong to us or root, and no one else may
    write ``real`` unless it is sticky (``/tmp``: what we make there stays ours)."""
    try:
        st = os.stat(real)
    except OSError as e:
        raise UnsafeStore(f"cannot check {real}, above the {what} {path}: "
                          f"{e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        kind = "a file, not a directory" if stat.S_ISREG(st.st_mode) else "not a directory"
        where = f" ({SET_BY[what]})" if what in SET_BY else ""
        raise UnsafeStore(f"there is no {what} {path}, and none can be: {real} is {kind}; "
                          f"give another path{where}")
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafeStore(f"refusing {what} {path}: {real} above it is owned by uid "
                          f"{st.st_uid}, who could change what is made there")
    if others_can_write(st, real) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeStore(f"refusing {what} {path}: {real} above it is writable by others "
                          f"(mode {stat.S_IMODE(st.st_mode):o})")
    check_parents(real, what)


def prepare(path: Path, what: str = "store directory") -> Layout:
    """Create (0700) and check the store directory tree under ``path``; return its Layout
    (on the real path: a symlink on the way is resolved once, here). ``what`` names the
    folder in messages (an overlay is a store too, set by another variable)."""
    layout = Layout(checked_real_dir(path, what, make=True) / FORMAT_DIR)
    make_private_dir(layout.root, what)
    for name in SUBDIRS:
        make_private_dir(layout.root / name, what)
    make_private_dir(layout.entry_lock("00").parent, what)
    for folder in _fan_out(layout):
        check_private_dir(folder, "objects folder")
    return layout


def _fan_out(layout: Layout) -> list[Path]:
    """The folders blobs are spread over (``objects/ab/``): checked like the store at
    every open (a few hundred lstat calls), since whoever may write one could replace
    the blobs in it."""
    try:
        names = os.listdir(layout.objects)
    except OSError:
        return []
    return [layout.objects / n for n in sorted(names) if len(n) == 2]


# -- a store this process may only read --------------------------------------------------

def writable_here(path: Path) -> bool:
    """True unless ``path`` exists and this process cannot write it: a read-only mount
    (an image layer, a ``ro`` bind), a directory another user (root) owns, or one whose
    mode lets no one write. A store that does not exist yet is writable (it is made)."""
    path = path.expanduser().absolute()
    try:
        st = os.stat(path)
        ro_mount = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except FileNotFoundError:
        return True
    except OSError:
        return False  # cannot even look: the read-only checks say why
    if ro_mount:
        return False
    if st.st_uid != os.geteuid():
        return False
    return os.access(path, os.W_OK)


def check_readable_dir(path: Path) -> None:
    """Refuse ``path`` unless it is a directory owned by us or root that no one else can
    write: what a store served read-only must be (root built it into an image; anyone
    else writing there could change what this process runs)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafeStore(f"store directory {path} does not exist") from None
    except PermissionError as e:
        raise UnsafeStore(f"cannot access store directory {path}: {e.strerror}; a store "
                          "built by another user must be made readable to be served "
                          "(e.g. chmod -R a+rX on it after warming)") from None
    except OSError as e:  # a file in the path, a name too long, a loop of links
        raise UnsafeStore(f"cannot use store directory {path}: {e.strerror or e}; check "
                          "--cache-dir or CACHEBUILD_DIR") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeStore(f"refusing store path {path}: it is a symlink; give the directory "
                         "it points to")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStore(f"store path {path} is not a directory: give the store a folder "
                          "(--cache-dir, CACHEBUILD_DIR)")
    euid = os.geteuid()
    if st.st_uid not in (0, euid):
        raise UnsafeStore(
            f"refusing store directory {path}: it is owned by uid {st.st_uid}, neither you "
            f"(uid {euid}) nor root; stored artifacts contain code that runs when loaded, so "
            "a store must belong to you, or to root for a store you only read")
    if others_can_write(st, path):
        raise UnsafeStore(
            f"refusing store directory {path}: it is writable by others (mode "
            f"{stat.S_IMODE(st.st_mode):o}); stored artifacts contain code that runs when "
            f"loaded, so only its owner may write there")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UnsafeStore(f"cannot read store directory {path} (mode "
                          f"{stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}): a store "
                          "built by another user must be made readable to be served (e.g. "
                          "chmod -R a+rX on it after warming)")


def open_read_only(path: Path) -> Layout:
    """Check a store this process only reads, creating nothing; return its Layout.

    The store, its format folder, its index and its objects folder must each be a
    directory owned by us or root and writable by no one else, and every directory above
    it must pass ``check_parents``. Blobs are checked as they are read, like any store's."""
    check_links(path.expanduser().absolute())
    path = Path(os.path.realpath(path.expanduser().absolute()))
    check_readable_dir(path)
    check_parents(path)
    layout = Layout(path / FORMAT_DIR)
    for folder in (layout.root, layout.index, layout.objects, *_fan_out(layout)):
        check_readable_dir(folder)
    return layout
