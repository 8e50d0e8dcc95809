"""Code named by what it is, not by where it was loaded from.

A model file has as many names as ways to start it: ``__main__`` when run as a script,
``cachebuild_model_<hash>`` when ``cachebuild warm`` imports it, ``m`` or
``pkg.models.m`` when a server imports it, from whichever directory, in an image at
another path than where it was warmed, or no file at all when a notebook runs its text.
Its code is the same, so everything an entry says about code outside installed libraries
names it by its source: the hash of the syntax tree of the file's text, or of the text
``linecache`` holds for code compiled from a string (``<src:1a2b3c4d5e6f7a8b>``). An
installed module (site-packages, the standard library) has one name everywhere and keeps
it. A change to the code is a change of its name; a change of where it lies is not.

``changed`` answers the other half: is the code of a file a trace read (recorded by its
path at trace time and its hash) the code this process runs? A file of an installed
library is found by its path inside the library folder (``peft/config.py``: the module
``peft.config``), a file outside them by its content among the loaded modules of its file
name; never the one for the other, so ``peft/config.py`` is not a loaded ``config.py`` of
an editable install, nor a model's own ``generic.py`` transformers' ``utils/generic.py``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import linecache
import os
import re
import sys
import time
import types
import weakref
from dataclasses import dataclass
from typing import Any

from cachebuild.trust.codehash import ast_hash_text, code_file, linecache_text

#: How a source's label starts; the rest is the first 16 hex digits of its hash.
LABEL_PREFIX = "<src:"


@dataclass(frozen=True)
class Source:
    """Where this process found a source: its file (or linecache name), the module it was
    loaded as (None where unknown) and the hash of its syntax tree."""

    path: str
    digest: str
    module: str | None = None

    @property
    def name(self) -> str:
        """The file's name without its folder (a linecache name as it is)."""
        return os.path.basename(self.path) if os.sep in self.path else self.path

    def to_data(self) -> dict[str, Any]:
        return {"file": self.name, "module": self.module, "digest": self.digest}


def label_of(digest: str) -> str:
    return f"{LABEL_PREFIX}{digest[:16]}>"


def is_label(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(LABEL_PREFIX) and name.endswith(">")


# -- reading sources ---------------------------------------------------------------------

@functools.cache
def library_roots() -> tuple[str, ...]:
    """Where installed code lives (site-packages, the standard library), as given and as
    real paths: a module there has one name in every process."""
    import site

    # The standard library (lib-dynload lies under it) and every site-packages; not
    # through sysconfig, whose import a warm start would pay.
    roots = {*site.getsitepackages(), site.getusersitepackages(), os.path.dirname(os.__file__)}
    found = {os.path.abspath(r) for r in roots if r} | {os.path.realpath(r) for r in roots if r}
    return tuple(sorted(r + os.sep for r in found))


@functools.lru_cache(maxsize=65536)
def is_library_file(path: str) -> bool:
    """True for a file of installed code (``library_roots``), by its path or its real
    path (cached: asked for every loaded module at a warm start)."""
    roots = library_roots()
    return path.startswith(roots) or os.path.realpath(path).startswith(roots)


def library_path(path: str) -> str | None:
    """Where a file of installed code lies inside the folder it was installed in
    (``peft/config.py`` for ``…/site-packages/peft/config.py``, with ``/`` between
    folders): the same in every environment that installed that module. None for a file
    outside installed libraries."""
    for candidate in (os.path.abspath(path), os.path.realpath(path)):
        roots = [r for r in library_roots() if candidate.startswith(r)]
        if roots:  # the innermost: site-packages may lie inside the standard library
            return candidate[len(max(roots, key=len)):].replace(os.sep, "/")
    return None


def library_paths(paths: Any) -> dict[str, str]:
    """``library_path`` of each of ``paths`` that is a file of installed code."""
    found = {}
    for path in paths:
        rel = library_path(path) if os.path.isfile(path) else None
        if rel is not None:
            found[path] = rel
    return found


def library_module(rel: str) -> str:
    """The module a library file is imported as (``peft/config.py`` → ``peft.config``,
    ``pkg/__init__.py`` → ``pkg``)."""
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


_FILE_DIGESTS: dict[str, tuple[tuple[int, ...], str | None]] = {}

#: A stamp taken this soon after its file last changed is not kept: the kernel's clock for
#: file times is coarse (milliseconds), so a second edit in the same tick would leave the
#: stamp as it was (git's "racily clean" files).
RACY_S = 2.0


def stamp(path: str) -> list[int] | None:
    """A file's size, modification time and change time in ns: equal stamps, equal
    contents. The change time is the kernel's own (``touch -r``, ``cp -p`` or an image
    build that sets every modification time to one value do not put it back), so a
    same-size edit is seen where the modification time alone would hide it. None if
    there is no such file."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def file_digest(path: str) -> str | None:
    """The hash of a file's syntax tree (None: no such file, or not Python), read again
    only when the file's size, times or inode changed (and each time while it changed
    less than ``RACY_S`` ago)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    key = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
    known = _FILE_DIGESTS.get(path)
    if known is not None and known[0] == key:
        return known[1]
    try:
        with open(path, "rb") as f:
            digest = ast_hash_text(f.read())
    except OSError:
        digest = None
    if time.time_ns() - st.st_ctime_ns >= RACY_S * 1e9:
        _FILE_DIGESTS[path] = (key, digest)
    return digest


