"""The code's shape: no import circle among the project's modules, and every module imports
only modules of its own layer or below, in the order of the pipeline:

    values (config, keys, errors) → graph facts, store, backends, passes → trace, split,
    targets → entry, plan → build → runtime, capture → front doors → command line

Every import counts: the ones inside functions (deferred only to save start-up time), and
the ones under ``TYPE_CHECKING`` (for type hints only, they still tie the modules: a
circle through them is a circle in the design).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Top-level folder → the package it installs as (pyproject's package-dir).
FOLDERS = {"cachebuild": "cachebuild", "backends": "cachebuild.backends",
           "passes": "cachebuild.passes", "store": "cachebuild.store"}

LAYERS = [
    ["cachebuild", "cachebuild.errors", "cachebuild.keys", "cachebuild.config",
     "cachebuild.units", "cachebuild.counters", "cachebuild.clock", "cachebuild.keep", "cachebuild.compat", "cachebuild.env",
     "cachebuild.dictwatch", "cachebuild.calls", "cachebuild.graphmodes", "cachebuild.allowed",
     "cachebuild.metrics", "cachebuild.process_state"],
    ["cachebuild.facts", "cachebuild.effects", "cachebuild.fxjson", "cachebuild.purity",
     "cachebuild.graphdiff",
     "cachebuild.inputs", "cachebuild.weights", "cachebuild.outputs", "cachebuild.codehash",
     "cachebuild.sources", "cachebuild.processes",
     "cachebuild.store.*", "cachebuild.backends.*", "cachebuild.passes.*"],
    ["cachebuild.trace", "cachebuild.split", "cachebuild.transforms", "cachebuild.targets",
     "cachebuild.guards", "cachebuild.guard_watch",
     "cachebuild.guard_export", "cachebuild.distributed"],
    ["cachebuild.entry", "cachebuild.planner", "cachebuild.explain"],
    ["cachebuild.build", "cachebuild.verify", "cachebuild.notice", "cachebuild.workers"],
    ["cachebuild.stitch", "cachebuild.runtime", "cachebuild.capture", "cachebuild.cudagraphs"],
    ["cachebuild.start", "cachebuild.interim"],
    ["cachebuild.api", "cachebuild.dynamo_backend", "cachebuild.modelfile",
     "cachebuild.warming", "cachebuild.explaining", "cachebuild.worker"],
    ["cachebuild.cli.*"],
]


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


def layer(name: str) -> int:
    for rank, names in enumerate(LAYERS):
        for pattern in names:
            if pattern.endswith(".*"):
                if name == pattern[:-2] or name.startswith(pattern[:-1]):
                    return rank
            elif name == pattern:
                return rank
    raise AssertionError(f"{name} is in no layer: place it in tests/test_layering.py")


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
