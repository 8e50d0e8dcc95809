"""What a build's compilers do: timed per phase, and no C++ object compiled twice.

``watch(work)`` (called by ``kernel_dir.build_work_dir`` for every build) routes
Inductor's compiler work through this module (``compat.hook_compilers``, once per
process). Each C++ run is timed as the phase it is (``clock``: ``cxx_headers``,
``cxx_wrapper``, ``cxx_kernels``, ``cxx_link``; the ISA checks as ``cxx_isa``), and
each file compiled from one source (an AOTInductor package's wrapper or kernels, a
standalone artifact's kernels) is kept in a ``cxx/`` folder under a key of everything that
decides its bytes: the compiler (its path, size and modification time), torch's version and
build, the CPU (``cpu_identity``: Inductor compiles for the CPU it runs on), the command line
with the source's and the object's own paths taken out, and the
source text (less the comment lines at its start and end, which Inductor fills with paths
and commands). A later compile with
the same key, in any process using that folder, copies the object instead of compiling it:
a piece whose kernels did not change (an edit elsewhere in the model, another bucket with
the same code, a build after a failed one, the same piece built for another store) builds
only what did. An object is reused only if it hashes (SHA-256) to the record made when a
build of ours kept it (``store.work.ObjectRecords``, kept in a private ``built/`` folder,
never in a work folder the operator may have set); one that does not is compiled again,
and a warning says so once. Every artifact made from such objects is still proven against
its piece before it is stored (``Builder``), as a fresh compile is.

The ``cxx/`` folder is the environment folder's (``environment.py``: what it holds depends
on the compiler and torch, not on the store, so every store of the user shares it; a second
store, a CI job or a typo in ``CACHEBUILD_DIR`` compiles no object twice), or the work
folder's where the environment folder is not ours to write. It is counted by ``stats``;
``gc`` removes the objects no build has made or reused for a week (``environment.OBJECT_AGE``)
when no build holds the folder, and empties the work folder's.

A CPU package's two precompiled headers (the wrapper's and the kernels' prefix, seconds
apiece, once per environment) are made side by side on two threads
(``compat.hook_header_precompiles``), not one after the other while a second build
waits for them.

Inductor's checks of the CPU's vector instructions (a compile and a load per ISA, tens of
seconds on a loaded machine; made at once, a thread per ISA) are recorded once per
environment (and compiler) in the environment folder,
beside the toolchain's verdict (the probe's own build records them first), and every
later build in any store that shares that folder takes the record instead of checking
again.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import platform
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from cachebuild import clock, compat
from cachebuild.compat import CxxBuild
from cachebuild.store import mark_work_folder, write_whole

if TYPE_CHECKING:
    from cachebuild.store import ObjectRecords

#: Bumped when what goes into a key changes.
_KEY_VERSION = "2"

_state = threading.Lock()
#: While ``watch`` runs: the C++ object cache (``dir``), the store's records of its objects
#: (``objects``) and where ISA verdicts are kept.
_cache: dict[str, Any] = {"dir": None, "records": None, "objects": None}


@contextlib.contextmanager
def watch(kept: Path, records: Path | None = None,
          objects: ObjectRecords | None = None) -> Iterator[Path]:
    """Time this process's compiler work and, with ``objects`` (the records of them), reuse
    C++ objects from ``kept``'s ``cxx/`` folder while the block runs: an object
    is reused only if it hashes to its record, else compiled again. Take Inductor's
    verdict on the CPU's vector ISAs from ``records`` (a private folder kept per
    environment, the probe's; default the cache folder), checking and recording it there
    once; yields the cache folder."""
    compat.hook_compilers(_cxx, clock.phase)
    compat.hook_vec_isa_list(_vec_isas)
    compat.hook_header_precompiles(_beside)
    folder = kept / "cxx"
    folder.mkdir(mode=0o700, exist_ok=True)
    mark_work_folder(folder)  # ours to count and remove where ``kept`` is the work folder
    with _state:
        saved = dict(_cache)
        _cache.update(dir=folder if objects is not None else None, records=records or folder,
                      objects=objects)
    try:
        yield folder
    finally:
        with _state:
            _cache.update(saved)


_isas: dict[str, list[Any]] = {}


def _vec_isas(check: Callable[[], list[Any]]) -> list[Any]:
    """Inductor's usable vector ISAs: checked once per environment (a compile and a load
    in a child process per ISA, seconds apiece on a busy machine) and recorded in the
    records folder as ``vec_isa-<key>.json``; every later process (every build worker,
    every store sharing the environment folder) takes the record. The key holds torch's build,
    the compiler Inductor uses and the CPU's features, and a record naming a feature this
    CPU lacks is checked again."""
    folder = _cache["records"]
    if folder is None:
        return check()
    compiler = compat.inductor_cxx()
    found = shutil.which(compiler)
    found = os.path.realpath(found) if found else None  # `g++` and the file it links to
    try:
        info = os.stat(found) if found else None
    except OSError:
        info = None
    h = xxhash.xxh3_128()
    for part in (_KEY_VERSION, torch.__version__, compat.torch_git_version(), found or compiler,
                 f"{info.st_size}:{info.st_mtime_ns}" if info else "", compat.cpu_features()):
        h.update(part.encode())
        h.update(b"\0")
    key = h.hexdigest()
    if key in _isas:
        return _isas[key]
    record = folder / f"vec_isa-{key}.json"
    # One lock per key: a check with one compiler never waits for one with another.
    with open(folder / f"vec_isa-{key}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process checks; the others read its verdict
        isas = None
        with contextlib.suppress(OSError, ValueError, TypeError):
            data = json.loads(record.read_text())
            if isinstance(data, list) and all(
                    isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r)
                    for r in data):
                isas = compat.vec_isas_from_record(data)
        if isas is None:
            with clock.phase("cxx_isa"):
                compat.check_vec_isas_at_once(_as_isa_check)
                isas = check()
            with contextlib.suppress(OSError):
                tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(compat.vec_isa_record(isas)))
                os.replace(tmp, record)
    _isas[key] = isas
    return isas


def _beside(precompile: Callable[[], object]) -> None:
    """A header precompiled on a thread beside the build's own (``compat``): on a clock
    of its own, its time being the build's wait for it; its error (if any) Inductor
    meets again when it asks for the header itself."""
    with contextlib.suppress(Exception), clock.measuring(clock.BuildClock()):
        precompile()


def _as_isa_check(check: Callable[[], object]) -> object:
    """``check()`` on a thread of its own, its compiles known as an ISA check's (``_cxx``:
    never cached as objects)."""
    with clock.measuring(clock.BuildClock()), clock.phase("cxx_isa"):
        return check()


def phase_of(build: CxxBuild) -> str:
    """The clock phase a C++ run belongs to."""
    target = build.target
    if build.step == "header":
        return "cxx_headers"
    if build.step == "object":
        return "cxx_wrapper" if target.endswith("wrapper.o") else (
            "cxx_kernels" if target.endswith(".o") and not target.endswith("weights.o")
            else "cxx_link")
    if all(s.endswith(".o") for s in build.sources):
        return "cxx_link"
    return "cxx_kernels"  # a library straight from sources: Inductor's kernels (standalone)


def _cxx(build: CxxBuild, run: Callable[[], None]) -> None:
    current = clock.current()
    if current is not None and current.current == "cxx_isa":
        run()  # an ISA check's compile is part of the check
        return
    phase = phase_of(build)
    with clock.phase(phase):
        folder = _cache["dir"]
        if phase == "cxx_wrapper" and len(build.sources) == 1:
            without_kernel_listings(Path(build.sources[0]))
        key = object_key(build) if folder is not None and build.step != "header" else None
        if key is None or folder is None:
            run()
            return
        kept = folder / f"{key}{Path(build.target).suffix}"
        objects: ObjectRecords = _cache["objects"]
        # Only bytes that hash to the store's record of what a build of ours kept are
        # linked: the object goes into a target that is then stored (and signed).
        data = objects.verified(kept.name, kept)
        if data is not None:
            try:
                write_whole(Path(build.target), data)
            except OSError:
                run()  # unwritable: compile
                return
            with contextlib.suppress(OSError):
                os.utime(kept)  # used: `gc` removes objects unused for a week
            if current is not None:
                current.count("cxx_reused")
            return
        run()
        with contextlib.suppress(OSError):  # a full disk costs only the reuse
            objects.keep(kept.name, kept, Path(build.target).read_bytes())


def object_key(build: CxxBuild) -> str | None:
    """The key of an object file's bytes (see the module doc), or None where it cannot
    be told (not one source file, or one that cannot be read)."""
    if len(build.sources) != 1 or build.sources[0].endswith(".o"):
        return None  # a link: cheap, and its inputs are objects made here
    source = build.sources[0]
    try:
        text = _without_edge_comments(Path(source).read_bytes())
    except OSError:
        return None
    command = build.command.replace(build.target, "@OUT@").replace(source, "@SRC@")
    words = command.split()
    compiler = shutil.which(words[0]) if words else None
    try:
        info = os.stat(compiler) if compiler else None
    except OSError:
        info = None
    h = xxhash.xxh3_128()
    for part in (_KEY_VERSION, compiler or "", f"{info.st_size}:{info.st_mtime_ns}" if info else "",
                 torch.__version__, compat.torch_git_version(), command, cpu_identity()):
        h.update(part.encode())
        h.update(b"\0")
    h.update(text)
    return h.hexdigest()


@functools.cache
def cpu_identity() -> str:
    """The CPU an object is compiled for: Inductor compiles with ``-march=native``, so an
    object made on one CPU may use instructions another lacks, and an environment folder
    in a home shared by machines (NFS) is shared by their CPUs too. Its maker, model and
    every feature flag as Linux lists them (``/proc/cpuinfo``), else what ``platform``
    says."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("vendor_id", "cpu family", "model", "model name", "flags", "Features",
              "CPU implementer", "CPU architecture", "CPU variant", "CPU part")
    return "\n".join(line for line in first.splitlines()
                     if line.split(":")[0].strip() in wanted)


