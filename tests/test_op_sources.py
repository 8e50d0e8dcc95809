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


def _run(folder, store, script: str = "model.py") -> dict:
    """Run ``script`` in ``folder`` as a process of its own on ``store``; the JSON it
    prints last."""
    env = {**os.environ, "CACHEBUILD_DIR": str(store)}
    proc = subprocess.run([sys.executable, script], cwd=folder, env=env,
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


def test_an_edited_file_the_kernel_calls_into_is_built_again(tmp_path):
    """The kernel registered from another file (an op library's registration module
    importing its kernels), and what it computes edited in a third file it calls."""
    (tmp_path / "edited_ops.py").write_text(textwrap.dedent("""
        import torch
        from kernels import scaled
        lib = torch.library.Library("cb_edit", "DEF")
        lib.define("scaled(Tensor x) -> Tensor")
        lib.impl("scaled", scaled, "CompositeImplicitAutograd")
    """))
    (tmp_path / "kernels.py").write_text("import factors\n\n\ndef scaled(x):\n"
                                         "    return factors.times(x) + 1.0\n")
    (tmp_path / "factors.py").write_text("def times(x):\n    return x * 2.0\n")
    (tmp_path / "model.py").write_text(MODEL)
    store = tmp_path / "store"
    first = _run(tmp_path, store)
    assert first["error"] < 1e-5 and first["built"] == 1
    (tmp_path / "factors.py").write_text("def times(x):\n    return x * 3.0\n")
    edited = _run(tmp_path, store)
    assert edited["error"] < 1e-5, edited  # before: the old kernel, inlined, answered
    assert edited["traced"] == 1 and edited["built"] == 1


KERNEL_FILES_CHILD = textwrap.dedent("""
    import cProfile, json, sys
    import torch
    import cachebuild
    from cachebuild.graph import facts
    import kernels  # the kernel of cb_files::op.two and its helper live here

    lib = torch.library.Library("cb_files", "DEF")
    lib.define("op.two(Tensor x) -> Tensor")  # an operator with no default overload
    lib.impl("op.two", kernels.twice, "CompositeImplicitAutograd")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.ops.cb_files.op.two(self.a(x))

    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    net, x = Net().eval(), torch.randn(4, 8)
    profiler = cProfile.Profile()
    profiler.enable()  # a caller's profiler, running through the trace
    compiled = cachebuild.compile(net, config, dynamic_dims={0: 0})
    with torch.no_grad():
        errors = [float((compiled(x) - net(x)).abs().max())]
    still_profiling = sys.getprofile() is profiler
    profiler.disable()
    door = torch.compile(Net().eval(), backend=cachebuild.backend(config))
    facts._KERNEL_FILES.clear()  # found again, inside Dynamo's tracing context
    with torch.no_grad():
        errors.append(float((door(x) - door._orig_mod(x)).abs().max()))
    print(json.dumps({"errors": errors, "still_profiling": still_profiling,
                      "files": facts._KERNEL_FILES}))
""")


def test_kernel_files_are_found_for_any_overload_under_a_profiler_and_through_the_door(
        tmp_path):
    """An operator with no default overload; a caller's profiler (its hook kept, the files
    found all the same); and inside the torch.compile door's tracing context."""
    (tmp_path / "kernels.py").write_text("import helpers\n\n\ndef twice(x):\n"
                                         "    return helpers.times(x, 2.0)\n")
    (tmp_path / "helpers.py").write_text("def times(x, k):\n    return x * k\n")
    (tmp_path / "child.py").write_text(KERNEL_FILES_CHILD)
    out = _run(tmp_path, tmp_path / "store", "child.py")
    assert max(out["errors"]) < 1e-5 and out["still_profiling"], out
    found = {os.path.basename(f) for f in out["files"].get("cb_files::op.two", [])}
    assert found == {"kernels.py", "helpers.py"}, out


INLINED_KERNELS_CHILD = textwrap.dedent("""
    import json
    import torch
    from torch._inductor.decomposition import register_decomposition
    import cachebuild
    from cachebuild.graph import facts
    import pykern, deckern

    lib = torch.library.Library("cb_inlined", "DEF")
    lib.define("py(Tensor x) -> Tensor")
    lib.define("dec(Tensor x) -> Tensor")
    lib.impl("py", pykern.times, "CompositeExplicitAutograd")  # what eager runs
    torch.ops.cb_inlined.py.default.py_impl(
        torch._C.DispatchKey.CompositeImplicitAutograd)(pykern.times)  # what a build inlines
    lib.impl("dec", deckern.times, "CompositeExplicitAutograd")
    register_decomposition(torch.ops.cb_inlined.dec.default)(deckern.times)  # Inductor's

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.ops.cb_inlined.dec(torch.ops.cb_inlined.py(self.a(x)))

    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    net, x = Net().eval(), torch.randn(4, 8)
    compiled = cachebuild.compile(net, config, dynamic_dims={0: 0})
    with torch.no_grad():
        error = float((compiled(x) - net(x)).abs().max())
    print(json.dumps({"error": error, "files": facts._KERNEL_FILES}))
""")


def test_the_kernels_a_build_inlines_and_what_they_import_are_sources(tmp_path):
    """A ``py_impl`` decomposition, one registered in Inductor's table, and a constant
    the kernel's module imports from another (``from consts import SCALE``): each file
    a build takes code or a value from is one whose edit makes the entry stale."""
    (tmp_path / "consts.py").write_text("SCALE = 2.0\n")
    (tmp_path / "pykern.py").write_text("from consts import SCALE\n\n\ndef times(x):\n"
                                        "    return x * SCALE\n")
    (tmp_path / "deckern.py").write_text("def times(x):\n    return x + 1.0\n")
    (tmp_path / "child.py").write_text(INLINED_KERNELS_CHILD)
    out = _run(tmp_path, tmp_path / "store", "child.py")
    assert out["error"] < 1e-5, out
    names = {op: {os.path.basename(f) for f in files} for op, files in out["files"].items()}
    assert names["cb_inlined::py"] == {"pykern.py", "consts.py"}, names
    assert names["cb_inlined::dec"] == {"deckern.py"}, names


KERNEL_STATE_OPS = textwrap.dedent("""
    import os
    import torch
    import big, small
    from helpers import TABLE
    OFFSET = float(os.environ.get("KOFFSET", "0"))  # read as the module is imported
    lib = torch.library.Library("cb_state", "DEF")
    lib.define("probe(Tensor x) -> Tensor")

    def probe(x):
        scale = float(os.environ.get("KSCALE", "2"))  # read at each call, eagerly
        branch = big.f(x) if x.shape[-1] >= 16 else small.f(x)  # by the call's width
        return branch * scale * TABLE["k"] + OFFSET

    lib.impl("probe", probe, "CompositeImplicitAutograd")
""")

KERNEL_STATE_MODEL = textwrap.dedent("""
    import json, os
    import torch
    import cachebuild
    import kops

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = self.a(x)
            return torch.ops.cb_state.probe(h) + torch.ops.cb_state.probe(h[:, :8]).sum(-1, True)

    if os.environ.get("TABLE_K"):  # the table changed in place by the caller
        kops.TABLE["k"] = float(os.environ["TABLE_K"])
    torch.manual_seed(0)
    net = Net().eval()
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    compiled = cachebuild.compile(net, config, dynamic_dims={0: 0})
    x = torch.randn(4, 16)
    errors = []
    with torch.no_grad():
        errors.append(float((compiled(x) - net(x)).abs().max()))
        os.environ["KSCALE"] = "7"  # changed after the first call
        errors.append(float((compiled(x) - net(x)).abs().max()))
    print(json.dumps({"errors": errors,
                      **{k: cachebuild.stats()[k] for k in ("traced", "built")}}))
""")


def test_what_an_inlined_kernel_reads_besides_its_code_is_followed(tmp_path):
    """A kernel the build inlines bakes in what it reads: an environment variable read
    at each call (changed between processes, and after the first call), a constant its
    module computed from the environment at import, the code of a branch another call
    takes, and a table imported two modules away, edited there or changed in place by the
    caller. A change of any is followed."""
    files = {"kops.py": KERNEL_STATE_OPS, "model.py": KERNEL_STATE_MODEL,
             "big.py": "def f(x):\n    return x * 1.5\n",
             "small.py": "def f(x):\n    return x * 2.5\n",
             "helpers.py": "from consts import TABLE\n",
             "consts.py": "TABLE = {'k': 2.0}\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    store = tmp_path / "store"

    def run(**env: str) -> dict:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            out = _run(tmp_path, store)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        assert max(out["errors"]) < 1e-4, out
        return out

    assert run()["traced"] == 2  # KSCALE=7 after the first call: another entry
    again = run()
    assert (again["traced"], again["built"]) == (0, 0), again  # both found stored
    assert run(KSCALE="3")["built"] >= 1
    assert run(KOFFSET="1")["built"] >= 1
    (tmp_path / "small.py").write_text("def f(x):\n    return x * 4.5\n")
    assert run(KOFFSET="1")["built"] >= 1
    (tmp_path / "consts.py").write_text("TABLE = {'k': 3.0}\n")
    assert run(KOFFSET="1")["built"] >= 1
    assert run(KOFFSET="1", TABLE_K="5")["built"] >= 1
