"""Python child processes that import only what they should.

Build workers and the toolchain probe's child run code as this process's user (often
root), so what they import must be what this process would import, never a module that
another user planted in a shared folder. A plain ``python -m cachebuild.worker`` puts the
working directory first on ``sys.path``: run from a world-writable folder (``/tmp``), it
would import a ``cachebuild/`` or ``torch/`` package anyone put there. So a child is
started by ``python_command``:

- isolated (``python -I``): no working directory or script folder on ``sys.path``, no
  user site, no ``PYTHON*`` variables read; the settings that only decide how bytecode
  and text are handled are passed as flags instead (``-B``, ``-X pycache_prefix`` where
  that folder is safe, ``-X utf8``, ``-W`` but for ``error``);
- with the caller's own ``sys.path`` entries, in the caller's order, where each passes the
  store's checks (``trusted_dir``: a directory owned by us or root that no one else may
  write, under directories no one else could rename), so that the child still finds
  cachebuild (installed, editable, or on ``PYTHONPATH``) and the modules that register a
  model's ops; an entry that fails, and the working directory, are never passed;
- with ``child_env``: this environment without the ``PYTHON*`` variables that steer
  imports (``PYTHONPATH``, ``PYTHONHOME``, ``PYTHONSTARTUP``, ...), and with
  ``PYTHONSAFEPATH=1``, so that the Python processes a child starts in turn (Inductor's
  ISA checks run ``python -c``, its compile workers ``python FILE``) put neither their
  working directory nor their script's folder first either.
"""

from __future__ import annotations

import json
import os
import site
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

#: ``PYTHON*`` variables a child's environment keeps: they decide how output, text and
#: bytecode are handled, never what is imported.
KEPT_PYTHON_VARIABLES = ("PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PYTHONIOENCODING",
                         "PYTHONUTF8", "PYTHONHASHSEED", "PYTHONFAULTHANDLER", "PYTHONWARNINGS")

#: Run in the isolated child: put the given entries first on ``sys.path``, then run the
#: module as ``python -m`` would.
_BOOT = ("import json, runpy, sys\n"
         "given = json.loads(sys.argv[1])\n"
         "sys.path[:] = given + [p for p in sys.path if p not in given]\n"
         "sys.argv = sys.argv[2:]\n"
         "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


def trusted_dir(path: str | os.PathLike[str]) -> str | None:
    """Why code under ``path`` may not be imported (None if it may): it must be an existing
    directory owned by us or root that no one else may write, and no one but us or root
    could rename it or a directory above it (the store's own checks, said of a folder
    modules are imported from)."""
    import stat

    from cachebuild.store import UnsafeStore, check_links, check_parents, others_can_write

    what = "import folder"
    fix = ("a module put there would run in this process; keep the model and the modules "
           "it imports in a folder only you (or root) can change")
    try:
        check_links(path, what)
        real = Path(os.path.realpath(path))
        st = os.stat(real)
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a directory"
        if st.st_uid not in (0, os.geteuid()):
            return f"{path} is owned by uid {st.st_uid}, who could put a module there; {fix}"
        if others_can_write(st, real):
            return (f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                    f"{fix}, or make it yours alone (chmod go-w {path})")
        check_parents(real, what, fix)
    except UnsafeStore as e:
        return str(e)
    except OSError as e:
        return f"cannot check {path}: {e.strerror or e}"
    return None


def withheld_path(entries: list[str] | None = None) -> list[str]:
    """The folders of ``entries`` (default ``sys.path``) that ``import_path`` leaves out
    because another user could change them, each with why (what a child that fails to
    import a module is told)."""
    out: list[str] = []
    for entry in sys.path if entries is None else entries:
        if entry and os.path.isabs(entry) and os.path.isdir(entry):
            why = trusted_dir(entry)
            if why is not None:
                out.append(why)
    return out


def import_path(entries: list[str] | None = None) -> list[str]:
    """The entries of ``entries`` (default this process's ``sys.path``) a child may import
    from: absolute paths of directories that pass ``trusted_dir``, each once, in order.
    A relative entry (``''`` is the working directory) is never one."""
    out: list[str] = []
    for entry in sys.path if entries is None else entries:
        if entry and os.path.isabs(entry) and entry not in out and os.path.isdir(entry) \
                and trusted_dir(entry) is None:
            out.append(entry)
    return out


def _interpreter_path() -> set[str]:
    """Where an isolated child of this interpreter imports from by itself."""
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages())
    return {os.path.realpath(p) for p in paths if p}


def reachable(module: ModuleType) -> bool:
    """True if a child started by ``python_command`` imports ``module`` by its name from
    the same place: the folder its top-level package lies in is on ``import_path`` or
    the interpreter's own path."""
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None)
    if spec is None or not origin or not os.path.isabs(origin):
        return False
    root = Path(origin).parent
    depth = spec.name.count(".") + (1 if spec.submodule_search_locations is not None else 0)
    for _ in range(depth):
        root = root.parent
    allowed = {os.path.realpath(p) for p in import_path()} | _interpreter_path()
    return os.path.realpath(root) in allowed


def _flags() -> list[str]:
    """The interpreter flags of this process that ``-I`` would drop with the variables
    that set them and that decide nothing about imports."""
    flags = ["-I"]
    if sys.flags.dont_write_bytecode:
        flags.append("-B")
    prefix = getattr(sys, "pycache_prefix", None)
    if prefix and os.path.isdir(prefix) and trusted_dir(prefix) is None:
        flags += ["-X", f"pycache_prefix={prefix}"]  # bytecode is code: only a safe folder's
    if sys.flags.utf8_mode:
        flags += ["-X", "utf8"]
    for option in sys.warnoptions:
        if _shown_only(option):
            flags += ["-W", option]
    return flags


def _shown_only(option: str) -> bool:
    """Whether a warnings option (``-W``, ``PYTHONWARNINGS``) only decides what is shown.
    An ``error`` one makes a warning an exception: a child building or probing for the
    caller would fail where the caller meant its own code (torch's Inductor warns as it
    is imported), so a child gets none."""
    action = option.split(":", 1)[0].strip().lower()
    return not (action and "error".startswith(action))


def python_command(module: str, *args: str, flags: tuple[str, ...] = ()) -> list[str]:
    """The command that runs ``python FLAGS -m MODULE ARGS`` isolated (see the module
    doc)."""
    return [sys.executable, *_flags(), *flags, "-c", _BOOT, json.dumps(import_path()), module,
            *args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment for a child: without the ``PYTHON*`` variables that steer imports,
    with ``PYTHONSAFEPATH=1`` for the Python processes it starts, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTHON") or k in KEPT_PYTHON_VARIABLES}
    if "PYTHONWARNINGS" in env:
        kept = [o for o in env.pop("PYTHONWARNINGS").split(",") if _shown_only(o)]
        if kept:
            env["PYTHONWARNINGS"] = ",".join(kept)
    prefix = getattr(sys, "pycache_prefix", None)
    if prefix and os.path.isdir(prefix) and trusted_dir(prefix) is None:
        env["PYTHONPYCACHEPREFIX"] = prefix
    env["PYTHONSAFEPATH"] = "1"
    env.update(extra or {})
    return env
