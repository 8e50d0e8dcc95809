"""Loading a MODEL.py: a file that defines ``build() -> cachebuild.ModelSpec``.

Every way a model file can be wrong (missing, failing to import, no ``build``, ``build``
raising or returning something else, or trying to end the process with ``sys.exit`` or
``os._exit`` while it is imported or built) becomes one UsageError naming the file, the
line and what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn

from cachebuild.errors import UsageError
from cachebuild.trust.processes import trusted_dir

# What imports torch is imported where it is used: the CLI checks a MODEL.py argument with
# this module before anything else (a wrong path is refused at once, not after torch).
if TYPE_CHECKING:
    from cachebuild.api import ModelSpec
    from cachebuild.store.interface import Store


def module_name(path: Path) -> str:
    """A module name for a model file, the same in every process (workers import it too)."""
    from cachebuild.tracing.guards import MODEL_MODULE_PREFIX

    return MODEL_MODULE_PREFIX + hashlib.sha1(str(path).encode()).hexdigest()[:16]


def _where(path: Path, error: BaseException) -> str:
    """``file:line`` of the deepest frame of ``error`` inside ``path`` (or the file alone)."""
    line = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else None
    for frame in traceback.extract_tb(error.__traceback__):
        if Path(frame.filename).resolve() == path:
            line = frame.lineno
    return f"{path}:{line}" if line else str(path)


class _Exited(BaseException):
    """``os._exit`` called by a model file while it was imported or built (see
    ``_exits_caught``)."""

    def __init__(self, code: object) -> None:
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def _exits_caught() -> Iterator[None]:
    """While the block runs, ``os._exit`` called on this thread of this process raises
    ``_Exited`` instead of ending the process (which would skip every handler, and end a
    command with status 0 and nothing said). A forked child's or another thread's call
    still exits: only the model file's own code, on the importing thread, is stopped."""
    real = os._exit
    pid, thread = os.getpid(), threading.get_ident()

    def _exit(code: int) -> NoReturn:
        if os.getpid() == pid and threading.get_ident() == thread:
            raise _Exited(code)
        real(code)

    modules = [m for m in (os, sys.modules.get("posix")) if m is not None]
    for module in modules:
        module._exit = _exit  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in modules:
            module._exit = real  # type: ignore[attr-defined]


def _how_it_exited(error: BaseException) -> str:
    if isinstance(error, _Exited):
        return f"os._exit({error.code!r})"
    return f"sys.exit({error.code!r})" if isinstance(error, SystemExit) else type(error).__name__


def package_of(path: Path) -> tuple[Path, str] | None:
    """For a file inside a package (folders with ``__init__.py`` up from it): the folder
    the package lies in and the file's dotted name (``pkg/models/m.py`` → ``pkg.models.m``,
    as ``python -m`` names it). None for a file that is not in a package."""
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    if len(parts) == 1 or not all(p.isidentifier() for p in parts):
        return None
    return folder, ".".join(parts)


_WHAT_A_MODEL_FILE_IS = "a model file is a .py file that defines build() -> cachebuild.ModelSpec"


def check_model_file(path: str | Path) -> Path:
    """``path``, resolved, if it names an existing ``.py`` file; else a UsageError that
    says what a model file is. Checked before anything is said or imported."""
    resolved = Path(path).resolve()
    if resolved.is_dir():
        raise UsageError(f"{resolved} is a directory; {_WHAT_A_MODEL_FILE_IS}")
    if not resolved.is_file():
        raise UsageError(f"{resolved}: no such model file; {_WHAT_A_MODEL_FILE_IS}")
    if resolved.suffix != ".py":
        raise UsageError(f"{resolved}: not a Python file; {_WHAT_A_MODEL_FILE_IS}")
    return resolved