def stamped_digest(path: str) -> tuple[str | None, list[int] | None]:
    """A file's digest and its stamp (``stamp``) as of that digest: None for the stamp
    if the file changed while it was read, or less than ``RACY_S`` before (then only
    the digest can tell it again)."""
    before = stamp(path)
    digest = file_digest(path)
    if before is None or stamp(path) != before or time.time_ns() - before[2] < RACY_S * 1e9:
        return digest, None
    return digest, before


_TEXT_DIGESTS: dict[str, tuple[int, str | None]] = {}


def text_digest(name: str) -> str | None:
    """``file_digest`` for linecache text (cached while linecache holds the same lines)."""
    entry = linecache.cache.get(name)
    text = linecache_text(name)
    if text is None or entry is None:
        return None
    known = _TEXT_DIGESTS.get(name)
    if known is not None and known[0] == id(entry[2]):
        return known[1]
    digest = ast_hash_text(text.encode())
    _TEXT_DIGESTS[name] = (id(entry[2]), digest)
    return digest


def digest_of(filename: str) -> str | None:
    """The hash of the source at ``filename``: a file on disk, else linecache's text."""
    if os.path.isfile(filename):
        return file_digest(filename)
    return text_digest(filename)


def has_source(filename: str) -> bool:
    """True if the code compiled from ``filename`` can be hashed (a file or linecache)."""
    return os.path.isfile(filename) or linecache_text(filename) is not None


# -- labels ------------------------------------------------------------------------------

#: Every source this process labelled, by label (the latest module loaded from it where
#: several hold one text): what ``describe`` says of it.
_SEEN: dict[str, Source] = {}


def _label_file(filename: str, module: str | None) -> str | None:
    """The label of code from ``filename`` (None: installed code, or no source)."""
    if os.path.isfile(filename) and is_library_file(filename):
        return None
    digest = digest_of(filename)
    if digest is None:
        return None
    label = label_of(digest)
    if module is not None or label not in _SEEN:  # the latest loaded copy names it
        _SEEN[label] = Source(filename, digest, module)
    return label


def module_label(module: str) -> str:
    """A module name as an entry records it: an installed module (or one with no source)
    by its name, any other by its source's label."""
    found = sys.modules.get(module)
    path = getattr(found, "__file__", None)
    if not isinstance(path, str):
        return module
    return _label_file(path, module) or module


#: Labels of classes and functions, computed once per object: the code an object runs is
#: the code it was compiled from, whatever its file says later.
_OBJECT_LABELS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def object_label(obj: Any) -> str:
    """The label of the module a class or function was defined in: by the source its own
    code was compiled from (so a class run from a notebook cell's text is named as in the
    file holding that text), else by its module (``module_label``)."""
    try:
        return _OBJECT_LABELS[obj]
    except (KeyError, TypeError):
        pass
    label = _object_label(obj)
    with contextlib.suppress(TypeError):
        _OBJECT_LABELS[obj] = label
    return label