def without_kernel_listings(source: Path) -> None:
    """Take out of a C++ source, in place, the listings of Triton kernels' Python code that
    AOTInductor writes into a GPU wrapper: they change nothing the compiler makes, but they
    hold each kernel's code, so the wrapper of a piece whose kernels changed (a constant, an
    edit) would not be found among the objects already compiled. The source is what is
    compiled and keyed, so the object and its key agree. A listing is taken only as
    AOTInductor writes it, nothing that merely looks like a comment (text in a raw string
    could): a block comment opened on a line of its own right after the line that opens a
    kernel's launcher (``... {``), closed on a line of its own, holding a ``@triton.jit``
    line. A file that cannot be read or written is left as it is."""
    try:
        text = source.read_bytes()
    except OSError:
        return
    lines = text.split(b"\n")
    kept: list[bytes] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == b"/*" and kept and kept[-1].rstrip().endswith(b"{"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == b"*/"), None)
            if end is not None and any(line.strip() == b"@triton.jit"
                                       for line in lines[i + 1:end]):
                i = end + 1
                continue
        kept.append(lines[i])
        i += 1
    if len(kept) == len(lines):
        return
    with contextlib.suppress(OSError):
        write_whole(source, b"\n".join(kept))


def _without_edge_comments(text: bytes) -> bytes:
    """``text`` without the comment lines at its start and its end, which change nothing
    the compiler makes: Inductor appends the compile and link commands to a source after
    building it (so a source it finds written already carries them), and starts a
    kernel file with the path of its wrapper, which holds the work folder's (so the same
    kernel built for another store would not be found). A line ending in a backslash
    goes on into the next one: a comment line that ends so stays with what follows, and
    a line after one that ends so is part of it (a string's text, say), so it stays."""
    lines = text.split(b"\n")

    def comment(line: bytes) -> bool:
        stripped = line.strip()
        return not stripped or (stripped.startswith(b"//") and not stripped.endswith(b"\\"))

    def continued(i: int) -> bool:
        return i > 0 and lines[i - 1].rstrip().endswith(b"\\")

    start, end = 0, len(lines)
    while end > start and comment(lines[end - 1]) and not continued(end - 1):
        end -= 1
    while start < end and comment(lines[start]):
        start += 1
    return b"\n".join(lines[start:end])
