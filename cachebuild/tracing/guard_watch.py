"""An entry's guards, held on every call of its compiled forward, cheaply.

A start proves an entry's guards (``guards.GuardSet``) on the live model once. The values
can change afterwards, between two calls: a flag flipped, ``train()``, a peft adapter
switched or merged, a hook added, a config field edited, a global rebound, an environment
variable set. ``CallGuards.mismatches`` runs before every call and says whether the
compiled forward still computes what the model would.

A model of 22 layers has about 2,000 guards; reading them all again costs more than a
decode step on a GPU. So the check reads almost nothing. When the full check passes, the
watch is *armed*: each guard path is walked once, and every step that reads a dict entry
(an instance attribute, an item, a submodule, a module global, an environment variable) is
*watched* at that key (``dictwatch``: CPython tells when a watched dict changes). A guard
whose path is watched end to end and whose check depends only on the object it reaches (an
immutable value, a type, a dict's length or keys, also watched) needs no reading at all.
The rest (a class attribute, a list's contents, torch's process state, call arguments) is
read by one generated straight-line function, from the last watched object on its path.
A call then costs one comparison of the watch plus that function. When either finds a
difference, the full check runs: it names what changed, or, if nothing did, arms again.
"""

from __future__ import annotations

import enum
import gc
import keyword
import operator
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachebuild import compat
from cachebuild.dictwatch import ANY, kept_dicts
from cachebuild.tracing.guards import (
    GRAD_STATES,
    HEAPTYPE,
    UNRESOLVED,
    GuardSet,
    Mismatch,
    _Node,
    checked,
    decode_key,
    global_holder,
    root_value,
    singleton,
    step,
)

#: Types whose values never change in place: the same object always gives the same
#: fingerprint.
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, range, enum.Enum, type,
              types.FunctionType, types.ModuleType, types.BuiltinFunctionType,
              types.BuiltinMethodType, types.WrapperDescriptorType,
              types.MethodDescriptorType, types.ClassMethodDescriptorType, types.CodeType,
              torch.dtype, torch.device, torch.layout, torch.memory_format,
              torch._ops.OpOverload, torch._ops.OpOverloadPacket)

#: A pair to watch: a dict and a key of it (``ANY``: every key).
Pair = tuple[dict[Any, Any], Any]



def _singleton(check: str, value: Any) -> tuple[dict[str, Any], str] | None:
    """Where a module global holds ``value``, if an ``id`` check names it by that global
    (``guards.identity``): the same object keeps that answer while the global holds it."""
    if check != "id" or _immutable(value) or not singleton(value):
        return None
    return global_holder(value)


def _immutable(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_immutable(v) for v in value)
    return isinstance(value, _IMMUTABLE)


class CallGuards:
    """The guards of one entry, checked before each call of the forward built from it.

    ``mismatches(model, args)`` is the full check's answer (empty: every value the trace
    read is as it was), at the cost of one watch comparison and a few reads while nothing
    changed.
    """

    def __init__(self, guards: GuardSet, known: dict[str, dict[str, Any]] | None = None
                 ) -> None:
        self.guards = guards
        self.known = known
        self._fast: Callable[[Any, Sequence[Any]], bool] | None = None
        #: How often the full check ran (a first call, or a difference was seen).
        self.full_checks = 0
        #: Of this entry's guards, how many the armed check reads at each call.
        self.read_per_call = len(guards)

    def mismatches(self, model: Any, args: Sequence[Any]) -> list[Mismatch]:
        """Every guarded value that differs now from the one traced (none: the compiled
        forward may run)."""
        fast = self._fast
        if fast is not None:
            try:
                if fast(model, args):
                    return []
            except Exception:  # a path that no longer reads: the full check says what
                pass
        self.full_checks += 1
        wrong = self.guards.mismatches(model, args, known=self.known)
        if not wrong:
            self.arm(model, args)
            # A change made by another thread after that check and before the watch was
            # set would be the armed check's baseline: checked once more, now that the
            # watch is set, so that it is seen at the next call.
            if self.guards.mismatches(model, args, known=self.known):
                self._fast = None
        return wrong

    def arm(self, model: Any, args: Sequence[Any]) -> None:
        """Watch what every path leads to now (the guards hold now) and generate the check
        of what cannot be watched."""
        plan = _Plan(self.guards)
        plan.walk(model, args)
        self._fast = plan.generate(compat.dict_watcher().watch(plan.pairs))
        self.read_per_call = plan.read


