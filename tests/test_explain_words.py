"""``explain`` names the change, through the real CLI: an op that changed (silu → gelu),
a constant (an epsilon), a shape, a traced source file edited; and ``plan`` and
``explain`` use one vocabulary (stored / stale / missing)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

MODEL = '''
import os
import torch
import torch.nn as nn
import torch.nn.functional as F
import cachebuild

EPS = float(os.environ.get("EPS", "1e-05"))
WIDTH = int(os.environ.get("WIDTH", "64"))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, WIDTH)
        self.down = nn.Linear(WIDTH, 32)

    def forward(self, x):
        h = F.rms_norm(x, (32,), eps=EPS)
        return self.down(F.silu(self.up(h)))


def build():
    torch.manual_seed(0)
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 64),))
    return cachebuild.ModelSpec(Model().eval(), (torch.randn(8, 32),), {0: 0}, config)
'''


def cli(store: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "CACHEBUILD_DIR": str(store), **env}
    proc = subprocess.run([sys.executable, "-m", "cachebuild.cli", *args], env=full,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("explain")
    model = folder / "model.py"
    model.write_text(MODEL)
    cli(folder / "store", "warm", str(model))
    return folder / "store", model


def line_of(model: Path, text: str) -> int:
    return next(i for i, line in enumerate(model.read_text().splitlines(), 1) if text in line)


def words(proc: subprocess.CompletedProcess[str]) -> str:
    return " ".join(proc.stdout.split())


def test_a_changed_constant_is_named_with_its_value_and_source_line(warmed):
    store, model = warmed
    out = words(cli(store, "explain", str(model), EPS="1e-06"))
    line = line_of(model, "F.rms_norm")
    assert re.search(rf"piece 0 range 1-64 \([0-9a-f]{{16}}\) stale; nearest [0-9a-f]{{16}}: "
                     rf"constant 1e-05 → 1e-06 in rms_norm at node \d+ \({model}:{line}\)", out), out
    assert "G['EPS']" in out or "EPS" in out  # the entry names the value the trace read


def test_a_changed_shape_is_named(warmed):
    store, model = warmed
    out = words(cli(store, "explain", str(model), WIDTH="48"))
    assert "input 1: float32 [64, 32] → float32 [48, 32]" in out, out  # up.weight
    assert "parameter up.weight: float32 [64, 32] → float32 [48, 32]" in out, out
    plan = words(cli(store, "plan", str(model), WIDTH="48"))
    assert "stale" in plan and "missing" not in plan  # the same word in plan and explain


def test_an_edited_op_is_named_with_its_node_and_source_line(warmed, tmp_path):
    store, model = warmed
    edited = tmp_path / "model.py"
    edited.write_text(model.read_text().replace("F.silu(", "F.gelu("))
    # Another path: the same class in another file is a new model, explained against the
    # nearest stored target all the same.
    out = words(cli(store, "explain", str(edited)))
    line = line_of(edited, "F.gelu(")
    assert re.search(rf"silu → gelu at node \d+ \({edited}:{line}\)", out), out


def test_a_traced_source_file_edited_is_named(warmed):
    store, model = warmed
    original = model.read_text()
    try:
        model.write_text(original.replace("F.silu(", "F.gelu("))
        out = words(cli(store, "explain", str(model)))
    finally:
        model.write_text(original)
    assert re.search(r"entry [0-9a-f]{16}: none is stored for this model, config and input "
                     r"shapes; the nearest entry [0-9a-f]{16} differs: the file defining "
                     r"the model's class differs", out), out
    assert re.search(rf"silu → gelu at node \d+ \({model}:\d+\)", out), out


def test_a_model_never_warmed_is_said_so_with_the_command(warmed, tmp_path):
    _, model = warmed
    out = words(cli(tmp_path / "empty-store", "explain", str(model)))
    assert re.search(r"entry [0-9a-f]{16}: none is stored for this model, config and input "
                     rf"shapes \(not warmed: run `cachebuild warm {re.escape(str(model))}`\)",
                     out), out


def test_one_edited_file_is_said_once_for_every_module_it_defines():
    from cachebuild.building.nearest import fold_owners

    change = "source of llama.py 4e755663 → 68256244"
    lines = [f"the model: Llama: {change}", f"layers.0: DecoderLayer: {change}",
             "norm.eps: 1e-05 → 1e-06", f"layers.1: DecoderLayer: {change}",
             "layers.0.rotary: Rotary: source of rope.py 1 → 2"]
    assert fold_owners(lines) == [
        f"{change} (the model: Llama; layers.0, layers.1: DecoderLayer)",
        "norm.eps: 1e-05 → 1e-06",
        "source of rope.py 1 → 2 (layers.0.rotary: Rotary)"]


def test_a_warm_after_an_edit_expects_few_missing_targets(warmed, tmp_path):
    """Before its trace, a warm guesses how many targets will be missing and starts that
    many build workers (their imports share the CPUs with the trace): after an edit of a
    model warmed before (its own file, or a file it imports), the guess is an edit's; for
    settings never warmed, or a store that never saw the model, it is a whole model's."""
    from cachebuild.store import LocalStore
    from cachebuild.warming import plan_model, source_of

    store, model = warmed
    edited = tmp_path / "model.py"
    edited.write_text(model.read_text().replace("F.silu(", "F.gelu("))

    def guess(path: Path, store_dir: Path) -> bool:
        seen: list[bool] = []
        with LocalStore(store_dir) as opened:
            plan_model(source_of(str(path)), opened,
                       on_trace=lambda config, edited: seen.append(edited()))
        assert len(seen) == 1  # traced: nothing stored is fresh for it
        return seen[0]

    assert guess(edited, store) is True
    # Other parameter shapes as well: not an edit of the code alone.
    wide = tmp_path / "wide" / "model.py"
    wide.parent.mkdir()
    wide.write_text(model.read_text().replace('"WIDTH", "64"', '"WIDTH", "96"'))
    assert guess(wide, store) is False
    assert guess(edited, tmp_path / "empty-store") is False
    # A file the model's class imports, edited under the same entry key: its traced
    # source changed.
    layers = tmp_path / "split"
    layers.mkdir()
    (layers / "parts.py").write_text("import torch.nn.functional as F\n\n"
                                     "def act(x):\n    return F.silu(x)\n")
    split_model = layers / "model.py"
    split_model.write_text(model.read_text().replace(
        "import cachebuild\n", "import cachebuild\nfrom parts import act\n").replace(
        "F.silu(", "act("))
    cli(store, "warm", str(split_model))
    (layers / "parts.py").write_text((layers / "parts.py").read_text().replace("silu", "gelu"))
    assert guess(split_model, store) is True