def import_model(path: str | Path) -> ModuleType:
    """Import a model file as a module (its custom ops get registered) the way a server
    would: a file inside a package under its dotted name, with the folder holding the
    package first on ``sys.path`` (as ``python -m pkg.models.m`` has it, so that it
    imports its package's modules, relatively too); any other with its own folder first
    on ``sys.path`` (as ``python MODEL.py`` has it, so that it imports the modules
    beside it). A folder that another user could write (or rename) is never put on
    ``sys.path``: the file is then imported by itself."""
    path = check_model_file(path)
    # Imported already (``import llama``, or run as ``__main__``): running it twice would
    # register its custom ops twice, which torch refuses.
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and Path(file).name == path.name and Path(file).resolve() == path:
            return module
    package = package_of(path)
    folder = package[0] if package else path.parent
    # Its folder goes first on sys.path only where no other user could put a module there
    # (``processes.trusted_dir``): from a shared folder (``/tmp``) the file is imported by
    # itself, and everything it imports comes from where this process imports it.
    unsafe = trusted_dir(folder)
    if unsafe is not None:
        package = None
    elif str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    if package is not None:
        try:
            with _exits_caught():
                module = importlib.import_module(package[1])
        except (SystemExit, _Exited) as e:
            raise _ended(path, e, "while it was imported") from None
        except Exception as e:
            raise UsageError(f"{_where(path, e)}: the model file failed to import as "
                             f"{package[1]}: {type(e).__name__}: {e}") from e
        if Path(getattr(module, "__file__", "") or "").resolve() == path:
            return module
        # Another package of that name comes first on sys.path: the file by itself.
    name = module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    # check_model_file let only an existing .py file through: it always has a loader.
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with _exits_caught():
            spec.loader.exec_module(module)
    except (SystemExit, _Exited) as e:
        del sys.modules[name]
        raise _ended(path, e, "while it was imported") from None
    except Exception as e:
        del sys.modules[name]
        hint = (f" (its folder {folder} is not put on sys.path: {unsafe})"
                if unsafe is not None and isinstance(e, ImportError) else "")
        raise UsageError(f"{_where(path, e)}: the model file failed to import: "
                         f"{type(e).__name__}: {e}{hint}") from e
    return module


def _ended(path: Path, error: BaseException, when: str) -> UsageError:
    """The UsageError for a model file that tried to end the process ``when``."""
    return UsageError(f"{_where(path, error)}: the model file tried to end the process "
                      f"{when} ({_how_it_exited(error)}); a model file defines build(), "
                      "which returns a cachebuild.ModelSpec")


def load_spec(path: str | Path) -> ModelSpec:
    """Import ``path`` and call its ``build()``; the ModelSpec it returns."""
    from cachebuild.api import ModelSpec

    module = import_model(path)
    resolved = Path(path).resolve()
    build = getattr(module, "build", None)
    if not callable(build):
        raise UsageError(f"{resolved}: defines no build() function; add "
                         "`def build() -> cachebuild.ModelSpec`")
    try:
        with _exits_caught():
            spec = build()
    except (SystemExit, _Exited) as e:
        raise _ended(resolved, e, "in build()") from None
    except Exception as e:
        raise UsageError(f"{_where(resolved, e)}: build() raised {type(e).__name__}: {e}") from e
    if not isinstance(spec, ModelSpec):
        raise UsageError(f"{resolved}: build() returned {type(spec).__name__}, "
                         "not a cachebuild.ModelSpec")
    return spec


def entry_key(path: str | Path, store: Store) -> str:
    """The key of the entry that serves the model MODEL.py defines (the one whose guards
    hold on it, among the variants stored), from its spec alone: no tracing."""
    from cachebuild.building.planner import Planner

    spec = load_spec(path)
    planner = Planner(spec.model, spec.config, spec.dynamic_dims, store, touch=False)
    return planner.lookup(spec.example_inputs).key


def stored_entry_key(path: str | Path, store: Store) -> str:
    """``entry_key``, which the store must hold (UsageError naming the fix otherwise)."""
    key = entry_key(path, store)
    if not store.contains(key):
        raise UsageError(f"{path}: the model has no stored entry yet; run `cachebuild warm {path}`")
    return key
