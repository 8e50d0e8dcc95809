"""Loading a MODEL.py: a file that defines ``build() -> cachebuild.ModelSpec``.

Every way a model file can be wrong (missing, failing to import, no ``build``, ``build``
raising or returning something else) becomes one UsageError naming the file, the line
and what to do.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from cachebuild.api import ModelSpec
from cachebuild.errors import UsageError
from cachebuild.guards import MODEL_MODULE_PREFIX

if TYPE_CHECKING:
    from cachebuild.store.base import Store


def module_name(path: Path) -> str:
    """A module name for a model file, the same in every process (workers import it too)."""
    return MODEL_MODULE_PREFIX + hashlib.sha1(str(path).encode()).hexdigest()[:16]


def _where(path: Path, error: BaseException) -> str:
    """``file:line`` of the deepest frame of ``error`` inside ``path`` (or the file alone)."""
    line = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else None
    for frame in traceback.extract_tb(error.__traceback__):
        if Path(frame.filename).resolve() == path:
            line = frame.lineno
    return f"{path}:{line}" if line else str(path)


def import_model(path: str | Path) -> ModuleType:
    """Import a model file as a module (its custom ops get registered), with its folder
    first on ``sys.path`` as ``python MODEL.py`` has it, so that it imports the modules
    beside it."""
    path = Path(path).resolve()
    if not path.is_file():
        raise UsageError(f"{path}: no such model file")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    name = module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    # Imported already under another name (``import llama``, or run as ``__main__``):
    # running it twice would register its custom ops twice, which torch refuses.
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and Path(file).name == path.name and Path(file).resolve() == path:
            return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UsageError(f"{_where(path, e)}: the model file failed to import: "
                         f"{type(e).__name__}: {e}") from e
    return module


def load_spec(path: str | Path) -> ModelSpec:
    """Import ``path`` and call its ``build()``; the ModelSpec it returns."""
    module = import_model(path)
    resolved = Path(path).resolve()
    build = getattr(module, "build", None)
    if not callable(build):
        raise UsageError(f"{resolved}: defines no build() function; add "
                         "`def build() -> cachebuild.ModelSpec`")
    try:
        spec = build()
    except Exception as e:
        raise UsageError(f"{_where(resolved, e)}: build() raised {type(e).__name__}: {e}") from e
    if not isinstance(spec, ModelSpec):
        raise UsageError(f"{resolved}: build() returned {type(spec).__name__}, "
                         "not a cachebuild.ModelSpec")
    return spec


def entry_key(path: str | Path, store: Store) -> str:
    """The key of the entry that serves the model MODEL.py defines (the one whose guards
    hold on it, among the variants stored), from its spec alone: no tracing."""
    from cachebuild.planner import Planner

    spec = load_spec(path)
    planner = Planner(spec.model, spec.config, spec.dynamic_dims, store, touch=False)
    return planner.lookup(spec.example_inputs).key


def stored_entry_key(path: str | Path, store: Store) -> str:
    """``entry_key``, which the store must hold (UsageError naming the fix otherwise)."""
    key = entry_key(path, store)
    if not store.contains(key):
        raise UsageError(f"{path}: the model has no stored entry yet; run `cachebuild warm {path}`")
    return key
