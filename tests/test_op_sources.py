"""An operator's own code is part of what a piece is built from: a kernel the build
inlines (a ``CompositeImplicitAutograd`` decomposition registered with
``torch.library.Library``) that is edited in its file between processes is a stale entry and
another target, never the old artifact. Each run is a process of its own, as a server's
restart is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

OPS = textwrap.dedent("""
    import torch
    lib = torch.library.Library("cb_edit", "DEF")
    lib.define("scaled(Tensor x) -> Tensor")

    def scaled(x):
        return x * 2.0

    lib.impl("scaled", scaled, "CompositeImplicitAutograd")
""")

MODEL = textwrap.dedent("""
    import json
    import torch
    import cachebuild
    import edited_ops  # registers cb_edit::scaled; its kernel lives in edited_ops.py

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.ops.cb_edit.scaled(self.a(x))

    torch.manual_seed(0)
    net = Net().eval()
    config = cachebuild.CompileConfig(compile_ranges=((1, 16),))
    compiled = cachebuild.compile(net, config, dynamic_dims={0: 0})
    x = torch.randn(4, 16)
    with torch.no_grad():
        error = float((compiled(x) - net(x)).abs().max())
    print(json.dumps({"error": error, **{k: cachebuild.stats()[k] for k in ("traced", "built")}}))
""")


def _run(folder, store) -> dict:
    env = {**os.environ, "CACHEBUILD_DIR": str(store)}
    proc = subprocess.run([sys.executable, "model.py"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_edited_kernel_of_an_op_is_built_again(tmp_path):
    (tmp_path / "edited_ops.py").write_text(OPS)
    (tmp_path / "model.py").write_text(MODEL)
    store = tmp_path / "store"
    first = _run(tmp_path, store)
    assert first["error"] < 1e-5 and first["built"] == 1
    (tmp_path / "edited_ops.py").write_text(OPS.replace("x * 2.0", "x * 3.0"))
    edited = _run(tmp_path, store)
    assert edited["error"] < 1e-5, edited  # before: the old kernel, inlined, answered
    assert edited["traced"] == 1 and edited["built"] == 1
    again = _run(tmp_path, store)
    assert again == {"error": again["error"], "traced": 0, "built": 0} and again["error"] < 1e-5
