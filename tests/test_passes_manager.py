"""The pass framework: PassConfig, FusionPass.uuid, PassManager on plain graphs and as
Inductor's post-grad custom pass."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from cachebuild.errors import ConfigError
from cachebuild.passes import FusionPass, PassConfig, PassManager, changed_passes
from cachebuild.passes.rewrites.cleanup import Cleanup
from cachebuild.passes.rewrites.matching import call_args, erase_if_dead, is_call, only_user

# Two ops and their fusion, defined for these tests only.


@torch.library.custom_op("cachebuild_manager_test::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("cachebuild_manager_test::add_one", mutates_args=())
def add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@add_one.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("cachebuild_manager_test::double_add_one", mutates_args=())
def double_add_one(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


@double_add_one.register_fake
def _(x):
    return torch.empty_like(x)


OPS = torch.ops.cachebuild_manager_test


class FuseDoubleAddOne(FusionPass):
    """add_one(double(x)) -> double_add_one(x) where double's result has no other use."""

    name: ClassVar[str] = "double_add_one"
    source_modules: ClassVar[tuple[str, ...]] = ("cachebuild.passes.rewrites.matching",)

    def __call__(self, graph: torch.fx.Graph) -> int:
        matches = 0
        for node in list(graph.nodes):
            if not is_call(node, OPS.add_one.default):
                continue
            inner = call_args(node, OPS.add_one.default)["x"]
            if not is_call(inner, OPS.double.default) or only_user(inner) is not node:
                continue
            with graph.inserting_before(node):
                fused = graph.call_function(OPS.double_add_one.default, (inner.args[0],))
            node.replace_all_uses_with(fused)
            erase_if_dead(graph, [node, inner])
            matches += 1
        return matches


def model(x: torch.Tensor) -> torch.Tensor:
    a = OPS.add_one(OPS.double(x))
    b = OPS.double(torch.sin(a))
    return OPS.add_one(b) + OPS.double(a)


def count_calls(graph: torch.fx.Graph, op) -> int:
    return sum(is_call(n, op) for n in graph.nodes)


@pytest.mark.parametrize("level", ["torch", "aten"])
def test_manager_fuses_on_plain_graph(level):
    x = torch.randn(5, 3)
    gm = torch.fx.symbolic_trace(model) if level == "torch" else make_fx(model)(x)
    manager = PassManager([FuseDoubleAddOne(), Cleanup()])
    counts = manager(gm)
    assert counts["double_add_one"] == 2
    assert count_calls(gm.graph, OPS.double_add_one.default) == 2
    assert count_calls(gm.graph, OPS.add_one.default) == 0
    torch.testing.assert_close(gm(x), model(x))
    assert manager.total_counts["double_add_one"] == 2


def test_manager_accepts_graph_and_counts_zero_when_nothing_matches():
    gm = torch.fx.symbolic_trace(lambda x: torch.cos(x) + 1)
    manager = PassManager([FuseDoubleAddOne()])
    assert manager(gm.graph) == {"double_add_one": 0}


def _write_pass_module(path, body: str, kernels_module: str) -> None:
    path.write_text(textwrap.dedent(f"""
        from typing import ClassVar
        from cachebuild.passes import FusionPass

        class EditedPass(FusionPass):
            name: ClassVar[str] = "edited"
            source_modules: ClassVar[tuple[str, ...]] = ({kernels_module!r},)

            def __call__(self, graph):
                {body}
    """))


def _load(path, module_name: str):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # inspect finds a class's file through its module
    spec.loader.exec_module(module)
    return module


