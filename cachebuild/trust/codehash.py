"""Hashes of code: of a source by its syntax tree (``ast_hash``: a file, or the text
``linecache`` holds for code compiled from a string, as notebooks register their cells),
and of code that has no source at all: a class defined in ``python -c`` or through an
``exec`` that registered no text.

Such code cannot be checked by hashing its source, so it is keyed by what its code objects
contain: bytecode, constants (nested code objects recursively), names, and the defaults of
its functions. Two classes hash equal exactly when they run the same bytecode on the same
constants.
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import os
import types
from typing import Any

import xxhash


def ast_hash(path: str) -> str | None:
    """Hash of a Python file's syntax tree: comments and blank lines do not change it."""
    try:
        with open(path, "rb") as f:
            return ast_hash_text(f.read())
    except OSError:
        return None


def ast_hash_text(source: bytes) -> str | None:
    """``ast_hash`` of source text (None if it is not Python)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    return xxhash.xxh3_128_hexdigest(
        ast.dump(tree, annotate_fields=False, include_attributes=False).encode())


def linecache_text(name: str) -> str | None:
    """The text ``linecache`` holds for code compiled from a string under ``name`` (a
    notebook cell, an ``exec`` that registered its source); None for files and unknowns."""
    entry = linecache.cache.get(name)
    if not isinstance(entry, tuple) or len(entry) != 4 or entry[1] is not None:
        return None  # a file's cached lines (checked through the file), or a lazy entry
    lines = entry[2]
    return "".join(lines) if isinstance(lines, list) else None


def code_file(obj: Any) -> str | None:
    """The file (or linecache name) the code of a class, function or code object was
    compiled from: for a class, that of a function in its body (its module's file may be
    another: a class exec'd in a script's ``__main__`` namespace), else its module's."""
    if isinstance(obj, types.CodeType):
        return obj.co_filename
    if isinstance(obj, types.FunctionType):
        return obj.__code__.co_filename
    if isinstance(obj, type):
        for value in vars(obj).values():
            for fn in _functions(value):
                # Only a function of its body, from a source there is: an Enum's class holds
                # enum.py's functions, a namedtuple's are collections' (named as its own),
                # a dataclass's ``__init__`` was compiled from a string and its ``__repr__``
                # is a wrapper written in dataclasses.py.
                path = fn.__code__.co_filename
                if fn.__qualname__.startswith(f"{obj.__qualname__}.") \
                        and getattr(fn, "__module__", None) == obj.__module__ \
                        and fn.__code__.co_name == fn.__name__ \
                        and (os.path.isfile(path) or linecache_text(path) is not None):
                    return path
    try:
        return inspect.getsourcefile(obj)
    except (OSError, TypeError):
        return None


def has_source(obj: Any) -> bool:
    """True if ``obj`` (a class, function or code object) comes from a source that can be
    hashed: a file on disk, or text linecache holds for it."""
    path = code_file(obj)
    return bool(path) and (os.path.isfile(path) or linecache_text(path) is not None)


@functools.lru_cache(maxsize=4096)
def _class_has_source(cls: type) -> bool:
    return has_source(cls)


def _const(value: Any, h: Any) -> None:
    if isinstance(value, types.CodeType):
        _code(value, h)
    elif isinstance(value, (frozenset, set)):
        h.update(b"set(")
        for r in sorted(repr(v) for v in value):  # string hashes vary per process
            h.update(r.encode())
        h.update(b")")
    elif isinstance(value, tuple):
        h.update(b"(")
        for v in value:
            _const(v, h)
        h.update(b")")
    else:
        h.update(f"{type(value).__name__}:{value!r};".encode())


def _code(code: types.CodeType, h: Any) -> None:
    h.update(code.co_code)
    for names in (code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars):
        h.update(repr(names).encode())
    h.update(repr((code.co_argcount, code.co_kwonlyargcount, code.co_flags)).encode())
    for value in code.co_consts:
        _const(value, h)


_CODE_HASHES: dict[int, tuple[types.CodeType, str]] = {}


def code_hash(code: types.CodeType) -> str:
    """Hash of what one code object contains (cached per object for this process)."""
    known = _CODE_HASHES.get(id(code))
    if known is not None and known[0] is code:
        return known[1]
    h = xxhash.xxh3_128()
    _code(code, h)
    digest = h.hexdigest()
    _CODE_HASHES[id(code)] = (code, digest)
    return digest


def code_objects(cls: type) -> list[types.CodeType]:
    """The code objects of a class's own functions (methods, static and class methods,
    properties), nested code included."""
    out: list[types.CodeType] = []

    def add(code: types.CodeType) -> None:
        out.append(code)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                add(c)

    for value in vars(cls).values():
        for fn in _functions(value):
            add(fn.__code__)
    return out


def _functions(value: Any) -> list[types.FunctionType]:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if isinstance(f, types.FunctionType)]
    return [value] if isinstance(value, types.FunctionType) else []


def class_hash(cls: type) -> str:
    """Hash of a class's code: every function defined in its body (in name order), their
    defaults, and the plain class attributes."""
    h = xxhash.xxh3_128()
    h.update(cls.__qualname__.encode())
    for name in sorted(vars(cls)):
        value = vars(cls)[name]
        h.update(f"|{name}=".encode())
        functions = _functions(value)
        if functions:
            for fn in functions:
                _code(fn.__code__, h)
                _const(fn.__defaults__ or (), h)
        elif isinstance(value, (int, float, str, bytes, bool, type(None), tuple, frozenset)):
            _const(value, h)
        else:
            h.update(type(value).__qualname__.encode())
    return h.hexdigest()


def sourceless_classes(model: Any) -> list[type]:
    """The classes of ``model``'s modules (and their bases) that have no source (no file,
    no linecache text), in a stable order."""
    classes = dict.fromkeys(type(m) for m in model.modules())
    seen: dict[type, None] = {}
    for module_class in classes:
        for cls in module_class.__mro__:
            if cls not in seen and cls.__module__ != "builtins" and not _class_has_source(cls):
                seen[cls] = None
    return list(seen)
