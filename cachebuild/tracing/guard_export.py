"""Dynamo's guards, turned into plain ``GuardRecord``s when a trace is recorded.

Dynamo hands every guard of a compiled frame to a ``guard_filter_fn`` (a public
``torch.compile`` option) with its source (where the value lives: ``self.layers[0].act``,
a module global, a closure cell) and its kind (type, identity, value, length, keys...).
Each source becomes a path of attribute and item reads from the model, a call argument,
a module or ``builtins``; each kind becomes a check in ``guards.CHECKS``. The value is
read again through that path and compared with what Dynamo guarded, so a record is known
to read the very value the trace read.

Whatever has no plain form makes the trace unrecordable (``Unrecordable``): the model
still compiles and runs, but no entry is stored for it. Nothing is silently dropped; the
guard kinds that need no record say why in ``COVERED``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachebuild import compat
from cachebuild.keys import ENV_NAME
from cachebuild.tracing.guards import (
    HEAPTYPE,
    STATE_NAMES,
    GuardRecord,
    GuardSet,
    Unplain,
    aliasable,
    attribute,
    decode_key,
    encode_key,
    fingerprint,
    is_process_group,
    path_name,
    process_state,
    resolve,
    singleton,
    step,
)
from cachebuild.trust.sources import module_root

#: Guard kind → the check that compares the same thing plainly.
CHECK_OF = {
    "TYPE_MATCH": "type",
    "ID_MATCH": "id", "CLASS_MATCH": "id", "MODULE_MATCH": "id", "BUILTIN_MATCH": "id",
    "CLOSURE_MATCH": "id", "FUNCTION_MATCH": "id",
    "CONSTANT_MATCH": "equals", "EQUALS_MATCH": "equals", "BOOL_MATCH": "equals",
    "NONE_MATCH": "equals", "CONSTANT_SUBCLASS_MATCH": "equals",
    "SEQUENCE_LENGTH": "len", "TUPLE_ITERATOR_LEN": "len", "LIST_LENGTH": "len",
    "DICT_LENGTH": "len", "EMPTY_NN_MODULE_HOOKS_DICT": "len",
    "DICT_KEYS_MATCH": "keys", "DICT_KEYS": "keys", "MAPPING_KEYS_CHECK": "keys",
    "DICT_CONTAINS": "contains", "DICT_NOT_CONTAINS": "contains",
    "SET_CONTAINS": "contains", "SET_NOT_CONTAINS": "contains",
    "NOT_PRESENT_IN_GENERIC_DICT": "in_dict",
    "HASATTR": "exists",
}

#: Guard kinds Dynamo puts on a process group (``compat``: they differ by version): each
#: becomes one ``process_group`` record, which checks what the graph bakes in of the group
#: (its name and size).
PROCESS_GROUP_KINDS = compat.PROCESS_GROUP_GUARD_KINDS

#: Guard kinds that need no record, and why.
COVERED = {
    # Tensors: parameters and buffers by their metadata in the entry key, call arguments
    # by the runtime's check of every call; any other tensor gets a "tensor" record.
    "TENSOR_MATCH": "tensor",
    "NOT_NONE_MATCH": "tensor",
    # Two names of one object: each name's value is checked by its own records, and
    # tensors are bound by identity (one parameter, one graph input).
    "DUPLICATE_INPUT": "aliasing",
    # Symbolic-shape guards are checked against every compile range at trace time.
    "SHAPE_ENV": "shapes",
    # The trace and every compiled forward run without autograd.
    "GRAD_MODE": "no_grad",
    # Process-wide state: recorded as ``state`` records with every entry.
    "GLOBAL_STATE": "state", "DETERMINISTIC_ALGORITHMS": "state",
    "TORCH_FUNCTION_STATE": "state", "DEFAULT_DEVICE": "state",
    "AUTOGRAD_SAVED_TENSORS_HOOKS": "state", "FUNCTORCH_STACK_MATCH": "state",
    "DUAL_LEVEL": "state",
    # Which compiler Dynamo used: cachebuild's own capture, always.
    "BACKEND_MATCH": "backend",
}


class Unrecordable(Exception):
    """A guard with no plain form: the trace cannot be checked without Dynamo."""


@dataclass
class Collected:
    """What ``guard_filter_fn`` saw during one trace."""

    entries: list[Any] = field(default_factory=list)

    def __call__(self, entries: Sequence[Any]) -> list[bool]:
        self.entries.extend(entries)
        return [True] * len(entries)  # keep every guard: Dynamo's own frame stays exact


# -- sources → paths -------------------------------------------------------------------

@dataclass(frozen=True)
class Frame:
    """The traced frame, ``type(model).forward`` (possibly a decorator's wrapper): its
    positional parameters (the module itself first), its keyword-only ones, its ``*args``
    and ``**kwargs`` names, the variables it closes over, and how many positional
    arguments the traced call gave (``given``: the parameters after those held their
    defaults; ``defaults``: whether the traced frame is ``forward``'s, so that a parameter
    left out holds ``forward``'s default, not that of a ``__call__`` a subclass wrote,
    whose frame Dynamo traces instead)."""

    params: tuple[str, ...]
    varargs: str | None
    varkw: str | None
    freevars: tuple[str, ...]
    given: int = 0
    kwonly: tuple[str, ...] = ()
    defaults: bool = False

    @classmethod
    def of(cls, model: torch.nn.Module, given: int = 0) -> Frame:
        code = getattr(type(model).forward, "__code__", None)
        if code is None:  # not a Python function: only the module itself is known
            return cls(("self",), None, None, (), given)
        names = code.co_varnames
        n = code.co_argcount
        rest = n + code.co_kwonlyargcount
        varargs = names[rest] if code.co_flags & inspect.CO_VARARGS else None
        varkw = (names[rest + (varargs is not None)]
                 if code.co_flags & inspect.CO_VARKEYWORDS else None)
        return cls(tuple(names[:n]), varargs, varkw, tuple(code.co_freevars), given,
                   tuple(names[n:rest]), type(model).__call__ is torch.nn.Module.__call__)

    def local(self, name: str) -> list[list[Any]]:
        """The path of a local of the frame: the model, a call argument (or, for a
        parameter the call left out, its default, read from the function as a later call
        would get it), ``*args`` (a tuple of the module and the call's arguments),
        ``**kwargs`` (always empty: the model is called positionally), or a variable it
        closes over."""
        forward = [["model"], ["type"], ["attr", "forward"]]
        if name in self.params:
            i = self.params.index(name)
            if i == 0:
                return [["model"]]
            if i - 1 < self.given or not self.defaults:
                return [["arg", i - 1]]
            # ``__defaults__`` holds the last parameters' defaults, in order.
            return [*forward, ["attr", "__defaults__"], ["item", i - len(self.params)]]
        if name in self.kwonly and self.defaults:  # a positional call: it is its default
            return [*forward, ["attr", "__kwdefaults__"], ["item", name]]
        if name == self.varargs:
            return [["varargs", len(self.params)]]
        if name == self.varkw:
            return [["kwargs"]]
        if name in self.freevars:
            return [*forward, ["attr", "__closure__"],
                    ["item", self.freevars.index(name)], ["attr", "cell_contents"]]
        raise Unrecordable(f"local {name!r} of forward has no plain path")


def arity_record(args: Sequence[Any]) -> GuardRecord:
    """The record of how many positional arguments the traced call gave: a call with
    another count is another call (an argument given that the trace took the default of,
    or one too many, which the forward refuses), never the traced forward's."""
    return GuardRecord((("varargs", 1),), "len", None, len(args))


#: The names Dynamo's ``install_global_by_id`` gives: ``{prefix}_{id}_c{compile id}``.
_INSTALLED = re.compile(r"^\w*?_(\d+)_c\d+$")


def _installed_path(name: str) -> list[list[Any]]:
    """The path of what a global Dynamo installed stands for (``_<id>_c<n>``: ``type(x)``
    of a tensor reads ``torch.Tensor`` through one, a namedtuple the forward returns is
    made through one, the globals of its generated ``__new__`` through another); such
    names are gone at a warm start. The name holds the object's id and Dynamo keeps the
    object alive: a loaded module or its globals with that id, or an object held under
    that name by a module's globals and importable by its own name (a class or function
    of a module, by ``__module__`` and ``__qualname__``), or the globals of such a
    function."""
    wanted = int(_INSTALLED.match(name).group(1))  # type: ignore[union-attr]
    modules = list(sys.modules.items())
    for module_name, module in modules:
        if id(module) == wanted and isinstance(module, types.ModuleType):
            return [module_root(module_name)]
        if id(getattr(module, "__dict__", None)) == wanted:  # a scope: its globals
            return [module_root(module_name), ["attr", "__dict__"]]
    # An object: found where a module holds it (the name itself is gone once Dynamo is
    # reset), by what it is, so that a dead object's reused id matches nothing; looked
    # at by its type only (see ``class_made_with``).
    for _, module in modules:
        for value in list(getattr(module, "__dict__", {}).values()):
            if id(value) == wanted and issubclass(type(value), type | types.FunctionType):
                path = _importable(value)
                if path is not None:
                    return path
    made = class_made_with(lambda new: id(new.__globals__) == wanted)  # a namedtuple's
    path = _importable(made) if made is not None else None
    if path is not None:
        return [*path, ["attr", "__new__"], ["attr", "__globals__"]]
    raise Unrecordable(f"global {name!r} that Dynamo installed is neither a module nor "
                       "a class or function a module gives by its name")


def class_made_with(test: Callable[[types.FunctionType], bool]) -> type | None:
    """A class a module holds whose own ``__new__`` is a Python function ``test`` accepts:
    a namedtuple's, generated in a namespace of its own (``namedtuple_Out``), so neither
    that function's module nor its globals name the class. Classes are looked at by their
    type and own dict only: no attribute of another object is read (a module's lazy or
    deprecated names run code when read)."""
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            made = vars(value).get("__new__") if issubclass(type(value), type) else None
            made = made.__func__ if isinstance(made, staticmethod) else made
            if type(made) is types.FunctionType and test(made):
                return value
    return None


def _importable(value: Any) -> list[list[Any]] | None:
    """``value``'s path as its module and qualified name give it, where they do."""
    module_name = attribute(value, "__module__")
    qualname = attribute(value, "__qualname__")
    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    if module is None or not isinstance(qualname, str) or "<" in qualname:
        return None
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not value:
        return None
    return [module_root(module_name), *(["attr", part] for part in qualname.split("."))]


def _import_name(global_name: str) -> str | None:
    """The module Dynamo's ``__import_a_dot_b`` global stands for (``a.b``)."""
    prefix = "__import_"
    if global_name.startswith(prefix):
        return global_name[len(prefix):].replace("_dot_", ".")
    return None


def source_path(source: Any, frame: Frame) -> list[list[Any]]:
    """The path of a Dynamo source from a plain root; raises Unrecordable."""
    from torch._dynamo import source as S

    if isinstance(source, S.LocalSource):
        return frame.local(source.local_name)
    if isinstance(source, S.GlobalSource):
        name = source.global_name
        module = _import_name(name)
        if module is None and _INSTALLED.match(name):
            return _installed_path(name)
        if module is not None:
            return [module_root(module)]
        if name.startswith("__builtins_dict__"):
            return [["module", "builtins"], ["attr", "__dict__"]]
        # The frame's own globals: forward's, which may be a module's or an exec namespace.
        return [["model"], ["type"], ["attr", "forward"], ["attr", "__globals__"],
                ["item", name]]
    if isinstance(source, S.ImportSource):  # ``__import__('torch._functorch.vmap')``
        return [module_root(source.module_name)]
    # Module wrappers name the same object as their base.
    if isinstance(source, S.NNModuleSource):
        return source_path(source.base, frame)
    base = getattr(source, "base", None)
    if base is None:
        raise Unrecordable(f"source {type(source).__name__} has no plain path")
    path = source_path(base, frame)
    # Also parameter/buffer dicts and cell contents. A generic read
    # (``object.__getattribute__``, torch 2.11) finds what getattr finds whenever it finds
    # anything, and the value check at record time holds the two to the same value.
    if isinstance(source, S.AttrSource | S.GenericAttrSource):
        return path + [["attr", source.member]]
    if isinstance(source, S.TypeSource):
        return path + [["type"]]
    if isinstance(source, S.TypeDictSource):  # Dynamo reads dict(cls.__dict__)
        return path + [["attr", "__dict__"], ["dict"]]
    if isinstance(source, S.TypeMROSource):
        return path + [["attr", "__mro__"]]
    if isinstance(source, S.ClosureSource):
        return path + [["attr", "__closure__"]]
    if isinstance(source, S.CodeSource):
        return path + [["attr", "__code__"]]
    if isinstance(source, S.DefaultsSource):
        field_name = "__kwdefaults__" if source.is_kw else "__defaults__"
        return path + [["attr", field_name], ["item", encode_key(source.idx_key)]]
    if isinstance(source, S.ConstDictKeySource):
        return path + [["nthkey", source.index]]
    if isinstance(source, (S.DictGetItemSource, S.DictSubclassGetItemSource, S.GetItemSource)):
        index = source.index
        if isinstance(index, S.ConstDictKeySource):
            if index.base != base:
                raise Unrecordable("a dict read with a key of another dict")
            return path + [["itemkey", index.index]]
        if getattr(source, "index_is_slice", False):
            raise Unrecordable("a guarded slice")
        try:
            return path + [["item", encode_key(index)]]
        except Unplain as e:
            raise Unrecordable(str(e)) from e
    raise Unrecordable(f"source {type(source).__name__} has no plain path")


# -- guards → records --------------------------------------------------------------------

def _partial_kwargs(guard: Any) -> dict[str, Any]:
    fn = guard.create_fn
    return dict(fn.keywords) if isinstance(fn, functools.partial) else {}


def _environment(path: list[list[Any]], check: str, arg: Any, model: Any,
                 args: Sequence[Any]) -> GuardRecord | None:
    """An ``env`` record where ``path`` reads the environment (``os.environ._data``, which
    Dynamo reads through when it traces ``os.environ.get`` or ``os.getenv``)."""
    for k, s in enumerate(path):
        if s != ["attr", "_data"]:
            continue
        try:
            if resolve(path[:k + 1], model, args) is not os.environ._data:  # type: ignore[attr-defined]
                continue
        except Exception:
            continue
        rest = path[k + 1:]
        if check == "contains" and not rest:
            key = decode_key(arg)
        elif rest and rest[0][0] == "item":
            key = decode_key(rest[0][1])
        elif not rest and check == "type":
            return None  # the environment is a dict: the type record stays as it is
        else:
            raise Unrecordable("the forward reads the whole environment, not variables by name")
        name = key.decode() if isinstance(key, bytes) else str(key)
        return env_record(name)
    return None


def _direct(path: list[list[Any]]) -> list[list[Any]]:
    """``args[0]`` of a wrapper's ``*args`` is the model, ``args[i]`` call argument i-1."""
    if len(path) > 1 and path[0][0] == "varargs" and path[1][0] == "item" \
            and isinstance(path[1][1], int):
        i = path[0][1] + path[1][1]
        return [["model"] if i == 0 else ["arg", i - 1]] + path[2:]
    return path


def _record(entry: Any, check: str | None, model: Any, args: Sequence[Any],
            frame: Frame) -> GuardRecord:
    """The record of one guard; ``check`` None: only a process group has a plain form."""
    guard = entry.orig_guard
    source, arg, same_value = guard.originating_source, None, True
    if check == "contains":
        try:
            arg = encode_key(_partial_kwargs(guard)["key"])
        except Unplain as e:
            raise Unrecordable(f"{guard.name}: {e}") from e
    elif check in ("in_dict", "exists"):
        try:
            source, arg, same_value = compat.attribute_guard(guard)
        except ValueError as e:
            raise Unrecordable(f"{guard.name}: {e}") from e
    path = _direct(source_path(source, frame))
    env = _environment(path, check, arg, model, args)
    if env is not None:
        return env
    try:
        value = resolve(path, model, args)
    except Exception as e:
        raise Unrecordable(f"{guard.name}: not readable by a plain path ({type(e).__name__})") from e
    if check == "equals" and isinstance(value, types.CodeType):
        check = "id"  # Dynamo's CONSTANT_MATCH compares code objects by identity
    if check == "type" and singleton(value):
        # Dynamo guards ``x is OTHER`` between two objects of one class by their type
        # alone, so swapping one module-level singleton for another of its class is not
        # seen (torch.compile serves the old branch); which one it is, is recorded.
        check = "id"
    if entry.guard_type in PROCESS_GROUP_KINDS and is_process_group(value):
        check = "process_group"
    if check is None:
        raise Unrecordable(f"{guard.name}: Dynamo guard kind {entry.guard_type} has no plain "
                           "form")
    try:
        expected = fingerprint(check, value, arg)
        # The plain path must read what Dynamo read.
        if same_value and entry.has_value and fingerprint(check, entry.value, arg) != expected:
            raise Unrecordable(f"{guard.name}: a plain path reads another value than Dynamo's")
    except Unplain as e:
        raise Unrecordable(f"{guard.name} ({entry.guard_type}): {e}") from e
    return GuardRecord(tuple(tuple(s) for s in path), check, arg, expected)


def _tensor_record(entry: Any, model: Any, args: Sequence[Any], frame: Frame,
                   bound: set[int], dynamic_dims: dict[int, int]) -> GuardRecord | None:
    """None for a bound tensor (parameter, buffer, call argument); else its metadata. A
    call argument the graph does not bind (returned as it is) has its dynamic dim left
    out: its size is the bucket's to check."""
    value = entry.value if entry.has_value else None
    if isinstance(value, torch.Tensor) and id(value) in bound:
        return None
    record = _record(entry, "tensor", model, args, frame)
    root = record.path[0]
    if len(record.path) == 1 and root[0] == "arg" and root[1] in dynamic_dims:
        dim = dynamic_dims[root[1]]
        record = GuardRecord(record.path, "tensor", dim,
                             fingerprint("tensor", resolve(record.path, model, args), dim))
    return record


def _dynamo_internal(record: GuardRecord) -> bool:
    """A record on Dynamo's or Inductor's own modules (polyfills Dynamo substitutes while
    tracing): part of torch, whose version is in every key, and never imported warm."""
    root = record.path[0]
    return root[0] == "module" and str(root[1]).startswith(("torch._dynamo", "torch._inductor"))


def records_from(collected: Collected, model: torch.nn.Module, args: Sequence[Any],
                 bound: set[int], dynamic_dims: dict[int, int] | None = None
                 ) -> list[GuardRecord]:
    """Plain records for every guard Dynamo installed; raises Unrecordable.

    ``bound``: ids of the tensors the graph binds (parameters, buffers, arguments);
    ``dynamic_dims``: the call's, by argument.
    """
    frame = Frame.of(model, len(args))
    records: dict[tuple[Any, ...], GuardRecord] = {}
    for entry in collected.entries:
        kind = entry.guard_type
        if kind in COVERED:
            if COVERED[kind] != "tensor":
                continue
            record = _tensor_record(entry, model, args, frame, bound, dynamic_dims or {})
        elif kind in CHECK_OF or kind in PROCESS_GROUP_KINDS:
            record = _record(entry, CHECK_OF.get(kind), model, args, frame)
        else:
            raise Unrecordable(f"{entry.orig_guard.name or 'a guard'}: Dynamo guard kind "
                               f"{kind} has no plain form")
        if record is not None and not _dynamo_internal(record):
            # repr: a path may hold a key stored as a dict (a tuple key: ``encode_key``)
            records.setdefault((repr(record.path), record.check, repr(record.arg)), record)
            if record.check == "type" and _aliasable_at(record.path, model, args):
                # Dynamo guards ``x is OTHER`` between two objects of one class by their
                # type alone; which of the traced paths hold the same object is recorded
                # (its fingerprint is filled in below, from all of them).
                alias = GuardRecord(record.path, "alias")
                records.setdefault((repr(record.path), "alias", "None"), alias)
    for name in STATE_NAMES:
        path = (("state", name),)
        records[(repr(path), "equals", "None")] = GuardRecord(
            path, "equals", None, fingerprint("equals", process_state(name), None))
    return _with_aliases(list(records.values()), model, args)


def _aliasable_at(path: tuple[Any, ...], model: Any, args: Sequence[Any]) -> bool:
    """Whether the value at ``path`` is ``aliasable`` (False where it no longer reads)."""
    try:
        return aliasable(resolve(path, model, args))
    except Exception:
        return False


def _held_by(value: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """``(step, object)`` for what ``value`` holds one step away: a class's attributes
    (along its MRO), a list's or tuple's items, a dict's items (under keys a path can
    name), an object's or a module's attributes in its dict."""
    if isinstance(value, type):
        names = {n for c in getattr(value, "__mro__", ()) if c.__flags__ & HEAPTYPE
                 for n in vars(c)}
        for name in sorted(names):
            try:
                yield ("attr", name), getattr(value, name)
            except Exception:
                continue
    elif isinstance(value, (list, tuple)):
        yield from ((("item", i), v) for i, v in enumerate(list(value)))
    elif isinstance(value, dict):
        # By name only: other keys (a hook's handle number, an id) may differ from one
        # process to the next, and so would every fingerprint naming them.
        yield from ((("item", k), v) for k, v in list(value.items()) if isinstance(k, str))
    else:
        try:
            own = vars(value)
        except TypeError:
            return
        if isinstance(own, dict):
            yield from ((("attr", k), v) for k, v in list(own.items()) if isinstance(k, str))


def _with_aliases(records: list[GuardRecord], model: Any, args: Sequence[Any]
                  ) -> list[GuardRecord]:
    """``records`` with each ``alias`` record's fingerprint as the trace's objects give it
    (``GuardSet.values``: which paths hold the same object), and an ``alias`` record for
    every other place, one step from a value the records read (an attribute of an object
    or a class, an item of a container, a global of a module), that holds one of those
    objects. Dynamo guards an object only where it first met it: the second side of
    ``self.mode is MODES[1]`` is not guarded where it is the same object, nor is a class
    attribute read through the class (``Net.FAST``), yet either may change."""
    objects: dict[int, Any] = {}
    for r in records:
        if r.check == "alias":
            try:
                value = resolve(r.path, model, args)
            except Exception as e:  # changed since it was read (another thread)
                raise Unrecordable(f"{path_name(r.path)}: no longer readable") from e
            objects[id(value)] = value
    if not objects:
        return records
    # by repr: a path may hold a key stored as a dict (a tuple key: ``encode_key``)
    known = {repr(r.path) for r in records if r.check == "alias"}
    scanned: set[str] = set()
    for r in list(records):
        if repr(r.path) in scanned or r.path[0][0] in ("env", "state"):
            continue
        scanned.add(repr(r.path))
        try:
            value = resolve(r.path, model, args)
        except Exception:
            continue
        for hop, held in _held_by(value):
            path = (*r.path, hop)
            if id(held) in objects and objects[id(held)] is held and repr(path) not in known:
                known.add(repr(path))
                records.append(GuardRecord(path, "alias"))
    now = GuardSet.of(records).values(model, args)
    return [dataclasses.replace(r, expected=now[i]) if r.check == "alias" else r
            for i, r in enumerate(records)]


#: Variables a shell sets anew for each command or folder (bash's ``_`` is the command's
#: path): a constant of that name (``"_".join(...)``) is not taken for one the forward
#: reads, or ``cachebuild warm`` and the server would read other values.
_SHELL_NAMES = frozenset({"_", "PWD", "OLDPWD", "SHLVL"})


def environment_records(records: list[GuardRecord], code_objects: Sequence[types.CodeType],
                        model: Any, args: Sequence[Any]) -> list[GuardRecord]:
    """Records of the environment variables a trace may have read.

    Dynamo guards the environment object when traced code reads it, but not the variable
    read (not even its absence), so a variable set later would go unnoticed. Where the
    trace read the environment (``_reads_environment``), every string constant of the
    traced code that could name a variable, and every such string the trace's other
    records compare a value with (a name held
    by an attribute or a config object: ``os.environ.get(self.flag_name)``), is taken for
    a variable name and its value recorded: more than were read, never fewer named by a
    constant or a value the trace read. A name the forward builds from other strings
    (``"_".join(parts).upper()``) is not known; the README says so.
    """
    if not any(_reads_environment(r, model, args) for r in records):
        return []
    # A constant that looks like a variable's name (``keys.ENV_NAME``: any identifier,
    # ``PA_FLAG``, ``my_flag``, ``PA``) is taken for one: taking more names than were read
    # costs a watched value each; taking fewer would serve a forward traced for another value.
    names: set[str] = set()
    for code in code_objects:
        names |= {c for c in _constants(code) if ENV_NAME.fullmatch(c)}
    for r in records:
        if r.check == "equals":
            names |= {s for s in _strings(r.expected) if ENV_NAME.fullmatch(s)}
    names -= _SHELL_NAMES
    return [env_record(name) for name in sorted(names)]


def env_record(name: str) -> GuardRecord:
    """The record of environment variable ``name`` as it is now (None: unset)."""
    return GuardRecord((("env", name),), "equals", None, os.environ.get(name))


def module_path(name: str) -> tuple[tuple[Any, ...], ...]:
    """The record path of the model's submodule ``name`` (``""``: the model), through
    each module's ``_modules`` dict, as the per-call check watches it."""
    return (("model",), *[step for part in (name.split(".") if name else [])
                          for step in (("attr", "_modules"), ("item", part))])


def method_records(code_objects: Sequence[types.CodeType],
                   model: torch.nn.Module) -> list[GuardRecord]:
    """Records of the methods the trace inlined, by the class that holds them.

    Dynamo does not guard which function a module's class gives for a method it called
    (``self.post(y)``), so a method replaced on the class (``Model.post = ...``), in this
    process after the start or in another before it, would go unnoticed. For each class
    of the model's modules, every attribute (through its MRO, torch.nn.Module's own
    machinery aside) that is a function whose code the trace ran is recorded by identity
    (its qualified name and code hash), once per class and name, reached through the
    first module of that class that does not shadow it with an attribute of its own.
    """
    traced = set(code_objects)
    records: list[GuardRecord] = []
    done: set[tuple[type, str]] = set()
    methods_of: dict[type, dict[str, types.FunctionType]] = {}
    for name, module in model.named_modules():
        cls = type(module)
        if cls not in methods_of:
            resolved: dict[str, Any] = {}  # what the class gives for each name, as getattr
            for klass in reversed(cls.__mro__):
                if klass is not torch.nn.Module and klass is not object:
                    resolved.update(vars(klass))
            methods_of[cls] = {k: v for k, v in resolved.items()
                               if isinstance(v, types.FunctionType) and v.__code__ in traced}
        path = module_path(name)
        for attr, function in sorted(methods_of[cls].items()):
            if (cls, attr) not in done and attr not in vars(module):
                done.add((cls, attr))
                records.append(GuardRecord((*path, ("type",), ("attr", attr)), "id", None,
                                           fingerprint("id", function, None)))
    return records


def shadow_records(records: list[GuardRecord], model: Any,
                   args: Sequence[Any]) -> list[GuardRecord]:
    """Records that no class before the one a class attribute was read from holds it.

    Dynamo reads a class attribute where the MRO finds it
    (``dict(type(x).__mro__[i].__dict__)[name]``) and guards its value there, and that
    the instance does not shadow it, but not that the classes before ``i`` still lack it:
    ``Sub.scale = 3.0`` set on a subclass of the class that gave ``scale`` would go
    unnoticed (torch.compile serves the old value). For every such read at ``i > 0``, each
    class before it is recorded as not holding the name, on the path read, and on every
    module of the model whose class also inherits it (Dynamo reads one path for all
    of them: ``EncBlock`` and ``DecBlock`` both reading ``Block.scale``).
    """
    out: list[GuardRecord] = []
    seen: set[str] = set()

    def lacks(before: tuple[tuple[Any, ...], ...], name: Any) -> None:
        if repr((before, name)) in seen:
            return
        seen.add(repr((before, name)))
        try:
            value = resolve(before, model, args)
        except Exception as e:
            raise Unrecordable(f"a class before the one giving {name!r} is not readable "
                               f"({type(e).__name__})") from e
        out.append(GuardRecord(before, "contains", name, fingerprint("contains", value, name)))

    found: list[tuple[type, Any]] = []  # (the class that gave it, the name as stored)
    for record in records:
        path = record.path
        for k in range(len(path) - 4):
            mro, at, held, copied, item = path[k:k + 5]
            if mro != ("attr", "__mro__") or at[0] != "item" or not isinstance(at[1], int) \
                    or held != ("attr", "__dict__") or copied != ("dict",) or item[0] != "item":
                continue
            for j in range(at[1]):
                lacks((*path[:k + 1], ("item", j), held, copied), item[1])
            if at[1] > 0:
                try:
                    found.append((resolve(path[:k + 2], model, args), item[1]))
                except Exception:
                    continue  # the path above says it is not readable, if it is not
    done: set[tuple[type, str]] = set()
    for name, module in model.named_modules() if found else ():
        cls = type(module)
        path = module_path(name)
        for giver, stored in found:
            mro = cls.__mro__
            if giver not in mro[1:] or (cls, repr(stored)) in done:
                continue
            done.add((cls, repr(stored)))
            for j in range(mro.index(giver)):
                lacks((*path, ("type",), ("attr", "__mro__"), ("item", j),
                       ("attr", "__dict__"), ("dict",)), stored)
    return out


#: What code names to read autograd's modes (``torch.is_grad_enabled()``,
#: ``torch.is_inference_mode_enabled()``), by state (``guards.GRAD_STATES``).
_GRAD_MODE_READS = {"grad_enabled": "is_grad_enabled",
                    "inference_mode": "is_inference_mode_enabled"}


def grad_mode_records(code_objects: Sequence[types.CodeType],
                      traced_in: dict[str, Any]) -> list[GuardRecord]:
    """Records of autograd's modes as the trace ran (``traced_in``, by state: read inside
    the trace, which runs without grad), where the traced code names what reads them.
    Dynamo's guard on grad mode has no record (the trace and every compiled forward run
    without autograd), so a forward that branches on ``torch.is_grad_enabled()`` would be
    served the traced branch in any mode; with these, a call in another mode is told
    apart (``api``: it runs eagerly)."""
    names = {name for code in code_objects for name in code.co_names}
    records = []
    for state, reads in _GRAD_MODE_READS.items():
        if reads in names:
            path = (("state", state),)
            records.append(GuardRecord(path, "equals", None,
                                       fingerprint("equals", traced_in[state], None)))
    return records


def requires_grad_records(code_objects: Sequence[types.CodeType],
                          bound: Sequence[tuple[str, str | int]], model: Any,
                          args: Sequence[Any]) -> list[GuardRecord]:
    """Records of whether each tensor the graph binds requires grad, where the traced code
    may read it.

    Dynamo reads ``t.requires_grad`` as a constant and guards it with the tensor's own
    metadata, which the bound tensors (weights and call arguments) are checked by instead,
    without it: a forward that branches on it (``if self.w.requires_grad:``), called after
    ``model.requires_grad_(False)`` or with an input that requires grad, would be served
    the other branch. Where any code the trace ran names ``requires_grad``, every bound
    tensor's is recorded (more than were read, never fewer); a forward that never names
    it is served whatever its tensors' flags. ``bound``: ``("param" | "buffer", path)`` or
    ``("arg", index)`` per bound tensor.
    """
    if not any("requires_grad" in code.co_names for code in code_objects):
        return []
    records = []
    for kind, where in bound:
        if kind == "arg":
            path: tuple[tuple[Any, ...], ...] = (("arg", where),)
        else:
            module, _, name = str(where).rpartition(".")
            path = (*module_path(module),
                    ("attr", "_parameters" if kind == "param" else "_buffers"), ("item", name))
        path += (("attr", "requires_grad"),)
        records.append(GuardRecord(path, "equals", None,
                                   fingerprint("equals", resolve(path, model, args), None)))
    return records


def _environment_objects() -> tuple[Any, ...]:
    """What a trace that reads the environment reaches: ``os.environ`` (however it is
    held: ``os.environ``, ``from os import environ``, an attribute), its dict, or
    ``os.getenv``, whose read of the environment Dynamo inlines without a guard on it."""
    found = [os.environ, os.environ._data, os.getenv]  # type: ignore[attr-defined]
    found += [getattr(os, name) for name in ("environb", "getenvb") if hasattr(os, name)]
    return tuple(found)


def _reads_environment(record: GuardRecord, model: Any, args: Sequence[Any]) -> bool:
    """Whether ``record``'s path passes through the environment (``_environment_objects``)."""
    reached = _environment_objects()
    try:
        value = resolve(record.path[:1], model, args)
        for s in record.path[1:]:
            if any(value is o for o in reached):
                return True
            value = step(value, s)
    except Exception:
        return False
    return any(value is o for o in reached)


def _strings(value: Any) -> list[str]:
    """The strings in a record's expected value (a plain value: strings, numbers, lists
    and dicts of them)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    return []


def _constants(code: types.CodeType) -> list[str]:
    out: list[str] = []
    for c in code.co_consts:
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, tuple):
            out += [x for x in c if isinstance(x, str)]
    return out
