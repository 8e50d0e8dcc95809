"""Where Inductor looks for files while cachebuild loads a ``standalone`` artifact.

Inductor loads whatever it finds in its cache directory under a kernel's name, and that
directory defaults to ``/tmp/torchinductor_<user>``, which any local user can create
first and fill. So while a load runs, Inductor is pointed at a directory private to this
process inside the store (``Store.scratch_dir``: made 0700 by us, checked like the store,
removed at exit), and every file it needs there is written by ``write_file`` from the
artifact's verified bytes, fsynced before Inductor sees it. Nothing found anywhere else is
used, and nothing found there was put there by anyone but this process.

Inductor's cache directory is process-wide (``TORCHINDUCTOR_CACHE_DIR``), so
``private_cache_dir`` counts the loads in progress: the first points Inductor at the
private directory, the last points it back. Loads from two different stores wait for
each other, and a build in this process (``build_work_dir``, which points the same
variables at the store's work folder) and loads on other threads wait for each other too:
one thread's build never runs with another thread's load folder in the environment, nor
the reverse. A load the building thread makes itself (the build's proof) nests inside it.

Why the environment, and not Inductor's config or a patched function: the environment is
the only place every reader of these folders looks. Inductor's ``cache_dir()`` reads
``TORCHINDUCTOR_CACHE_DIR`` on every call and writes it back into ``os.environ`` itself,
and a dozen of its modules hold their own reference to that function (patching one misses
the others); its Triton launcher sets ``TRITON_CACHE_DIR`` in ``os.environ`` when it is
unset, and Triton reads it from there; the processes the compilers start (the C++
compiler, which takes ``TMPDIR``; Inductor's ``python -c`` ISA checks, which need
``PYTHONSAFEPATH``; its compile workers, to which it forwards both cache variables) learn
them only from the environment they inherit. A folder fixed once for the process would
not do either: each store has its own work folder, checked and locked per store, and a
process may build into several. So ``build_work_dir`` and ``private_cache_dir`` set the
variables for as long as their block runs and put back what was there. Builds are kept
out of a serving process where they can be: in worker processes (``pool``) the swap
touches the environment of a process that does nothing else; and a backend that
generates no code (``eager_fusion``) builds with no swap at all.

Before it builds or loads CPU kernels, Inductor compiles small check programs for each
vector ISA the CPU reports (seconds apiece), and which flags its checks and kernels get
depends on what ran before in the process. So while loads run, Inductor is told the ISA
the kernels were built for (``compat.pin_vec_isa``, from the artifact's ``build.json``)
and compiles no check: the kernels are found under the keys they were built with.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from cachebuild import compat
from cachebuild.backends.pack import check_name
from cachebuild.errors import UsageError
from cachebuild.store.interface import ArtifactSource, Store

_ENV = "TORCHINDUCTOR_CACHE_DIR"
_state = threading.Condition()
_active: dict[str, Any] = {"dir": None, "count": 0, "saved": None, "undo": None,
                           # the thread whose build has the environment, and how deep
                           "builder": None, "builds": 0}
#: loads in progress, by thread
_loaders: dict[int, int] = {}
# Files written by this process: path → digest of what was written (to skip rewriting).
_written: dict[str, str] = {}
_written_lock = threading.Lock()


@contextlib.contextmanager
def private_cache_dir(store: ArtifactSource, *, in_memory: bool = False,
                      vec_isa: tuple[str | None, str | None] = (None, None)) -> Iterator[Path]:
    """Point Inductor at this process's private directory of ``store`` while the block
    runs, and (the first of concurrent loads) at ``vec_isa`` (name, flags) the kernels
    were built for; yields that directory."""
    root = Path(store.scratch_dir(in_memory=in_memory)) / "inductor"
    root.mkdir(mode=0o700, exist_ok=True)
    me = threading.get_ident()
    with _state:
        while (_active["count"] and _active["dir"] != str(root)) or \
                _active["builder"] not in (None, me):
            _state.wait(1.0)  # in slices: a Ctrl-C reaches a waiting main thread
        if not _active["count"]:
            _active["dir"], _active["saved"] = str(root), os.environ.get(_ENV)
            os.environ[_ENV] = str(root)
            _active["undo"] = compat.pin_vec_isa(*vec_isa)
        _active["count"] += 1
        _loaders[me] = _loaders.get(me, 0) + 1
    try:
        yield root
    finally:
        with _state:
            _active["count"] -= 1
            _loaders[me] -= 1
            if not _loaders[me]:
                del _loaders[me]
            if not _active["count"]:
                if _active["saved"] is None:
                    os.environ.pop(_ENV, None)
                else:
                    os.environ[_ENV] = _active["saved"]
                _active["undo"]()
                _active["dir"] = None
            _state.notify_all()


def write_file(root: Path, name: str, data: bytes) -> Path:
    """Write ``data`` to ``root/name`` (a checked relative name): to a temp file first,
    fsynced, then renamed, so no reader ever sees a partial file. A file this process
    already wrote there with the same bytes is kept."""
    path = root / check_name(name)
    digest = xxhash.xxh3_128_hexdigest(data)
    with _written_lock:
        if _written.get(str(path)) == digest and path.is_file():
            return path
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o700)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    with _written_lock:
        _written[str(path)] = digest
    return path


# -- where a build's compilers write ------------------------------------------------------

_BUILD_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TMPDIR", "PYTHONSAFEPATH")


def environment_dir() -> Path | None:
    """Where builds keep what holds for the whole environment (compiler, torch build,
    CPU), not for one store: Inductor's verdict on the CPU's vector ISAs and its
    precompiled C++ headers (``headers/``). That is the environment folder
    (``environment.py``: the user's, or ``$CACHEBUILD_PROBE_DIR``), where it is ours to
    write; else None (the work folder)."""
    from cachebuild.backends.probe import usable_dir

    return usable_dir()



@contextlib.contextmanager
def _building() -> Iterator[None]:
    """Hold the build folders' variables for this thread: wait until no other thread builds
    or loads (a load this thread makes meanwhile nests), then keep them from starting until
    the block ends."""
    me = threading.get_ident()
    with _state:
        while _active["builder"] not in (None, me) or any(t != me for t in _loaders):
            _state.wait(1.0)  # in slices: a Ctrl-C reaches a waiting main thread
        _active["builder"] = me
        _active["builds"] += 1
    try:
        yield
    finally:
        with _state:
            _active["builds"] -= 1
            if not _active["builds"]:
                _active["builder"] = None
            _state.notify_all()

def check_cxx_work_dir(work_dir: str | Path) -> None:
    """UsageError where C++ builds cannot use ``work_dir``: Inductor's compiler command is
    a string split as a shell would (``shlex``), so a path with a space, a quote or a
    backslash in it breaks every build."""
    # The real path is what the compiler is given (a link to "/mnt/data disk" breaks it too).
    text = str(work_dir) + os.path.realpath(work_dir)
    found = next((c for c in text if c.isspace() or c in "'\"\\"), None)
    if found is not None:
        what = "a space" if found.isspace() else f"a {found!r}"
        raise UsageError(f"the build work folder {work_dir} has {what} in its path, "
                         "which the C++ compiler's command cannot take: set "
                         "CACHEBUILD_WORK_DIR to a folder whose path has none (or use a store "
                         "path without one)")


@contextlib.contextmanager
def build_work_dir(store: Store, *, cxx: bool = False) -> Iterator[Path]:
    """Point the compilers of a build at the store's work folder (``store.work_dir``:
    the store's ``work/``, or the folder the operator set) while the block runs, and put
    everything back after: Inductor's cache, Triton's cache and the temp files both make.
    ``cxx``: the build compiles C++ through Inductor, which is imported first where it is
    not yet (a warm server rebuilding a damaged target): Inductor fixes its header folder
    as it is imported, and only then can it be pointed at the environment's.
    Inductor's precompiled headers, its ISA checks and the C++ objects builds reuse
    (``compilers.watch``, which also times the compilers' phases) go to ``environment_dir``
    (the same for every store of an environment, as torch keeps them per machine: a second
    store compiles no object the first one did). ``cachebuild stats`` counts that folder;
    ``gc`` empties its objects when no build holds it (each build holds it shared, by flock,
    while it runs).

    What a build reuses from the work folder goes into a target, so the folder is checked
    like the store first, parents included, and emptied if nothing records that a build of
    ours made it (``store.work.open_work_dir``; UnsafeStore, exit 2, if it fails); a C++
    object is reused only if it hashes to the record kept when a build of ours made it.
    Those records are kept with the environment (shared, as the work folder may be, by the
    stores of this user), or in the store where that folder is not ours to write."""
    import tempfile

    from cachebuild.backends.compilers import watch
    from cachebuild.backends.environment import in_use
    from cachebuild.store import (
        WORK_LOCK,
        ObjectRecords,
        flocked_shared,
        make_private_dir,
        mark_work_folder,
        open_work_dir,
    )

    environment = environment_dir()
    records = environment / "built" if environment is not None else Path(store.work_records)
    if cxx:
        check_cxx_work_dir(store.work_dir)
    root = open_work_dir(Path(store.work_dir), records, named=store.work_dir_named)
    folders = {"TORCHINDUCTOR_CACHE_DIR": root / "inductor", "TRITON_CACHE_DIR": root / "triton",
               "TMPDIR": root / "tmp"}
    for folder in folders.values():
        make_private_dir(folder, "work folder")
        mark_work_folder(folder)
    objects = ObjectRecords(records / "cxx")
    with flocked_shared(root / WORK_LOCK), \
            in_use(environment) if environment is not None else contextlib.nullcontext(), \
            _building():
        inductor_loaded = "torch._inductor.codecache" in sys.modules
        saved_env = {name: os.environ.get(name) for name in _BUILD_ENV}
        saved_tempdir = tempfile.tempdir
        undo_headers: Any = None
        try:
            os.environ.update({name: str(folder) for name, folder in folders.items()})
            # The Python processes the compilers start (Inductor's ISA checks run
            # ``python -c``) put neither their working directory nor their script's folder
            # first on their path: the caller's working directory may be anyone's.
            os.environ["PYTHONSAFEPATH"] = "1"
            tempfile.tempdir = None  # read TMPDIR again
            if cxx and not inductor_loaded:
                import torch._inductor.codecache  # noqa: F401
            undo_headers = compat.point_header_dir(str(
                environment / "headers" if environment is not None
                else folders["TORCHINDUCTOR_CACHE_DIR"] / "precompiled_headers"))
            with watch(environment if environment is not None else root, environment,
                       objects):
                yield root
        finally:
            if undo_headers is not None:
                undo_headers()
            for name, value in saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            tempfile.tempdir = saved_tempdir
            if not inductor_loaded:
                # Imported during the build, Inductor took its header folder from ours:
                # back to where it keeps them by default, for whatever compiles after.
                compat.point_header_dir(None)