def test_uuid_follows_pass_source_and_kernel_source(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    for version in range(1, 5):
        monkeypatch.delitem(sys.modules, f"edited_pass_v{version}", raising=False)
    kernels = tmp_path / "edited_pass_kernels.py"
    kernels.write_text("def kernel():\n    return 1\n")
    pass_file = tmp_path / "edited_pass.py"

    _write_pass_module(pass_file, "return 0", "edited_pass_kernels")
    first = _load(pass_file, "edited_pass_v1").EditedPass().uuid()
    same = _load(pass_file, "edited_pass_v2").EditedPass().uuid()
    assert first == same, "same source must give the same uuid"

    _write_pass_module(pass_file, "return len(graph.nodes) * 0", "edited_pass_kernels")
    edited_pass = _load(pass_file, "edited_pass_v3").EditedPass().uuid()
    assert edited_pass != first

    kernels.write_text("def kernel():\n    return 2\n")
    edited_kernel = _load(pass_file, "edited_pass_v4").EditedPass().uuid()
    assert edited_kernel not in (first, edited_pass)


def test_uuid_differs_between_pass_bodies():
    class A(FusionPass):
        name = "a"

        def __call__(self, graph):
            return 0

    class B(FusionPass):
        name = "a"

        def __call__(self, graph):
            return 1

    assert A().uuid() != B().uuid()
    assert A().uuid() == A().uuid()


def test_manager_factors_and_uuid():
    config = PassConfig()
    manager = PassManager([FuseDoubleAddOne(), Cleanup()], config=config)
    factors = manager.factors()
    assert factors["config"] == config.factors()
    assert [p["name"] for p in factors["passes"]] == ["double_add_one", "cleanup"]
    assert factors["passes"][0]["uuid"] == FuseDoubleAddOne().uuid()
    other = PassManager([FuseDoubleAddOne(), Cleanup()], config=PassConfig(cleanup=False))
    assert other.uuid() != manager.uuid()
    assert PassManager([Cleanup()], config=config).uuid() != manager.uuid()


def test_changed_passes_names_the_edited_pass():
    class Edited(FuseDoubleAddOne):
        def __call__(self, graph):
            return super().__call__(graph)

    old = PassManager([FuseDoubleAddOne(), Cleanup()]).factors()
    assert changed_passes(old, old) == []
    assert changed_passes(old, PassManager([Edited(), Cleanup()]).factors()) == ["double_add_one"]
    assert changed_passes(old, PassManager([Cleanup()]).factors()) == ["double_add_one"]


def test_pass_config():
    config = PassConfig()
    assert config.factors() == {
        "rms_quant": False, "add_rms_quant": False, "act_quant": False,
        "qk_norm_rope": False, "cleanup": True,
    }
    assert config.enabled() == ["cleanup"]
    assert PassConfig.all_fusions().enabled() == [
        "rms_quant", "add_rms_quant", "act_quant", "qk_norm_rope", "cleanup"]
    assert hash(config) == hash(PassConfig())
    with pytest.raises(ConfigError, match="PassConfig.rms_quant must be a bool"):
        PassConfig(rms_quant=1)


def test_from_config_builds_enabled_passes_cleanup_last():
    assert [p.name for p in PassManager.from_config(PassConfig()).passes] == ["cleanup"]
    assert PassManager.from_config(PassConfig(cleanup=False)).passes == []


def test_duplicate_pass_names_refused():
    with pytest.raises(ValueError, match="same name"):
        PassManager([Cleanup(), Cleanup()])


def test_cleanup_removes_noop_reshapes_and_dead_code():
    def f(x):
        y = x.view(4, 6).view(24).reshape(4, 6)  # two reshapes collapse, then a no-op
        torch.cos(x)  # dead
        return y + 1

    x = torch.randn(4, 6)
    gm = make_fx(f)(x)
    before = len(gm.graph.nodes)
    removed = PassManager([Cleanup()])(gm)["cleanup"]
    assert removed >= 3
    assert len(gm.graph.nodes) == before - removed
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.aten.add.Tensor]
    torch.testing.assert_close(gm(x), f(x))


def test_manager_as_inductor_post_grad_pass():
    manager = PassManager([FuseDoubleAddOne(), Cleanup()])
    inductor_pass = manager.as_inductor_pass()
    from torch._inductor.custom_graph_pass import CustomGraphPass

    assert isinstance(inductor_pass, CustomGraphPass)
    assert inductor_pass.uuid() == manager.uuid()
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend="inductor", fullgraph=True,
        options={"post_grad_custom_post_pass": inductor_pass},
    )
    x = torch.randn(7, 5)
    torch.testing.assert_close(compiled(x), model(x))
    assert manager.total_counts["double_add_one"] == 2