def test_after_an_edit_early_workers_leave_the_trace_a_cpu(monkeypatch):
    from cachebuild.building.pool import expected_targets

    monkeypatch.setattr("cachebuild.building.pool.usable_cpus", lambda: 2)
    assert (expected_targets(1), expected_targets(1, edited=True)) == (3, 1)
    monkeypatch.setattr("cachebuild.building.pool.usable_cpus", lambda: 16)
    assert expected_targets(2, edited=True) == expected_targets(2) == 6


def test_an_entry_of_another_version_is_said_as_such_not_diffed_factor_by_factor():
    """An entry another version wrote writes its factors otherwise (a flag as a pair): its
    format is the difference, not settings the caller never changed."""
    import types

    from cachebuild.building.nearest import nearest_entry

    now = {"entry_format": 8, "model": {"class": "m.M"}, "process": {"deterministic": [False,
                                                                                       True]}}
    old = {"entry_format": 5, "model": {"class": "m.M"}, "process": {"deterministic": False}}
    record = types.SimpleNamespace(kind="entry", key="k" * 32, manifest=old, created=1.0)
    key, said = nearest_entry(now, [record])
    assert key == "k" * 32 and len(said) == 1
    assert said[0].startswith("entry_format: 5 → 8 (an entry another version of cachebuild")
    same = types.SimpleNamespace(kind="entry", key="s" * 32, manifest={**now, "process": {}},
                                 created=1.0)
    said = nearest_entry(now, [same])[1]  # the same version: each factor that differs
    assert len(said) == 1 and "deterministic" in said[0] and "entry_format" not in said[0]


def test_of_entries_that_differ_alike_the_one_recorded_last_is_the_nearest():
    """After edits, every earlier version of a model differs from the new one in its
    source alone: the version warmed last is the one a change is said against."""
    import types

    from cachebuild.building.nearest import nearest_entry

    now = {"model": {"class": "m.M", "source": "c" * 8}}
    versions = [types.SimpleNamespace(kind="entry", key=k * 32, created=t,
                                      manifest={"model": {"class": "m.M", "source": k * 8}})
                for k, t in (("a", 1.0), ("b", 3.0), ("d", 2.0))]
    key, said = nearest_entry(now, versions)
    assert key == "b" * 32 and len(said) == 1, said
