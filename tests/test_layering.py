"""The code's shape: no import circle among the project's modules, and every module imports
only modules of its own layer or below. The layers are folders, in the order of the
pipeline:

    values (the flat modules at the top of ``cachebuild``: config, keys, errors, compat...)
    → store, passes → trust → graph → tracing → backends → building → serving
    → front doors (api, dynamo_backend, modelfile, warming, watching, explain, worker) → cli

Each folder's package docstring says what it holds and what it may import. Every import
counts: the ones inside functions (deferred only to save start-up time), and the ones under
``TYPE_CHECKING`` (for type hints only, they still tie the modules: a circle through them
is a circle in the design).
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Top-level folder → the package it installs as (pyproject's package-dir).
FOLDERS = {"cachebuild": "cachebuild", "backends": "cachebuild.backends",
           "passes": "cachebuild.passes", "store": "cachebuild.store"}

#: The flat modules at the top of ``cachebuild`` that are front doors; every other flat
#: module there is a value every layer may use.
FRONT_DOORS = ["cachebuild.api", "cachebuild.dynamo_backend", "cachebuild.modelfile",
               "cachebuild.warming", "cachebuild.watching", "cachebuild.explain",
               "cachebuild.worker"]
#: Packages, lowest first, between the values and the front doors.
PACKAGES = [["cachebuild.store", "cachebuild.passes"], ["cachebuild.trust"], ["cachebuild.graph"],
            ["cachebuild.tracing"], ["cachebuild.backends"], ["cachebuild.building"],
            ["cachebuild.serving"]]
#: At most this many flat modules at the top of ``cachebuild``: the rest live in folders.
MAX_FLAT = 20


def flat_modules() -> list[str]:
    return sorted(f"cachebuild.{p.stem}" for p in (ROOT / "cachebuild").glob("*.py")
                  if p.stem not in ("__init__", "__main__"))


def layer(name: str) -> int:
    """The rank of ``name``'s layer: the values 0, each package of ``PACKAGES`` next, then
    the front doors and the command line."""
    if name in FRONT_DOORS:
        return len(PACKAGES) + 1
    if name == "cachebuild.cli" or name.startswith("cachebuild.cli."):
        return len(PACKAGES) + 2
    for rank, packages in enumerate(PACKAGES, start=1):
        if any(name == p or name.startswith(p + ".") for p in packages):
            return rank
    if name == "cachebuild" or name in flat_modules():
        return 0
    raise AssertionError(f"{name} is in no layer: put it in a folder of tests/test_layering.py")


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "__main__.py":
                continue
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts
                     if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (a ``from pkg import mod`` names ``mod``)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [s for s in subs if s in known] or [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_circle():
    deps = graph()
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        seen[name] = 1
        for dep in sorted(deps[name]):
            if seen.get(dep) == 1:
                raise AssertionError("import circle: " + " → ".join(path[path.index(dep):]
                                                                       + [name, dep]))
            if dep not in seen:
                visit(dep, [*path, name])
        seen[name] = 2

    for name in sorted(deps):
        if name not in seen:
            visit(name, [])


def test_every_module_imports_only_its_layer_or_below():
    wrong = [f"{name} (layer {layer(name)}) imports {dep} (layer {layer(dep)})"
             for name, deps in sorted(graph().items()) for dep in sorted(deps)
             if layer(dep) > layer(name)]
    assert wrong == []


def test_the_command_modules_never_import_main():
    deps = graph()
    assert [n for n in deps if n.startswith("cachebuild.cli.") and n != "cachebuild.cli.main"
            and "cachebuild.cli.main" in deps[n]] == []


def test_imports_for_type_hints_count(tmp_path):
    """An import under ``TYPE_CHECKING`` ties two modules as much as any other: a circle
    through one is found."""
    known = modules()
    source = tmp_path / "hinted.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from cachebuild.store.local import LocalStore\n")
    assert imports("cachebuild.hinted", source, known) == {"cachebuild.store.local"}


def package_folder(package: str) -> Path:
    """Where ``package``'s files are: a top-level folder (``store``) or one in ``cachebuild``."""
    top = {pkg: folder for folder, pkg in FOLDERS.items()}
    return ROOT / top[package] if package in top else ROOT / "cachebuild" / package.split(".")[1]


def test_every_folder_is_a_layer_and_says_what_it_may_import():
    packages = [p for rank in PACKAGES for p in rank]
    folders = {f"cachebuild.{d.name}" for d in (ROOT / "cachebuild").iterdir()
               if (d / "__init__.py").exists()} - {"cachebuild.cli"}
    assert folders <= set(packages), f"place {sorted(folders - set(packages))} in PACKAGES"
    for package in packages:
        init = package_folder(package) / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc, f"{init} has no docstring saying what the folder holds"
        if package_folder(package).parent.name == "cachebuild":
            assert "May import:" in doc, f"{init} does not say what the folder may import"


def test_few_flat_modules_and_no_name_twice():
    assert len(flat_modules()) + 1 <= MAX_FLAT, flat_modules()  # + __init__
    names = Counter(path.stem for path in modules().values()
                    if path.stem not in ("__init__", "__main__"))
    assert [n for n, count in names.items() if count > 1] == []


def test_the_store_is_entered_through_its_package_or_interface():
    """Outside ``store/``, the store is its package (``cachebuild.store``) and its
    protocols (``cachebuild.store.interface``): nothing reaches past them."""
    front = {"cachebuild.store", "cachebuild.store.interface"}
    wrong = [f"{name} imports {dep}" for name, deps in sorted(graph().items())
             if not name.startswith("cachebuild.store")
             for dep in sorted(deps) if dep.startswith("cachebuild.store.") and dep not in front]
    assert wrong == []


def test_the_architecture_page_names_files_and_folders_that_exist():
    """``docs/architecture.md`` stays true where a test can tell: every file it names is
    there (a bare name is unique, see above), and it shows every layer's folder."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    files = {p.relative_to(ROOT).as_posix() for folder in FOLDERS
             for p in (ROOT / folder).rglob("*.py")} | {"tests/test_layering.py"}
    missing = []
    for name in sorted(set(re.findall(r"`([\w/]+\.py)`", text)) - {"__init__.py"}):
        found = [f for f in files if f == name or f.endswith("/" + name)]
        if not found:
            missing.append(name)
    assert missing == []
    for package in (p for rank in PACKAGES for p in rank):
        folder = package_folder(package).name
        assert f"`{folder}/`" in text, f"docs/architecture.md does not show {folder}/"