def test_loading_the_framework_imports_no_compiler():
    code = (
        "import sys\n"
        "from cachebuild.passes import PassConfig, PassManager\n"
        "PassManager.from_config(PassConfig()).uuid()\n"
        "bad = [m for m in ('torch._inductor', 'torch._dynamo', 'triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_cpu_install_without_triton_compiles_with_every_fusion():
    """Triton is an extra: with it absent, the ops, the passes and a build with every fusion
    enabled work on CPU (the fused ops run their torch references there)."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # as if it were not installed: importing it fails\n"
        "import torch, cachebuild\n"
        "from cachebuild.passes import PassConfig\n"
        "from cachebuild.store import LocalStore\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = torch.nn.Parameter(torch.ones(16))\n"
        "    def forward(self, x):\n"
        "        h = torch.ops.cachebuild.rms_norm(x, self.w, 1e-6)\n"
        "        return torch.ops.cachebuild.silu_and_mul(torch.cat([h, h], -1))\n"
        "config = cachebuild.CompileConfig(backend='eager_fusion', compile_ranges=((1, 16),),\n"
        "                                  passes=PassConfig.all_fusions())\n"
        "model = M().eval()\n"
        "compiled = cachebuild.compile(model, config, {0: 0}, store=LocalStore(sys.argv[1]))\n"
        "x = torch.randn(5, 16)\n"
        "torch.testing.assert_close(compiled(x), model(x))\n"
        "assert 'triton' not in [m.split('.')[0] for m, v in sys.modules.items() if v]\n"
        "print('ok')\n"
    )
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([sys.executable, "-c", code, str(Path(folder) / "store")],
                              capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


CAPPED = textwrap.dedent("""
    import os
    from cachebuild.passes import FusionPass

    CAP = {cap}

    def cap_value(p):
        return CAP * float(os.environ.get("CAP_SCALE", "1"))

    class CapRelu(FusionPass):
        name = "cap_relu"

        def __init__(self, cap=None):
            if cap is not None:
                self.cap = cap

        def __call__(self, graph):
            return 0 if cap_value(self) else 0
""")


def _module_from(tmp_path: Path, name: str, text: str):
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # kept: a pass's source is read through its module
    spec.loader.exec_module(module)
    return module


def test_what_a_pass_reads_of_its_module_and_its_options_are_in_its_key(tmp_path,
                                                                      monkeypatch):
    """A pass's helper functions and the constants they read from its module (a cap set
    at the top of a model file), and the options an instance was made with, change what
    it emits: each is in the key, where the class source alone would not show it."""
    v1 = _module_from(tmp_path, "capped_v1", CAPPED.format(cap="100"))
    same = _module_from(tmp_path, "capped_same", CAPPED.format(cap="100"))
    v2 = _module_from(tmp_path, "capped_v2", CAPPED.format(cap="float('inf')"))
    assert v1.CapRelu().uuid() == same.CapRelu().uuid()
    assert v1.CapRelu().uuid() != v2.CapRelu().uuid()
    edited = _module_from(tmp_path, "capped_edited", CAPPED.format(cap="100").replace(
        "return CAP", "return 2 * CAP"))
    assert edited.CapRelu().uuid() != v1.CapRelu().uuid()
    small, large = (PassManager([v1.CapRelu(cap=c)]).factors() for c in (100, 1e30))
    assert small != large and changed_passes(small, large) == ["cap_relu"]
    one, two = (PassManager([v1.CapRelu(cap={"c": c})]).factors() for c in (1, 2))
    assert one != two  # a table of options, too
    before = v1.CapRelu().uuid()
    v1.CAP = 7  # reassigned in this process: another uuid from now on
    assert v1.CapRelu().uuid() != before
    v1.CAP = 100
    monkeypatch.setenv("CAP_SCALE", "3")  # a variable its helper reads
    assert v1.CapRelu().uuid() != before
    assert PassManager([v1.CapRelu()]).factors() == PassManager([same.CapRelu()]).factors()
