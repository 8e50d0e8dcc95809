"""Enum members a forward reads: told apart by their value, and named by the file that
defines their class under every name it is imported by.

An IntEnum or str Enum member is folded into the graph as its value, behind an identity
check: a stored forward must not serve a member of the same names with another value (a
constant edited in its file between ``cachebuild warm`` and the server's start, a class
made by a factory). And a class defined in the model file is the same class whether
``cachebuild warm model.py`` imported it or the server's ``import model`` did.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from cachebuild.tracing.guards import plain
from cachebuild.trust.codehash import code_file

MODEL = '''
import enum
import torch, torch.nn as nn
import cachebuild
from consts import Heads, Act

@torch.library.custom_op("enumtest::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.softmax(q @ k.T, -1) @ v
@attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)

class Local(enum.Enum):
    TANH = "tanh"
    RELU = "relu"

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.scale = Heads.SCALE
        self.act = Act.FAST
        self.local = Local.RELU
    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        y = torch.ops.enumtest.attention(q, k, v) * self.scale * int(self.scale)
        if self.act == "fast":
            y = y + 1
        return y.relu() if self.local is Local.RELU else y.tanh()

def config():
    return cachebuild.CompileConfig(splitting_ops=("enumtest::attention",),
                                    compile_ranges=((1, 16),), backend="eager_fusion")
def make():
    torch.manual_seed(0)
    return Net().eval()
def build():
    return cachebuild.ModelSpec(make(), (torch.randn(4, 8),), {0: 0}, config())
'''

CONSTS = '''
import enum
class Heads(enum.IntEnum):
    SCALE = 2
class Act(str, enum.Enum):
    FAST = "fast"
'''

SERVE = '''
import json, os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cachebuild, model
m = model.make()
c = cachebuild.compile(m, config=model.config(), dynamic_dims={0: 0})
x = torch.randn(4, 8)
with torch.no_grad():
    out, ref = c(x), m(x)
s = cachebuild.stats()
print(json.dumps({"traced": s["traced"], "error": (out - ref).abs().max().item()}))
'''


def _write(folder: Path, consts: str = CONSTS) -> None:
    (folder / "model.py").write_text(textwrap.dedent(MODEL))
    (folder / "consts.py").write_text(textwrap.dedent(consts))
    (folder / "serve.py").write_text(SERVE)


def _run(folder: Path, *command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CACHEBUILD_DIR": str(folder / "store")}
    proc = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _serve(folder: Path) -> dict:
    out = _run(folder, sys.executable, str(folder / "serve.py")).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_warmed_model_with_enums_is_served_and_an_edited_value_is_traced_again(tmp_path):
    """``cachebuild warm model.py``, then a server that imports ``model``: the entry is
    found (an Enum defined in the model file is the same class under both names), and
    the output is eager's. Then the IntEnum's and the str Enum's values are edited in
    their file: the next start traces again (it served the old values, silently) and
    matches eager; the old values' forward still serves the old file."""
    _write(tmp_path)
    _run(tmp_path, sys.executable, "-m", "cachebuild.cli", "warm", "model.py")
    first = _serve(tmp_path)
    assert first["traced"] == 0 and first["error"] < 1e-5, first
    for edited in (CONSTS.replace("SCALE = 2", "SCALE = 3"),
                   CONSTS.replace('FAST = "fast"', 'FAST = "slow"')):
        (tmp_path / "consts.py").write_text(textwrap.dedent(edited))
        got = _serve(tmp_path)
        assert got["traced"] == 1 and got["error"] < 1e-5, got
    (tmp_path / "consts.py").write_text(textwrap.dedent(CONSTS))
    again = _serve(tmp_path)
    assert again["traced"] == 0 and again["error"] < 1e-5, again


def test_enum_members_of_the_same_names_and_other_values_differ():
    def made(value: int) -> enum.IntEnum:
        return enum.IntEnum("Scale", {"HEADS": value}).HEADS

    assert plain(made(2)) != plain(made(3))
    assert plain(made(2)) == plain(made(2))


class Colour(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Settings:
    eps: float = 0.0


def test_a_class_without_functions_of_its_own_is_its_files():
    """An Enum's class holds enum.py's functions, a dataclass's ``__init__`` was compiled
    from a string: neither is where the class was written."""
    here = os.path.realpath(__file__)
    assert os.path.realpath(code_file(Colour)) == here
    assert os.path.realpath(code_file(Settings)) == here


class Kind(enum.Enum):
    RELU = dict  # a class: no plain value
    PLAIN = 1


def test_a_member_whose_value_has_no_plain_form_is_fingerprinted_by_its_names():
    """A member holding a class or a function (``A = nn.ReLU``) is compared by identity and
    never folded into a graph as a value: its names fingerprint it (refusing it made every
    guard on it unrecordable)."""
    assert plain(Kind.RELU) == {"enum": plain(Kind.RELU)["enum"]}
    assert plain(Kind.RELU)["enum"].endswith("Kind.RELU")
    assert plain(Kind.PLAIN)["value"] == 1
