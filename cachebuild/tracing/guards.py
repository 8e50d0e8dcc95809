"""What a trace read besides tensors, checked again with plain Python.

Dynamo bakes the Python values it reads while tracing (module attributes, config fields,
globals, environment variables) into the graph and guards them. A warm start skips Dynamo,
so an entry keeps those guards as ``GuardRecord``s: a path from a root (the model, a call
argument, a module's globals, the process) to a value, a check, and the fingerprint the
check gave at trace time. ``GuardSet.mismatches`` evaluates them on the live model with
attribute and item reads only, sharing every common path prefix, and names each value
that differs ("layers.0.mlp.act_fn: SiLU → GELUActivation").

This module must stay importable and runnable without ``torch._dynamo``: it is the warm
path. Turning Dynamo's guards into records is ``guard_export.py``'s job.
"""

from __future__ import annotations

import enum
import json
import os
import reprlib
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachebuild import compat, keep
from cachebuild.graph.weights import hooks_hidden
from cachebuild.trust.codehash import code_hash
from cachebuild.trust.sources import code_change, find_module, is_label, module_label, object_label

#: A path step: ``["attr", name]``, ``["item", key]``, ``["nthkey", i]`` (the i-th key of a
#: dict), ``["itemkey", i]`` (the value under it), ``["type"]``, ``["dict"]`` (a copy as a
#: plain dict). A path starts at a root: ``["model"]``, ``["arg", i]`` (positional
#: call argument i), ``["varargs", i]`` (a forward wrapper's ``*args``: the module and the
#: arguments, from position i), ``["kwargs"]`` (always empty), ``["module", name]``,
#: ``["env", name]`` (an environment variable, None if unset) or ``["state", name]``
#: (process-wide torch state such as the default dtype).
Step = list[Any]

#: The fingerprint of a path that does not resolve (an attribute that is not there).
MISSING = {"missing": True}

#: ``Py_TPFLAGS_HEAPTYPE``: a class a ``class`` statement made (or ``type()``): its
#: attributes can be set, and its instances may be given another such class.
HEAPTYPE = 1 << 9


class Unplain(ValueError):
    """A value with no plain, process-independent form."""


# -- plain values ----------------------------------------------------------------------

