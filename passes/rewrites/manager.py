"""The pass framework: the ``FusionPass`` base and the ``PassManager`` (the flags that
enable built-in passes, ``PassConfig``, are a plain value in ``cachebuild.config``).

A pass rewrites a ``torch.fx.Graph`` in place. Its ``uuid()`` is a hash of its own source
and of the source of the modules whose ops and kernels it emits, so editing either changes
every key the pass enters and nothing else. The manager runs the enabled passes in order
on a plain graph (the ``eager_fusion`` backend) and wraps itself as an Inductor
``CustomGraphPass`` on request; Inductor is imported only then, so a process that merely
loads artifacts never pays for it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import types
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

import torch.fx

from cachebuild.config import PassConfig
from cachebuild.keys import ENV_NAME, make_key, plain_data
from cachebuild.passes.rewrites.builtin import BUILTIN_PASSES


class FusionPass:
    """Base of every graph pass.

    Subclasses set ``name`` (short and stable: it names the pass in keys and counts),
    list in ``source_modules`` the importable modules whose source decides what the pass
    emits (its ops and kernels, shared matching helpers), and implement ``__call__``.
    What its code reads of its own module (helper functions and classes, constants such as
    a threshold) is in the uuid too (``_globals_read``); what it runs from any other module
    must be in one of ``source_modules``, or it escapes the uuid.
    """

    name: ClassVar[str] = ""
    source_modules: ClassVar[tuple[str, ...]] = ()

    def __call__(self, graph: torch.fx.Graph) -> int:
        """Rewrite ``graph`` in place and return the number of matches replaced."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement __call__")

    def uuid(self) -> str:
        """Hash of this pass's class source (and its bases up to ``FusionPass``), of what
        that code reads of its module, and of the source of every module in
        ``source_modules``."""
        return pass_uuid(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


#: Each pass class's own factors (its sources), by class object: a class object's code is
#: fixed once it is defined, and an edited module that is reloaded defines a new one.
_SOURCES: dict[type, dict[str, Any]] = {}


def pass_uuid(cls: type[FusionPass]) -> str:
    """The uuid of a pass class: its sources (read once per class object), and what its
    code reads of its module and the environment, as they are now (``_globals_read``:
    a constant reassigned, a variable set, since)."""
    factors = _SOURCES.get(cls)
    if factors is None:
        if not cls.name:
            raise TypeError(f"{cls.__qualname__} has no name")
        factors = _SOURCES[cls] = {
            "name": cls.name,
            "classes": [{"qualname": c.__qualname__, "source": _class_source(c)}
                        for c in _pass_classes(cls)],
            "modules": {m: module_source(m) for m in cls.source_modules},
        }
    read = {name: value for c in _pass_classes(cls) for name, value in _globals_read(c).items()}
    # only where there is any, so that the built-in passes' uuids stay as they were
    return make_key({**factors, "globals": read} if read else factors)


def _pass_classes(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if issubclass(c, FusionPass) and c is not FusionPass]


#: Names through which code reads the environment (a code object's constants that look
#: like a variable's name, ``keys.ENV_NAME``, are taken to be the names it reads).
_ENVIRONMENT = frozenset({"environ", "getenv", "environb"})


def _globals_read(cls: type) -> dict[str, str]:
    """What the code of ``cls`` reads from its own module's globals, there and through
    the module's functions and classes it calls: each function's and class's code by
    hash, each plain value (``keys.plain_data``) by ``repr`` (a threshold set at the top
    of a model file, say, which no class source shows); and the environment variables
    that code may read, with their values. A module in ``source_modules`` is hashed whole
    already."""
    module = sys.modules.get(cls.__module__)
    if module is None or cls.__module__ in getattr(cls, "source_modules", ()):
        return {}
    namespace = vars(module)
    read: dict[str, str] = {}
    todo = _codes_of(cls)
    while todo:
        code = todo.pop()
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        if _ENVIRONMENT & set(code.co_names):  # ``os.environ.get("CAP")``, ``getenv``
            for const in code.co_consts:
                if isinstance(const, str) and ENV_NAME.fullmatch(const):
                    read[f"env {const}"] = repr(os.environ.get(const))
        for name in code.co_names:
            if name in read or name.startswith("__") or name not in namespace:
                continue
            value = namespace[name]
            if plain_data(value):
                read[name] = repr(value)
            elif inspect.isfunction(value) and value.__module__ == module.__name__:
                read[name] = make_key({"source": _source(value)})
                todo.append(value.__code__)
            elif inspect.isclass(value) and value.__module__ == module.__name__ and \
                    value is not cls:
                read[name] = make_key({"source": _source(value)})
                todo += _codes_of(value)
    return read


def _codes_of(cls: type) -> list[types.CodeType]:
    """The code objects of a class's own functions (methods, static and class methods,
    properties)."""
    codes = []
    for value in vars(cls).values():
        for f in (value, getattr(value, "__func__", None), getattr(value, "fget", None),
                  getattr(value, "fset", None)):
            code = getattr(f, "__code__", None)
            if isinstance(code, types.CodeType):
                codes.append(code)
    return codes


def _source(obj: Any) -> str:
    """The source text of a function or class (its code's bytes where there is none)."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        code = getattr(obj, "__code__", None)
        return code.co_code.hex() if code is not None else obj.__qualname__


def pass_options(p: FusionPass) -> dict[str, str]:
    """What an instance of a pass was made with (``CapRelu(cap=100)``): each attribute
    of its own, a plain value by ``repr``, any other by its type."""
    return {name: repr(value) if plain_data(value) else type(value).__qualname__
            for name, value in sorted(vars(p).items())}


def _class_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError) as exc:
        raise TypeError(
            f"cannot read the source of pass {cls.__qualname__}: a pass must be defined in "
            f"a file so that its uuid can follow edits ({exc})"
        ) from exc


def module_source(module_name: str) -> str:
    """The source text of an importable module, read from its file without importing it
    (so hashing the kernels module does not import Triton)."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None or not spec.has_location:
        raise ModuleNotFoundError(f"no source file for module {module_name!r}")
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


def changed_passes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Names of the passes that differ between two ``PassManager.factors()`` dicts: edited
    (uuid changed), added or removed, in the new order then the removed ones. Lets a
    manifest diff say which pass invalidated a target."""
    before = {p["name"]: (p["uuid"], p.get("options")) for p in old.get("passes", [])}
    after = {p["name"]: (p["uuid"], p.get("options")) for p in new.get("passes", [])}
    changed = [name for name, uuid in after.items() if before.get(name) != uuid]
    return changed + [name for name in before if name not in after]


def pass_class(flag: str) -> type[FusionPass]:
    """The built-in pass class behind a ``PassConfig`` flag (``builtin.BUILTIN_PASSES``)."""
    module_name, class_name = BUILTIN_PASSES[flag]
    return getattr(importlib.import_module(module_name), class_name)


def passes_for_config(config: PassConfig) -> list[FusionPass]:
    """One instance of every built-in pass ``config`` enables, in running order."""
    enabled = set(config.enabled())
    return [pass_class(flag)() for flag in BUILTIN_PASSES if flag in enabled]


class PassManager:
    """Runs passes in order on an FX graph.

    Usable directly on a plain graph (``manager(graph)``), and as Inductor's
    ``post_grad_custom_post_pass`` through ``as_inductor_pass()``. Match counts of the
    latest run are in ``last_counts``; ``total_counts`` sums every run of this manager
    (one per compiled graph when used by Inductor).
    """

    def __init__(self, passes: Sequence[FusionPass] = (), config: PassConfig | None = None):
        self.passes: list[FusionPass] = list(passes)
        self.config = config if config is not None else PassConfig()
        names = [p.name for p in self.passes]
        duplicated = sorted(n for n, c in Counter(names).items() if c > 1)
        if duplicated:
            raise ValueError(f"passes with the same name: {duplicated}")
        self.last_counts: dict[str, int] = {}
        self.total_counts: Counter[str] = Counter()

    @classmethod
    def from_config(cls, config: PassConfig) -> PassManager:
        """A manager with the built-in passes ``config`` enables, clean-up last."""
        return cls(passes_for_config(config), config=config)

    def __call__(self, graph: torch.fx.Graph | torch.fx.GraphModule) -> dict[str, int]:
        """Run every pass on ``graph`` in place; return the matches per pass name.

        A ``GraphModule`` is accepted too: its graph is rewritten and its code regenerated.
        """
        module = graph if isinstance(graph, torch.fx.GraphModule) else None
        fx_graph = module.graph if module is not None else graph
        counts: dict[str, int] = {}
        for p in self.passes:
            counts[p.name] = int(p(fx_graph))
        if any(counts.values()):
            fx_graph.lint()
        if module is not None:
            module.recompile()
        self.last_counts = counts
        self.total_counts.update(counts)
        return counts

    def uuid(self) -> str:
        """Hash of ``factors()``: changes with the config or any pass's source."""
        return make_key(self.factors())

    def factors(self) -> dict[str, Any]:
        """What the passes contribute to a key: the config and each pass's name, uuid and
        options (``pass_options``)."""
        return {
            "config": self.config.factors(),
            # a pass's options only where it has any, so that the usual keys stay as were
            "passes": [{"name": p.name, "uuid": p.uuid(),
                        **({"options": pass_options(p)} if vars(p) else {})}
                       for p in self.passes],
        }

    def as_inductor_pass(self) -> Any:
        """This manager as an Inductor ``CustomGraphPass`` (imports Inductor's base class).

        The result's ``uuid()`` is this manager's, so Inductor's own caches are keyed by
        the passes too.
        """
        from cachebuild.passes.rewrites.inductor_pass import InductorPassAdapter

        return InductorPassAdapter(self)

    def __repr__(self) -> str:
        return f"PassManager({[p.name for p in self.passes]!r}, config={self.config!r})"