@dataclass
class _Visit:
    """One node of the guard tree as arming found it."""

    node: _Node
    value: Any
    expr: str  # how the generated check reads it from its parent's variable
    watched: bool  # it cannot change without the watch seeing it
    open: list[tuple[int, str, Any]] = field(default_factory=list)  # checks read per call
    children: list[_Visit] = field(default_factory=list)
    needed: bool = False  # the generated check reads it (an open check below it)


class _Plan:
    """Arming, in two passes: ``walk`` finds what to watch and what to read per call,
    ``generate`` writes the per-call check."""

    def __init__(self, guards: GuardSet) -> None:
        self.tree = guards.tree
        self.pairs: list[Pair] = []
        self.consts: list[Any] = []
        self.roots: list[_Visit] = []
        self.read = 0
        self.names = 0
        self.lines: list[str] = []
        self.state: tuple[Any, ...] | None = None  # ``compat.process_state_signature``
        self.grad: tuple[bool, bool] | None = None  # ``_grad_modes``
        #: Functions an identity check names: the same object may be given other code
        #: (``fn.__code__ = ...``, as reloaders do), which no watched dict sees.
        self.functions: list[types.FunctionType] = []
        #: Objects whose type a guard reads (a type check, or a step to the class): the
        #: same object may be given another class (``obj.__class__ = Other``), which no
        #: watched dict sees either. By id, each once, with its type now.
        self.typed: dict[int, tuple[Any, type]] = {}
        #: Objects whose dict a watched step reads, with that dict, by id: the object may
        #: be given another dict (``obj.__dict__ = {...}``), which the watch does not see.
        self.owners: dict[int, tuple[Any, dict[str, Any]]] = {}
        #: Every ``alias`` record (index, object now), and the variable of the generated
        #: check that reads each one its watch does not cover: which of them are the
        #: same object is compared at each call (``_groups``).
        self.aliases: list[tuple[int, Any]] = []
        self.alias_vars: dict[int, str] = {}
        self.model: Any = None  # the model the watch was armed on (``walk``)

    # -- pass 1: what is watched --------------------------------------------------------

    def walk(self, model: Any, args: Sequence[Any]) -> None:
        self.model = model
        for root, child in self.tree.children.values():
            if root[0] == "state" and root[1] in GRAD_STATES:  # where the forward reads it
                self.grad = _grad_modes()
                continue
            if root[0] == "state":  # torch's process state: one summary for every record
                self.state = compat.process_state_signature()
                continue
            try:
                value = root_value(root, model, args)
            except Exception:
                value = UNRESOLVED
            watched = self.watch_root(root, value)
            visit = _Visit(child, value, self.root_expr(root), watched)
            self.visit(visit)
            self.roots.append(visit)

    def visit(self, v: _Visit) -> bool:
        """Fill in ``v`` and below; True where the generated check must read ``v``."""
        for i, check, arg in v.node.checks:
            function = v.value.__func__ if isinstance(v.value, types.MethodType) else v.value
            if check in ("id", "equals") and isinstance(function, types.FunctionType):
                self.functions.append(function)
            if check == "alias":
                self.aliases.append((i, v.value))
            if not (v.watched and self.covered(v.value, check, arg)):
                v.open.append((i, check, arg))
        for s, child in v.node.children.values():
            nxt = UNRESOLVED
            if v.value is not UNRESOLVED:
                try:
                    nxt = step(v.value, s)
                except Exception:
                    pass
            pairs = self.step_pairs(v.value, s, nxt) if v.watched else None
            if pairs is not None:
                self.pairs += pairs
            c = _Visit(child, nxt, self.step_expr(s), pairs is not None)
            if self.visit(c):
                v.children.append(c)
        self.read += len(v.open)
        v.needed = bool(v.open or v.children)
        return v.needed

    def watch_root(self, root: tuple[Any, ...], value: Any) -> bool:
        kind = root[0]
        if kind == "model":
            return True  # the same object for the life of the watch (attributes watched)
        if kind == "module" and value is not UNRESOLVED:
            if value is sys.modules.get(root[1]):  # by name: watched where it is found
                self.pairs.append((sys.modules, root[1]))
            return True
        if kind == "env":
            env = compat.environ_dict()
            if env is not None:
                data, encode = env
                self.pairs.append((data, encode(root[1])))
                return True
        return False  # call arguments and torch's process state: read at every call

    def step_pairs(self, parent: Any, s: tuple[Any, ...], value: Any) -> list[Pair] | None:
        """The dict entries whose change could make step ``s`` from ``parent`` read
        another object than ``value``; None where no dict holds it (read per call)."""
        if parent is UNRESOLVED:
            return None
        kind = s[0]
        if kind == "type":
            self.retypable(parent)
            return []  # the same type while the per-call check finds it so (``generate``)
        if kind == "item":
            key = decode_key(s[1])
            if isinstance(parent, dict):
                return [(parent, key)]
            return [] if isinstance(parent, tuple) else None
        if kind in ("nthkey", "itemkey", "dict"):
            return [(parent, ANY)] if isinstance(parent, dict) else None
        if kind != "attr":
            return None
        name = s[1]
        if isinstance(parent, types.FunctionType) and name == "__globals__":
            return []  # read-only
        found, descriptor = _class_attribute(type(parent), name)
        if descriptor:
            return None  # a property or slot: computed, not stored in a dict
        try:
            own = vars(parent)
        except TypeError:
            return None
        if not isinstance(own, dict):
            return None
        # Read through the object's dict: while it keeps that dict (``kept_dicts``) and
        # no class of its own sets ``name`` (a property added later wins over the dict;
        # an attribute added later wins over ``Module.__getattr__``).
        pairs: list[Pair] = [(own, name), *_class_pairs(type(parent), name)]
        if name not in own:
            held = False
            if isinstance(parent, torch.nn.Module):  # a submodule, parameter or buffer
                holders = [(h, own.get(h)) for h in ("_modules", "_parameters", "_buffers")]
                for holder, d in holders:
                    if isinstance(d, dict):
                        pairs += [(own, holder), (d, name)]
                held = value is UNRESOLVED or any(isinstance(d, dict) and name in d
                                                   for _, d in holders)
            if not held and (found or value is not UNRESOLVED):
                return None  # from the class, or made up by __getattr__: read per call
            # else held by the module, or absent: it appears there if it is ever set
        self.owners.setdefault(id(parent), (parent, own))
        return pairs

    def covered(self, value: Any, check: str, arg: Any) -> bool:
        """Whether ``check`` gives the same answer while ``value`` is the same object and
        what it watches here did not change."""
        if value is UNRESOLVED or check == "alias":
            # its path is watched where it stopped reading; or it leads to the same object
            return True
        if check == "type":
            self.retypable(value)
            return True  # while the per-call check finds the same type (``generate``)
        if check in ("id", "equals", "process_group") and _immutable(value):
            return True
        if check == "id" and value is self.model:
            # The model is the same object for the life of the watch; which global holds
            # it (its fingerprint where a script's global does) changes nothing it
            # computes, and watching that script's globals would see every other global
            # it sets (Python 3.11 watches whole dicts): a full check at every call.
            return True
        held = _singleton(check, value)
        if held is not None:  # the same object, still held by that global
            self.pairs.append(held)
            return True
        if check == "process_group":
            return True
        if isinstance(value, dict) and check in ("id", "equals", "len", "keys", "contains"):
            self.pairs.append((value, ANY))
            return True
        if check in ("len", "keys", "contains") and _immutable(value):
            return True
        if check == "in_dict":
            try:
                own = vars(value)
            except TypeError:
                return False
            self.pairs.append((own, arg))
            return True
        return False

    def retypable(self, value: Any) -> None:
        """Have the per-call check compare ``value``'s type, where it may be given
        another: an instance of a class defined in Python, or a module. Python refuses
        ``__class__ =`` on any other object (a dict, a list, a builtin's)."""
        if type(value).__flags__ & HEAPTYPE or isinstance(value, types.ModuleType):
            self.typed.setdefault(id(value), (value, type(value)))

    # -- pass 2: the per-call check -----------------------------------------------------

    def const(self, value: Any) -> str:
        self.consts.append(value)
        return f"K[{len(self.consts) - 1}]"

    def root_expr(self, root: tuple[Any, ...]) -> str:
        kind = root[0]
        if kind == "arg":
            return f"args[{int(root[1])}]"
        if kind == "varargs":
            return f"(model, *args)[{int(root[1])}:]"
        if kind == "kwargs":
            return "{}"
        if kind == "model":
            return "model"
        return f"ROOT({self.const(root)})"  # env, state, an unwatched module

    def step_expr(self, s: tuple[Any, ...]) -> str:
        if s[0] == "attr" and s[1].isidentifier() and not keyword.iskeyword(s[1]):
            return "{}." + s[1]
        if s[0] == "attr":
            return "getattr({}, " + self.const(s[1]) + ")"
        if s[0] == "item":
            return "{}[" + self.const(decode_key(s[1])) + "]"
        return "STEP({}, " + self.const(s) + ")"

    def generate(self, unchanged: Callable[[], bool]) -> Callable[[Any, Sequence[Any]], bool]:
        self.lines = ["    if not UNCHANGED():", "        return False"]
        if self.owners:
            self.lines += ["    if not KEPT():", "        return False"]
        if self.state is not None:
            self.lines += [f"    if STATE() != {self.const(self.state)}:", "        return False"]
        if self.grad is not None:
            self.lines += [f"    if GRAD() != {self.const(self.grad)}:", "        return False"]
        if self.functions:  # one comparison for all: identity first, element by element
            codes = [f.__code__ for f in self.functions]
            self.lines += [f"    if list(map(CODE, {self.const(self.functions)})) != "
                           f"{self.const(codes)}:", "        return False"]
        if self.typed:  # one comparison for all, as for the functions' code
            objects, classes = zip(*self.typed.values(), strict=True)
            self.lines += [f"    if list(map(type, {self.const(list(objects))})) != "
                           f"{self.const(list(classes))}:", "        return False"]
        for v in self.roots:
            if v.needed:
                self.emit(v, None)
        if self.alias_vars:
            # Objects read at each call: still the same as each other, and as the watched
            # ones, as they were? The watched ones' grouping cannot change unseen: it is
            # made once, here (their objects kept alive in K, so their ids stay theirs).
            fixed = [value for i, value in self.aliases if i not in self.alias_vars]
            self.const(fixed)
            known = {id(value): k for k, value in enumerate(fixed)}
            opened = [(i, value) for i, value in self.aliases if i in self.alias_vars]
            armed = _groups([value for _, value in opened], known)
            names = ", ".join(self.alias_vars[i] for i, _ in opened)
            self.lines += [f"    if GROUPS([{names}], {self.const(known)}) != "
                           f"{self.const(armed)}:", "        return False"]
        source = "def check(model, args):\n" + "\n".join(self.lines) + "\n    return True\n"
        scope: dict[str, Any] = {"K": self.consts, "STEP": step, "UNCHANGED": unchanged,
                                 "KEPT": kept_dicts(self.owners.values()),
                                 "CODE": operator.attrgetter("__code__"),
                                 "STATE": compat.process_state_signature,
                                 "GRAD": _grad_modes, "GROUPS": _groups,
                                 "ROOT": lambda root: root_value(root, None, ())}
        exec(compile(source, "<cachebuild guards>", "exec"), scope)
        return scope["check"]

    def emit(self, v: _Visit, parent: str | None) -> None:
        """Lines that read ``v`` (from ``parent``'s variable, or as the watched object
        itself) and check what is open there."""
        if v.value is UNRESOLVED and not v.watched:
            # It did not read when the guards held: it must still not read.
            self.lines += ["    try:", f"        {v.expr.format(parent)}",
                           "    except Exception:", "        pass", "    else:",
                           "        return False"]
            return
        if v.watched and v.value is not UNRESOLVED:
            expr = self.const(v.value)  # cannot change unseen: no need to read it again
        elif parent is None:
            expr = v.expr
        else:
            expr = v.expr.format(parent)
        self.names += 1
        name = f"v{self.names}"
        self.lines.append(f"    {name} = {expr}")
        for i, check, arg in v.open:
            if check == "alias":  # compared with the others, after every read
                self.alias_vars[i] = name
                continue
            self.lines += [f"    if {self.changed(name, check, arg, v.value)}:",
                           "        return False"]
        for c in v.children:
            self.emit(c, name)

    def changed(self, v: str, check: str, arg: Any, value: Any) -> str:
        """A condition that is true when the check may give another answer than it gives
        for ``value``: identity first where that decides, else the check itself."""
        fp = self.const(lambda x, check=check, arg=arg: checked(check, x, arg))
        exact = f"{fp}({v}) != {self.const(checked(check, value, arg))}"
        if check == "type":
            return f"type({v}) is not {self.const(type(value))} and {exact}"
        if check in ("id", "equals") and isinstance(value, types.MethodType):
            return (f"(getattr({v}, '__func__', None) is not {self.const(value.__func__)} or "
                    f"getattr({v}, '__self__', None) is not {self.const(value.__self__)}) "
                    f"and {exact}")
        if check in ("id", "equals", "process_group") and _immutable(value) or \
                _singleton(check, value) is not None:
            return f"{v} is not {self.const(value)} and {exact}"
        return exact


