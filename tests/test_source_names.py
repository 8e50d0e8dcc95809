"""Files of one name are never taken for one another when a warm start asks whether the
code a trace read is the code it runs: a library's ``config.py`` and a loaded
``config.py`` outside libraries (an editable install, a server's own module), two
libraries' ``config.py``, two ``helpers.py`` in two folders outside libraries. A start
with all of them loaded is warm and traces nothing; an edit of a traced file, in a
library or outside, is still a change.

Each start runs in a fresh process. The two "libraries" lie in a user site-packages folder
(``PYTHONUSERBASE``), which cachebuild counts as installed code, as pip's ``--user``
installs are.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

LIBRARY = "SCALE = {scale}\n\n\ndef scaled(x):\n    return x * SCALE + {shift}\n"
OTHER_LIBRARY = "def scaled(x):\n    return x - 1\n"
HELPERS = "import torch\n\n\ndef act(x):\n    return torch.tanh(x) * {k}\n"
UNRELATED = "NAME = 'unrelated {what}'\n"

MODEL = '''
import torch
import torch.nn as nn

import cachebuild
import helpers
from liba import config


class Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return helpers.act(config.scaled(self.a(x)))


CONFIG = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="eager_fusion")
'''

#: A server's start: the colliding modules loaded first (``name=path`` arguments), then
#: the model, compiled and called once; prints the counters and whether it matched eager.
SERVE = '''
import importlib.util
import json
import sys

for given in sys.argv[1:]:
    name, path = given.split("=")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)

import torch

import cachebuild
import m

torch.manual_seed(0)
model = m.Named().eval()
compiled = cachebuild.compile(model, m.CONFIG, {0: 0})
x = torch.randn(4, 8)
with torch.no_grad():
    same = torch.allclose(compiled(x), model(x), rtol=1e-5, atol=1e-6)
stats = cachebuild.stats()
print(json.dumps({"traced": stats["traced"], "entries_loaded": stats["entries_loaded"],
                  "same": bool(same)}))
'''


def _user_site(base: Path) -> Path:
    """The site-packages folder ``PYTHONUSERBASE=base`` gives this Python."""
    out = subprocess.run([sys.executable, "-c", "import site; print(site.getusersitepackages())"],
                         env={**os.environ, "PYTHONUSERBASE": str(base)}, capture_output=True,
                         text=True, check=True)
    return Path(out.stdout.strip())


@pytest.fixture
def layout(tmp_path):
    """An app folder (model, helpers, server), two libraries with a ``config.py`` each,
    and another folder with a ``config.py`` and a ``helpers.py`` of its own."""
    base = tmp_path / "userbase"
    libs = _user_site(base)
    for name, text in [("liba", LIBRARY.format(scale=2.0, shift=1)), ("libb", OTHER_LIBRARY)]:
        (libs / name).mkdir(parents=True)
        (libs / name / "__init__.py").write_text("")
        (libs / name / "config.py").write_text(text)
    app = tmp_path / "app"
    app.mkdir()
    (app / "m.py").write_text(MODEL)
    (app / "helpers.py").write_text(HELPERS.format(k=3))
    (app / "serve.py").write_text(SERVE)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.py").write_text(UNRELATED.format(what="config"))
    (other / "helpers.py").write_text(UNRELATED.format(what="helpers"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "PYTHONUSERBASE": str(base), "PYTHONPATH": os.pathsep.join([str(libs), str(app)]),
        "CACHEBUILD_DIR": str(tmp_path / "store")}
    return {"app": app, "libs": libs, "other": other, "env": env}


def _serve(layout, *loaded: str) -> dict:
    proc = subprocess.run([sys.executable, "serve.py", *loaded], cwd=layout["app"],
                          env=layout["env"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["said"] = proc.stderr
    return result


def test_files_of_one_name_are_told_apart_and_an_edit_is_still_seen(layout):
    cold = _serve(layout)
    assert (cold["traced"], cold["same"]) == (1, True), cold["said"]

    other = layout["other"]
    collide = [f"config={other / 'config.py'}",  # outside libraries, as liba/config.py
               f"unrelated_helpers={other / 'helpers.py'}",  # another folder's helpers.py
               f"libb.config={layout['libs'] / 'libb' / 'config.py'}"]  # another library's
    warm = _serve(layout, *collide)
    assert (warm["traced"], warm["entries_loaded"], warm["same"]) == (0, 1, True), warm["said"]
    assert "changed" not in warm["said"], warm["said"]

    # An edit of the library's traced file is seen, with every collision loaded.
    (layout["libs"] / "liba" / "config.py").write_text(LIBRARY.format(scale=2.0, shift=5))
    edited = _serve(layout, *collide)
    assert (edited["traced"], edited["same"]) == (1, True), edited["said"]
    assert "config.py" in edited["said"] and "liba" in edited["said"], edited["said"]

    # And so is an edit of the traced file outside libraries.
    (layout["app"] / "helpers.py").write_text(HELPERS.format(k=4))
    edited = _serve(layout, *collide)
    assert (edited["traced"], edited["same"]) == (1, True), edited["said"]
    assert str(layout["app"] / "helpers.py") in edited["said"], edited["said"]
    assert str(other / "helpers.py") not in edited["said"], edited["said"]


def test_user_site_packages_count_as_installed_code():
    from cachebuild.trust import sources

    user = site.getusersitepackages()
    assert sources.is_library_file(os.path.join(user, "liba", "config.py"))
    assert sources.library_path(os.path.join(user, "liba", "config.py")) == "liba/config.py"
    assert sources.library_module("liba/config.py") == "liba.config"
    assert sources.library_module("liba/__init__.py") == "liba"
    assert sources.library_path(textwrap.dedent("/nowhere/app/config.py")) is None


PEFT_CHILD = """
import json

import peft
import torch
import transformers

import cachebuild
import hf_families as H

torch.manual_seed(0)
base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**H._decoder()))
model = H.Served(peft.get_peft_model(base, peft.LoraConfig(
    r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))).eval()
config = cachebuild.CompileConfig(splitting_ops=(H.SDPA,), compile_ranges=((1, 24),),
                                  backend="eager_fusion")
compiled = cachebuild.compile(model, config, {0: 0})
tokens = H.ids(9)
with torch.no_grad():
    same = torch.allclose(compiled(*tokens), model(*tokens), rtol=1e-4, atol=1e-5)
stats = cachebuild.stats()
print(json.dumps({"traced": stats["traced"], "entries_loaded": stats["entries_loaded"],
                  "same": bool(same)}))
"""


@pytest.mark.slow
def test_a_peft_model_starts_warm_beside_cachebuilds_own_config_py(tmp_path):
    """A LoRA model's trace reads peft's ``config.py``; cachebuild's own ``config.py`` (an
    editable install, outside installed libraries) is loaded in every process."""
    import models

    env = {"CACHEBUILD_DIR": str(tmp_path / "store")}
    cold = models.run_python(PEFT_CHILD, env=env)
    warm = models.run_python(PEFT_CHILD, env=env)
    assert (cold["traced"], cold["same"]) == (1, True), cold
    assert (warm["traced"], warm["entries_loaded"], warm["same"]) == (0, 1, True), warm