def _object_label(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or ""
    if isinstance(obj, (type, types.FunctionType)):
        filename = code_file(obj)
        if filename is not None:
            label = _label_file(filename, module or None)
            if label is not None:
                return label
            if os.path.isfile(filename) and is_library_file(filename):
                return module
    return module_label(module)


def module_root(module: str) -> list[Any]:
    """The root of a guard path that starts at a module's globals: ``["module", name]``
    for an installed module, ``["module", label, file name]`` for any other (found again
    by its source, under whatever name this process imported it)."""
    label = module_label(module)
    if not is_label(label):
        return ["module", module]
    return ["module", label, os.path.basename(sys.modules[module].__file__)]


_FOUND: dict[str, types.ModuleType] = {}


def find_module(label: str, file_name: str | None = None) -> types.ModuleType | None:
    """The loaded module whose source has ``label`` (those from a file named ``file_name``
    looked at first); None if no loaded module has it. Remembered while that module stays
    loaded under its name."""
    found = _FOUND.get(label)
    if found is not None and sys.modules.get(found.__name__) is found:
        return found
    modules = [m for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)
               and isinstance(getattr(m, "__file__", None), str)
               and not is_library_file(m.__file__)]
    named = [m for m in modules if os.path.basename(m.__file__) == file_name]
    for module in named + [m for m in modules if m not in named]:
        if _label_file(module.__file__, module.__name__) == label:
            _FOUND[label] = module
            return module
    return None


_LABEL_RE = re.compile(r"<src:[0-9a-f]{16}>")


def labels_in(data: Any) -> set[str]:
    """The source labels named anywhere in JSON-able ``data`` (guard records)."""
    return set(_LABEL_RE.findall(json.dumps(data)))


def source_data(labels: set[str]) -> dict[str, dict[str, Any]]:
    """What this process knows of ``labels`` (file name, module, hash), to be kept with
    an entry so that a later process can name what changed."""
    return {label: _SEEN[label].to_data() for label in sorted(labels) if label in _SEEN}