def _groups(objects: Sequence[Any], known: dict[int, int]) -> list[int]:
    """For each of ``objects``, its group: the one ``known`` gives its id (an object kept
    alive elsewhere, so the id is its own), else ``-1 - k`` for the first of ``objects``,
    the ``k``-th, that is the same object."""
    first: dict[int, int] = {}
    return [known[id(o)] if id(o) in known else first.setdefault(id(o), -1 - k)
            for k, o in enumerate(objects)]


def _class_pairs(cls: type, name: str) -> list[Pair]:
    """``name`` in the dict of every class along ``cls``'s MRO that can be given
    attributes (one a ``class`` statement made)."""
    pairs: list[Pair] = []
    for klass in cls.__mro__:
        if klass.__flags__ & HEAPTYPE:
            own = gc.get_referents(vars(klass))  # the dict behind the mappingproxy
            if len(own) == 1 and isinstance(own[0], dict):
                pairs.append((own[0], name))
    return pairs


def _class_attribute(cls: type, name: str) -> tuple[bool, bool]:
    """Whether ``cls`` defines ``name`` along its MRO, and whether that is a data
    descriptor (a property, a slot: it wins over the instance's dict)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            found = vars(klass)[name]
            kind = type(found)
            return True, hasattr(kind, "__set__") or hasattr(kind, "__delete__")
    return False, False


def _grad_modes() -> tuple[bool, bool]:
    """Autograd's modes (``guards.GRAD_STATES``): grad enabled, inference mode."""
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()