def plain(value: Any) -> Any:
    """``value`` as JSON data that is equal in every process where it is equal.

    Raises Unplain for objects compared by identity or by an ``__eq__`` we cannot see.
    """
    # Values equal in Python that a forward can still tell apart (``x is True``,
    # ``isinstance``, ``mode is Mode.FAST``) are kept apart: True is not 1, nor is an
    # IntEnum member its value.
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, enum.Enum):
        # With its value: an IntEnum or str Enum member is folded into the graph as its
        # value, so another value under the same names (a constant edited in its file, a
        # class made by a factory) is another forward.
        named = f"{qualname(type(value))}.{value.name}"
        try:
            return {"enum": named, "value": plain(value._value_)}
        except Unplain:  # a class, a function: compared by identity, never folded as a value
            return {"enum": named}
    if value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return {"torch": str(value)}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [plain(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"set": sorted((plain(v) for v in value), key=repr)}
    if isinstance(value, dict) and type(value) in (dict,):
        return {"dict": [[plain(k), plain(v)] for k, v in value.items()]}
    raise Unplain(f"{type(value).__name__} has no plain value")


def attribute(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr(obj, name, default)``, also where a user's ``__getattr__`` raises another
    error than AttributeError for a name it does not hold (a config reading a dict)."""
    try:
        return getattr(obj, name, default)
    except Exception:
        return default


def qualname(obj: Any) -> str:
    """``module.QualName`` of a class or function; code outside installed libraries by the
    label of its source (``sources.object_label``: ``<src:1a2b3c4d5e6f7a8b>.Served``)."""
    module = object_label(obj) if isinstance(obj, (type, types.FunctionType)) else \
        module_label(attribute(obj, "__module__") or "")
    name = attribute(obj, "__qualname__") or attribute(obj, "__name__") or repr(obj)
    return f"{module}.{name}" if module else name


#: The module name ``cachebuild.modelfile`` imports a MODEL.py under (plus a path hash).
MODEL_MODULE_PREFIX = "cachebuild_model_"


def identity(value: Any) -> Any:
    """What an identity check (Dynamo's ID_MATCH) compares, in a form that holds across
    processes: a module, class or function by its qualified name, a builtin by name, an
    enum member, a singleton or plain constant by value. Raises Unplain otherwise."""
    if isinstance(value, types.ModuleType):
        return {"module": module_label(value.__name__)}
    if isinstance(value, type):
        return {"class": qualname(value)}
    if isinstance(value, types.FunctionType):
        return {"function": qualname(value), "code": code_hash(value.__code__)}
    if isinstance(value, types.CodeType):
        return {"code": code_hash(value)}
    if isinstance(value, types.MethodType):
        return {"method": [identity(value.__func__), identity(value.__self__)]}
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType,
                          types.WrapperDescriptorType, types.MethodDescriptorType,
                          types.MethodWrapperType, types.ClassMethodDescriptorType)):
        owner = getattr(value, "__self__", None)
        owner_name = (qualname(owner) if isinstance(owner, type) else
                      getattr(owner, "__name__", None) if isinstance(owner, types.ModuleType)
                      else None)
        return {"builtin": qualname(value), "of": owner_name}
    if isinstance(value, torch._ops.OpOverload):
        return {"op": value.name()}
    if isinstance(value, torch._ops.OpOverloadPacket):
        return {"op": value._qualified_op_name}
    try:
        return plain(value)
    except Unplain:
        name = global_name(value)
        if name is None:
            raise
        return {"global": name, "type": qualname(type(value))}


def singleton(value: Any) -> bool:
    """Whether ``identity`` names ``value`` by the module global that holds it (an object
    with no plain value, held by a global of the module that defines its class)."""
    try:
        fingerprint = identity(value)
    except Unplain:
        return False
    return isinstance(fingerprint, dict) and "global" in fingerprint


def global_holder(value: Any) -> tuple[dict[str, Any], str] | None:
    """The globals of the module defining ``value``'s class and the (first) name under which
    they hold ``value``, or None. A module-level singleton (a sentinel, a function wrapped
    into an object by a decorator) is the same object in every process as long as that
    global holds it."""
    module = sys.modules.get(getattr(type(value), "__module__", None) or "")
    if module is None:
        return None
    names = sorted(k for k, v in list(vars(module).items()) if v is value)
    return (vars(module), names[0]) if names else None


def global_name(value: Any) -> str | None:
    """``module.name`` of the global that holds ``value`` (``global_holder``), or None."""
    held = global_holder(value)
    if held is None:
        return None
    return f"{module_label(held[0]['__name__'])}.{held[1]}"


def short(fingerprint: Any) -> str:
    """A fingerprint in words, for logs and ``explain``."""
    if fingerprint == MISSING:
        return "absent"
    if isinstance(fingerprint, dict) and len(fingerprint) == 1:
        ((tag, v),) = fingerprint.items()
        if tag == "float":
            return v
        if tag in ("class", "type"):
            return v.rsplit(".", 1)[-1]
        if tag in ("module", "torch", "enum", "op", "bool"):
            return str(v)
        if tag == "bytes":
            return repr(bytes.fromhex(v))
        if tag in ("list", "tuple", "set"):
            inner = ", ".join(short(x) for x in v)
            return f"({inner})" if tag == "tuple" else f"[{inner}]"
    if isinstance(fingerprint, dict) and "enum" in fingerprint:
        named = ".".join(fingerprint["enum"].rsplit(".", 2)[-2:])  # Class.MEMBER
        return f"{named} ({short(fingerprint['value'])})" if "value" in fingerprint else named
    if isinstance(fingerprint, dict) and "same_as" in fingerprint:
        return f"the object at {path_name(fingerprint['same_as'])}"
    if isinstance(fingerprint, dict) and "process_group" in fingerprint:
        return f"process group {fingerprint['process_group']!r} of {fingerprint.get('size')}"
    if isinstance(fingerprint, dict) and "builtin" in fingerprint:
        return fingerprint["builtin"].rsplit(".", 1)[-1]
    if isinstance(fingerprint, dict) and "global" in fingerprint:
        return fingerprint["global"].rsplit(".", 1)[-1]
    if isinstance(fingerprint, dict) and "function" in fingerprint:
        return fingerprint["function"].rsplit(".", 1)[-1]
    if isinstance(fingerprint, dict) and "code" in fingerprint:
        return f"code {fingerprint['code'][:8]}"
    if isinstance(fingerprint, str):
        return repr(fingerprint)
    return str(fingerprint)


# -- checks ----------------------------------------------------------------------------

def _check_type(value: Any, arg: Any) -> Any:
    return {"type": qualname(type(value))}


def _check_len(value: Any, arg: Any) -> Any:
    return len(value)


def _check_keys(value: Any, arg: Any) -> Any:
    keys = dict.keys(value) if isinstance(value, dict) else value.keys()
    return [plain(k) for k in keys]


def _check_tensor(value: Any, arg: Any) -> Any:
    """A tensor's metadata; ``arg``, where set, is a dim of any size (a call argument's
    dynamic dim: its size is the bucket's to check), with contiguity in place of the
    strides that size sets."""
    if not isinstance(value, torch.Tensor):
        return {"type": qualname(type(value))}
    meta = {"dtype": str(value.dtype), "shape": list(value.shape), "stride": list(value.stride()),
            "device": value.device.type, "requires_grad": value.requires_grad}
    if isinstance(arg, int) and 0 <= arg < value.dim():
        meta["shape"][arg] = None
        meta["stride"] = value.is_contiguous()
    return meta


def is_process_group(value: Any) -> bool:
    try:
        from torch._C._distributed_c10d import ProcessGroup
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(value, ProcessGroup)


def _check_process_group(value: Any, arg: Any) -> Any:
    """A process group by what a traced graph bakes in of it: its name (collectives find
    their group by name) and its size; never its rank, so every rank passes."""
    if not is_process_group(value):
        return {"type": qualname(type(value))}
    return {"process_group": str(value.group_name), "size": int(value.size())}


def _check_contains(value: Any, arg: Any) -> Any:
    return decode_key(arg) in value


def _check_in_dict(value: Any, arg: Any) -> Any:
    return arg in vars(value)


def _check_exists(value: Any, arg: Any) -> Any:
    return hasattr(value, arg)


def aliasable(value: Any) -> bool:
    """Whether a forward may tell ``value`` apart from an object of its class by identity
    alone (``x is OTHER``) where no other check names it: an object with no plain value
    that ``identity`` does not name either (a sentinel made by ``object()``, an instance
    held by a class attribute, a container or another module's global)."""
    if isinstance(value, (torch.Tensor, torch.nn.Module, type, types.ModuleType,
                          types.FunctionType, dict, list, tuple, set, frozenset)):
        # Tensors, submodules (by their type, code and weights), code and containers are
        # told apart otherwise.
        return False
    try:
        identity(value)
    except Unplain:
        return True
    return False


#: check name → fingerprint of the value at the path. Each is a plain read, but
#: ``alias``: the object itself, which ``GuardSet.values`` turns into which of the
#: records' paths it is the same object as (``_same_as``).
CHECKS: dict[str, Callable[[Any, Any], Any]] = {
    "type": _check_type,
    "id": lambda v, a: identity(v),
    "equals": lambda v, a: plain(v),
    "len": _check_len,
    "keys": _check_keys,
    "contains": _check_contains,
    "in_dict": _check_in_dict,
    "exists": _check_exists,
    "tensor": _check_tensor,
    "process_group": _check_process_group,
    "alias": lambda v, a: v,
}


def decode_key(data: Any) -> Any:
    """A dict key or index stored as data (see ``encode_key``), back as the value."""
    if isinstance(data, dict):
        if "bytes" in data:
            return bytes.fromhex(data["bytes"])
        if "tuple" in data:
            return tuple(decode_key(x) for x in data["tuple"])
    return data


def encode_key(key: Any) -> Any:
    """A dict key or index as JSON data (str, int, bytes, tuples of those)."""
    if isinstance(key, bool) or key is None:
        return key
    if isinstance(key, (int, str)):
        return key
    if isinstance(key, bytes):
        return {"bytes": key.hex()}
    if isinstance(key, tuple):
        return {"tuple": [encode_key(k) for k in key]}
    raise Unplain(f"cannot store a key of type {type(key).__name__}")


# -- records ---------------------------------------------------------------------------

Path = tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class GuardRecord:
    """One thing the trace depended on: ``CHECKS[check](value at path, arg) == expected``."""

    path: Path
    check: str
    arg: Any = None
    expected: Any = None

    def to_data(self) -> list[Any]:
        return [[list(s) for s in self.path], self.check, self.arg, self.expected]

    @classmethod
    def from_data(cls, data: list[Any]) -> GuardRecord:
        return cls(tuple(tuple(s) for s in data[0]), data[1], data[2], data[3])

    def name(self) -> str:
        """The value in words: ``layers.0.mlp.act_fn``, ``environment variable X``."""
        return path_name(self.path) + _SUFFIX.get(self.check, "").format(arg=_arg_text(self.arg))


_SUFFIX = {"contains": " has key {arg}", "in_dict": " overrides {arg}", "len": " length",
           "keys": " keys", "exists": ".{arg}", "alias": " (which object it is)"}


def _arg_text(arg: Any) -> str:
    key = decode_key(arg)
    return key.decode(errors="replace") if isinstance(key, bytes) else str(key)


def _module_name(root: Sequence[Any]) -> str:
    """A module root in words: an installed module by name, any other by its file's."""
    if is_label(root[1]) and len(root) > 2:
        return str(root[2]).removesuffix(".py")
    return str(root[1])


def path_name(path: Sequence[Sequence[Any]]) -> str:
    """A readable dotted name for a path, with module containers and parameter dicts
    folded (``hf.model.layers.0.mlp.act_fn``)."""
    steps = [list(s) for s in path]
    root = steps.pop(0) if steps else ["model"]
    kind = root[0]
    if kind == "env":
        return f"environment variable {root[1]}"
    if kind == "state":
        return f"torch {root[1].replace('_', ' ')}"
    out = _module_name(root) if kind == "module" else {
        "model": "", "arg": f"argument {root[-1]}", "varargs": "args",
        "kwargs": "kwargs"}.get(kind, kind)
    if steps[:3] == [["type"], ["attr", "forward"], ["attr", "__globals__"]]:
        steps = steps[3:]  # forward's globals: name the global plainly
        out = "globals"
    i = 0
    while i < len(steps):
        s = steps[i]
        if (s[0] == "attr" and s[1] in ("_modules", "_parameters", "_buffers")
                and i + 1 < len(steps) and steps[i + 1][0] == "item"):
            out += f".{decode_key(steps[i + 1][1])}"
            i += 2
            continue
        if s[0] == "attr":
            out += f".{s[1]}"
        elif s[0] == "item":
            out += f"[{decode_key(s[1])!r}]"
        elif s[0] == "nthkey":
            out += f".keys()[{s[1]}]"
        elif s[0] == "type":
            out = f"type({out.lstrip('.')})"
        i += 1
    return out.lstrip(".") or "the model"


@dataclass(frozen=True)
class Mismatch:
    """A guarded value that differs now: ``name: old → new`` in words."""

    name: str
    old: Any
    new: Any
    #: What the recording process knew of the source labels in ``old`` (``Entry.sources``).
    known: dict[str, dict[str, Any]] | None = None

    def describe(self) -> str:
        if self.name.startswith("environment variable"):
            return f"{self.name}: {_env_text(self.old)} → {_env_text(self.new)}"
        code = _code_change(self.old, self.new, self.known)
        if code is not None:
            return f"{self.name}: {code}"
        return f"{self.name}: {short(self.old)} → {short(self.new)}"


def describe_all(wrong: list[Mismatch], most: int = 3) -> str:
    """The first ``most`` of ``wrong`` in words, each once (two reads of one value differ
    alike), and how many more there are."""
    said = list(dict.fromkeys(m.describe() for m in wrong))
    return "; ".join(said[:most]) + (f" (and {len(said) - most} more)" if len(said) > most
                                     else "")


#: The fingerprint tags that name code: a class, a type check's class, a function, a module.
_CODE_TAGS = ("type", "class", "function", "module")


def _code_change(old: Any, new: Any, known: dict[str, dict[str, Any]] | None) -> str | None:
    """Two fingerprints naming code outside installed libraries, in words that say which
    part differs (``sources.code_change``); None for anything else."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return None
    for tag in _CODE_TAGS:
        a, b = old.get(tag), new.get(tag)
        if isinstance(a, str) and isinstance(b, str):
            if a == b and tag == "function" and old.get("code") != new.get("code"):
                return f"{short(old)}: code {str(old.get('code'))[:8]} → {str(new.get('code'))[:8]}"
            return code_change(a, b, known) if a != b else None
    return None


def _env_text(value: Any) -> str:
    return "unset" if value is None else repr(value)


# -- evaluation ------------------------------------------------------------------------

def process_state(name: str) -> Any:
    """Process-wide torch state a trace depends on, read plainly (no Dynamo)."""
    if name == "default_dtype":
        return torch.get_default_dtype()
    if name == "deterministic":  # and whether it fills what ``torch.empty`` leaves unset
        return [torch.are_deterministic_algorithms_enabled(),
                torch._C._get_deterministic_fill_uninitialized_memory()]
    if name == "default_device":
        return str(torch.get_default_device())
    if name == "autocast":
        return [torch.is_autocast_enabled(d) for d in keep.AUTOCAST_DEVICES]
    if name == "autocast_dtype":  # where autocast is on: the summary reads it only then
        return [str(torch.get_autocast_dtype(d)) if torch.is_autocast_enabled(d) else None
                for d in keep.AUTOCAST_DEVICES]
    if name == "deterministic_warn_only":
        return torch.is_deterministic_algorithms_warn_only_enabled()
    if name == "matmul_precision":  # what a forward, or Inductor, reads of how matmuls round
        return [str(value) for value in compat.matmul_rounding()]
    if name == "torch_function_modes":
        return len(torch.overrides._get_current_function_mode_stack())
    if name == "grad_enabled":  # recorded only where the traced code reads it
        return torch.is_grad_enabled()
    if name == "inference_mode":  # likewise
        return torch.is_inference_mode_enabled()
    raise KeyError(name)


#: Autograd's modes, as the trace saw them (``grad_mode_records``): recorded only where
#: the traced code reads one, since the trace and every compiled forward run without
#: autograd; a call in another mode runs such a forward eagerly.
GRAD_STATES = ("grad_enabled", "inference_mode")
_GRAD_NAMES = frozenset(path_name((("state", s),)) for s in GRAD_STATES)


def is_grad_mode(mismatch: Mismatch) -> bool:
    """Whether ``mismatch`` is a change of autograd's mode (``GRAD_STATES``) since the
    trace: no forward traced here serves that call (each is traced without autograd)."""
    return mismatch.name in _GRAD_NAMES


def grad_mode_changed(wrong: Sequence[Mismatch]) -> bool:
    """Whether any of ``wrong`` is a change of autograd's mode (``is_grad_mode``)."""
    return any(map(is_grad_mode, wrong))


#: Process state recorded with every entry: Dynamo's global-state guards in plain form
#: (grad mode aside: ``GRAD_STATES``).
STATE_NAMES = ("default_dtype", "deterministic", "default_device", "autocast",
               "autocast_dtype", "deterministic_warn_only", "matmul_precision",
               "torch_function_modes")


def root_value(root: Sequence[Any], model: Any, args: Sequence[Any]) -> Any:
    """The object a path starts from in this process."""
    kind = root[0]
    if kind == "model":
        return model
    if kind == "arg":
        return args[root[1]]
    if kind == "varargs":  # a wrapper's *args: the module, then the call's arguments
        return (model, *args)[root[1]:]
    if kind == "kwargs":
        return {}
    if kind == "module":
        if is_label(root[1]):  # code outside installed libraries: found by its source
            found = find_module(root[1], root[2] if len(root) > 2 else None)
            if found is None:
                raise KeyError(f"no loaded module has the source {root[1]}")
            return found
        # Guards are data: they read what is imported and never import anything (an
        # entry naming a module this process lacks is a mismatch, not an import).
        return sys.modules[root[1]]
    if kind == "env":
        return os.environ.get(root[1])
    if kind == "state":
        return process_state(root[1])
    raise KeyError(kind)


def step(value: Any, s: Sequence[Any]) -> Any:
    """Apply one path step to ``value`` (an attribute or item read)."""
    kind = s[0]
    if kind == "attr":
        return getattr(value, s[1])
    if kind == "item":
        return value[decode_key(s[1])]
    if kind == "nthkey":
        return list(dict.keys(value))[s[1]]
    if kind == "itemkey":
        return value[list(dict.keys(value))[s[1]]]
    if kind == "type":
        return type(value)
    if kind == "dict":
        return dict(value)
    raise KeyError(kind)


def resolve(path: Sequence[Sequence[Any]], model: Any, args: Sequence[Any]) -> Any:
    """The value at ``path``; raises whatever the first failing read raises."""
    value = root_value(path[0], model, args)
    for s in path[1:]:
        value = step(value, s)
    return value


def fingerprint(check: str, value: Any, arg: Any) -> Any:
    """What ``check`` compares of ``value``; raises Unplain where there is no plain form."""
    return CHECKS[check](value, arg)


#: What a path that does not read leads to (an attribute that is not there).
UNRESOLVED = object()
_UNRESOLVED = UNRESOLVED


def checked(check: str, value: Any, arg: Any) -> Any:
    """The fingerprint a record's check gives for ``value`` (its path's end, or
    ``UNRESOLVED``), as ``GuardSet.values`` reports it: never raises."""
    if value is UNRESOLVED:
        return False if check == "exists" else MISSING
    try:
        return CHECKS[check](value, arg)
    except Unplain:
        return {"unplain": type(value).__name__}
    except Exception:
        return MISSING

#: Path roots and steps as stored: their name and how many values follow it.
#: How many values each root of a guard path holds (a module outside installed libraries is
#: named by its source's label and its file's name: ``sources.module_root``).
_ROOTS = {"model": {0}, "arg": {1}, "varargs": {1}, "kwargs": {0}, "module": {1, 2}, "env": {1},
          "state": {1}}
_STEPS = {"attr": 1, "item": 1, "nthkey": 1, "itemkey": 1, "type": 0, "dict": 0}


def check_data(data: Any) -> list[list[Any]]:
    """``data`` if it is a guard list ``GuardSet`` can hold, else ValueError saying why:
    records of ``[path, check, arg, expected]`` whose path starts at a known root with a
    string or index, then known steps (an attribute by its name), and whose check is one
    of ``CHECKS``."""
    if not isinstance(data, list):
        raise ValueError("guards must be a list")
    for record in data:
        if not (isinstance(record, list) and len(record) == 4 and isinstance(record[0], list)
                and record[0] and isinstance(record[1], str) and record[1] in CHECKS):
            raise ValueError(f"not a guard record: {reprlib.repr(record)}")
        root, *steps = record[0]
        if not (isinstance(root, list) and root and isinstance(root[0], str)
                and len(root) - 1 in _ROOTS.get(root[0], ())
                and all(isinstance(v, str | int) and not isinstance(v, bool)
                        for v in root[1:])):
            raise ValueError(f"not a guard path root: {reprlib.repr(root)}")
        for s in steps:
            if not (isinstance(s, list) and s and isinstance(s[0], str)
                    and _STEPS.get(s[0]) == len(s) - 1
                    and (s[0] != "attr" or isinstance(s[1], str))
                    and (s[0] not in ("nthkey", "itemkey") or type(s[1]) is int)):
                raise ValueError(f"not a guard path step: {reprlib.repr(s)}")
    return data


@dataclass
class _Node:
    # step (as a tuple, or as canonical text where it holds an encoded key, a dict)
    # → (step, node)
    children: dict[Any, tuple[tuple[Any, ...], _Node]] = field(default_factory=dict)
    checks: list[tuple[int, str, Any]] = field(default_factory=list)  # (index, check, arg)


class GuardSet:
    """Records arranged as a tree of paths, so each shared prefix is read once.

    Built straight from the stored data (records are only made to name a mismatch), since
    a warm start reads every entry's guards once.
    """

    def __init__(self, data: Sequence[Sequence[Any]]) -> None:
        self.data = data
        self.expected = [d[3] for d in data]
        #: The ``alias`` records, with each one's path as JSON text (``_same_as``), in
        #: record order and by that text.
        self.aliases = [(i, json.dumps(d[0])) for i, d in enumerate(data) if d[1] == "alias"]
        self._aliases_by_text = sorted(self.aliases, key=lambda a: a[1])
        self.tree = _Node()
        for i, (path, check, arg, _) in enumerate(data):
            node = self.tree
            for s in path:
                key: Any = tuple(s)
                try:
                    found = node.children.get(key)
                except TypeError:  # an encoded key (a dict) in the step
                    key = json.dumps(s, sort_keys=True)
                    found = node.children.get(key)
                if found is None:
                    found = node.children[key] = (tuple(s), _Node())
                node = found[1]
            node.checks.append((i, check, arg))

    def __len__(self) -> int:
        return len(self.data)

    @property
    def records(self) -> list[GuardRecord]:
        return [GuardRecord.from_data(list(d)) for d in self.data]

    def values(self, model: Any, args: Sequence[Any]) -> list[Any]:
        """The fingerprint of every record in this process, in record order."""
        out: list[Any] = [None] * len(self.data)
        with hooks_hidden():  # traced without them, too
            for root, child in self.tree.children.values():
                try:
                    value = root_value(root, model, args)
                except Exception:
                    value = _UNRESOLVED
                self._walk(child, value, out)
        if self.aliases:
            self._same_as(out)
        return out

    def _same_as(self, out: list[Any]) -> None:
        """Turn each ``alias`` record's object in ``out`` into the path of the first (by
        its text) of the alias records' paths that holds the same object: a fingerprint
        that holds across processes, and differs once any of those paths holds another
        object (``mode is Mode.FAST`` after ``model.mode = Mode.SLOW``)."""
        first: dict[int, str] = {}
        for i, text in self._aliases_by_text:
            first.setdefault(id(out[i]), text)
        for i, _ in self.aliases:
            out[i] = {"same_as": json.loads(first[id(out[i])])}

    def _walk(self, node: _Node, value: Any, out: list[Any]) -> None:
        for i, check, arg in node.checks:
            out[i] = checked(check, value, arg)
        for s, child in node.children.values():
            nxt = _UNRESOLVED
            if value is not _UNRESOLVED:
                try:
                    nxt = step(value, s)
                except Exception:
                    pass
            self._walk(child, nxt, out)

    def mismatches(self, model: Any, args: Sequence[Any], values: list[Any] | None = None,
                   known: dict[str, dict[str, Any]] | None = None) -> list[Mismatch]:
        """Every record whose value differs in this process from the one traced (``known``:
        what the tracing process knew of the code it named, ``Entry.sources``)."""
        now = self.values(model, args) if values is None else values
        return [Mismatch(GuardRecord.from_data(list(self.data[i])).name(), want, v, known)
                for i, (want, v) in enumerate(zip(self.expected, now, strict=True))
                if v != want]

    def to_data(self) -> list[list[Any]]:
        return [list(d) for d in self.data]

    @classmethod
    def from_data(cls, data: Sequence[Sequence[Any]]) -> GuardSet:
        return cls(data)

    @classmethod
    def of(cls, records: Sequence[GuardRecord]) -> GuardSet:
        return cls([r.to_data() for r in records])