def describe(label: str, known: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """``{"file", "module", "digest"}`` of a label: from ``known`` (what another process
    recorded), else from what this process saw; the hash alone if neither knows it."""
    if known and label in known:
        return dict(known[label])
    if label in _SEEN:
        return _SEEN[label].to_data()
    return {"file": None, "module": None, "digest": label[len(LABEL_PREFIX):-1]}


def _split(name: str) -> tuple[str, str]:
    """``<src:…>.Outer.Inner`` → (label, ``Outer.Inner``); a library name → (name, "")."""
    if name.startswith(LABEL_PREFIX) and ">" in name:
        label, _, rest = name.partition(">")
        return label + ">", rest.removeprefix(".")
    return name, ""


def code_change(old: str, new: str, known: dict[str, dict[str, Any]] | None = None
                ) -> str | None:
    """Two names of code that differ (``<src:…>.Served``, a module label or an installed
    module's name), in words that never show one name on both sides: only the parts that
    differ, each ``before → after`` (the qualified name, the file, the module it was
    loaded as, the source's hash). None if neither names code outside a library.
    ``known``: what the process that recorded ``old`` knew of its labels."""
    (old_label, old_qual), (new_label, new_qual) = _split(old), _split(new)
    if not (is_label(old_label) or is_label(new_label)):
        return None
    parts = []
    if old_qual != new_qual:
        parts.append(f"{old_qual or old_label} → {new_qual or new_label}")
    a = describe(old_label, known) if is_label(old_label) else {"module": old_label}
    b = describe(new_label) if is_label(new_label) else {"module": new_label}
    if a.get("file") != b.get("file") and a.get("file") and b.get("file"):
        parts.append(f"file {a['file']} → {b['file']}")
    if a.get("module") != b.get("module") and a.get("module") and b.get("module"):
        parts.append(f"module {a['module']} → {b['module']}")
    if a.get("digest") != b.get("digest"):
        where = a.get("file") if a.get("file") == b.get("file") and a.get("file") else None
        what = f"source of {where}" if where else "source"
        parts.append(f"{what} {_short_digest(a)} → {_short_digest(b)}")
    qual = old_qual if old_qual == new_qual and old_qual else None
    said = ", ".join(parts) or f"{old} → {new}"
    return f"{qual}: {said}" if qual else said


def _short_digest(info: dict[str, Any]) -> str:
    digest = info.get("digest")
    return str(digest)[:8] if digest else "none (installed code)"


# -- is a traced file's code here? -------------------------------------------------------

def loaded_files() -> dict[str, list[str]]:
    """The files of the loaded modules outside installed libraries, by file name."""
    out: dict[str, list[str]] = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and path.endswith(".py") and not is_library_file(path):
            out.setdefault(os.path.basename(path), []).append(path)
    return out


def _same(path: str, digest: str, recorded: list[int] | None) -> bool:
    """Is the file at ``path`` the traced code? By its stamp where it equals the recorded
    one (a file of installed code, unchanged since: not read), else by its digest."""
    return (recorded is not None and stamp(path) == list(recorded)) or digest_of(path) == digest


def changed(path: str, digest: str, recorded: list[int] | None = None,
            loaded: dict[str, list[str]] | None = None, library: str | None = None
            ) -> str | None:
    """None if the code that a trace read from ``path`` (with ``digest``, and the file's
    stamp then, ``recorded``) is the code here; else the source that differs, in words
    (``/srv/app/layers.py``, or the recorded path with ``(not found)``). ``loaded``: the
    loaded modules' files (``loaded_files()``), computed once for many calls. ``library``:
    the file's path inside its library folder (``library_path``) where the trace found it
    in an installed library; then it is looked for as that library's file only
    (``library_changed``).

    A file outside installed libraries is decided by the loaded modules outside them from
    a file of that name where there are any (run from any folder, under any module name):
    one of them with the traced code is that code; else by the file at ``path`` itself (a
    module not imported yet); else by any loaded source or linecache text with that hash
    (the same text run from a notebook cell, or from a file of another name). Code that is
    in none of those places counts as changed.
    """
    if library is not None:
        return library_changed(path, digest, library, recorded)
    name = os.path.basename(path) if os.sep in path else path
    files = loaded_files() if loaded is None else loaded
    candidates = files.get(name, [])
    if candidates:
        if any(_same(p, digest, recorded) for p in candidates):
            return None
        return _nearest(candidates, path)
    if _same(path, digest, recorded):
        return None
    if any(digest_of(p) == digest for paths in files.values() for p in paths):
        return None
    if any(text_digest(n) == digest for n in list(linecache.cache)):
        return None
    return path if has_source(path) else f"{path} (not found)"


def library_changed(path: str, digest: str, library: str,
                    recorded: list[int] | None = None) -> str | None:
    """``changed`` for a file a trace read from an installed library, found as that
    library's file ``library`` (``peft/config.py``): the file of its module where that is
    loaded (also from an editable install), else that file in this environment's library
    folders, else the file at ``path``. Never another library's file of the same name,
    nor a file outside libraries."""
    module = sys.modules.get(library_module(library))
    where = getattr(module, "__file__", None)
    places = [where] if isinstance(where, str) and os.path.isfile(where) else []
    places += [root + library.replace("/", os.sep) for root in library_roots()]
    for place in [*places, path]:
        if os.path.isfile(place):
            return None if _same(place, digest, recorded) else place
    return f"{path} (not found)"


def _nearest(paths: list[str], path: str) -> str:
    """Of ``paths``, the one most like ``path``: itself, else the one ending in the most
    of its folders (the copy of a traced file, not another file of the same name)."""
    real = os.path.realpath(path)

    def likeness(p: str) -> tuple[bool, int]:
        a, b = os.path.realpath(p).split(os.sep), real.split(os.sep)
        tail = 0
        while tail < min(len(a), len(b)) and a[-1 - tail] == b[-1 - tail]:
            tail += 1
        return (os.path.realpath(p) == real, tail)

    return max(paths, key=likeness)


def stale(files: dict[str, str], stamps: dict[str, list[int]],
          libraries: dict[str, str] | None = None) -> list[str]:
    """The traced sources (``path`` → digest, with each file's stamp then, and the path
    inside its library folder of each file the trace found in an installed library)
    whose code is not the code of this process, each named where it differs
    (``changed``). A file recorded without its library path (an older entry) is taken
    for a library's file where it lies in one here."""
    loaded = loaded_files()
    libraries = libraries or {}
    found = (changed(path, digest, stamps.get(path), loaded,
                     libraries.get(path) or _here_library_path(path))
             for path, digest in files.items())
    return [where for where in found if where is not None]


def code_here(changed_files: list[str]) -> list[list[str | None]]:
    """What this process has where a trace read code that changed since (``stale``'s
    words for each file): each file's name and the hash of its code here (None where it
    is not found). Two processes with the same code say the same, whatever folder it lies
    in: where an entry of the other code is, theirs is found (``planner.lookup``)."""
    out: list[list[str | None]] = []
    for where in changed_files:
        path = where.removesuffix(" (not found)")
        digest = None if where.endswith(" (not found)") else digest_of(path)
        out.append([os.path.basename(path), digest])
    return sorted(out, key=lambda item: (item[0] or "", item[1] or ""))


def _here_library_path(path: str) -> str | None:
    return library_paths([path]).get(path)
