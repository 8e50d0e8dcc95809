"""Functorch transforms in a model's forward (``torch.vmap``, as Hugging Face's mask
functions and Mamba's generate use it): both front doors compile them to the operators
they run, and the compiled model matches eager, outputs and in-place writes alike (a
write through a batched tensor lands in the tensor under it), in fresh processes, one
after another on one store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.fx as fx

from cachebuild.tracing.transforms import desugar, regions

#: A model that maps a layer over rows, writes a cache through a batched view, bumps a
#: buffer and is split at an op of its own (the script prints how it compares with eager).
SCRIPT = textwrap.dedent('''
    import json, sys
    import torch, torch.nn as nn
    import cachebuild

    lib = torch.library.Library("vmap_tests", "DEF")
    lib.define("attn(Tensor x) -> Tensor")
    lib.impl("attn", lambda x: x.softmax(-1), "CompositeExplicitAutograd")
    torch.library.register_fake("vmap_tests::attn", lambda x: torch.empty_like(x), lib=lib)


    class Mapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x, cache):
            y = torch.vmap(lambda row: self.a(row).relu() * 2)(x)
            torch.vmap(lambda c, r: c.add_(r.mean(0)))(cache, y)  # written through a wrapper
            self.calls.add_(1)
            z = torch.ops.vmap_tests.attn(y)
            inner = torch.vmap(torch.vmap(lambda v: v * v.sum()))(z)  # nested levels
            return self.b(inner) + cache.unsqueeze(1)


    door = sys.argv[1]
    config = cachebuild.CompileConfig(splitting_ops=("vmap_tests::attn",),
                                      compile_ranges=((1, 16),), backend="eager_fusion")
    torch.manual_seed(0)
    model = Mapped().eval()
    reference = Mapped().eval()
    reference.load_state_dict(model.state_dict())
    if door == "compile":
        compiled = cachebuild.compile(model, config, {0: 0, 1: 0})
    else:
        compiled = torch.compile(model, backend=cachebuild.backend(config), fullgraph=True)
    same = True
    for batch, tokens in [(3, 5), (3, 5), (6, 5)]:
        x = torch.randn(batch, tokens, 8)
        cache = torch.randn(batch, 8)
        expected_cache = cache.clone()
        with torch.no_grad():
            out, ref = compiled(x, cache), reference(x, expected_cache)
        same &= torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
        same &= torch.allclose(cache, expected_cache, rtol=1e-5, atol=1e-6)
        same &= torch.equal(model.calls, reference.calls)
    stats = cachebuild.stats()
    print(json.dumps({"same": bool(same), "built": stats["built"]}))
''')


def _run(script, door: str, store) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "CACHEBUILD_DIR": str(store)}
    proc = subprocess.run([sys.executable, str(script), door], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("door", ["compile", "torch.compile"])
def test_vmap_compiles_exactly_through_both_front_doors(tmp_path, door):
    script = tmp_path / "mapped.py"
    script.write_text(SCRIPT)
    first = _run(script, door, tmp_path / "store")
    assert first["same"] and first["built"] > 0, first
    again = _run(script, door, tmp_path / "store")  # a later process on the same store
    assert again == {"same": True, "built": 0}, again


def _traced(fn, *args) -> fx.GraphModule:
    got = {}

    def backend(gm, example_inputs):
        got["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return got["gm"]


def test_desugar_leaves_plain_operators_that_compute_the_same(fresh_dynamo):
    def fn(x, weight, acc):
        y = torch.vmap(lambda r: (r @ weight).tanh())(x)
        torch.vmap(lambda a, r: a.mul_(r.sum()))(acc, y)
        return y + 1

    x, weight, acc = torch.randn(3, 4), torch.randn(4, 4), torch.randn(3)
    gm = _traced(fn, x, weight, acc)
    assert regions(gm.graph)
    fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(fakes) == 3
    assert desugar(gm, fakes, fakes[0].fake_mode)
    assert not any("functorch" in (getattr(n.target, "__module__", None) or "")
                   for n in gm.graph.nodes if n.op == "call_function"), gm.graph
    mine, theirs = acc.clone(), acc.clone()
    given = {"x": x, "weight": weight, "acc": mine}
    args = [given[n.target.removeprefix("L_").removesuffix("_")]
            for n in gm.graph.nodes if n.op == "placeholder"]  # Dynamo's order
    torch.testing.assert_close(gm(*args)[0], fn(x, weight, theirs))
    torch.testing.assert_close(mine, theirs)  # the write through the wrapper, on acc


MAMBA_CHILD = """
import json

import torch
import transformers

import cachebuild
import hf_families as H

torch.manual_seed(0)
model = transformers.MambaForCausalLM(transformers.MambaConfig(
    hidden_size=32, num_hidden_layers=1, vocab_size=H.VOCAB, state_size=4, expand=2,
    conv_kernel=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
prompt = H.ids(7)[0][None]
options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
with torch.no_grad():
    want = model.generate(prompt, **options)[0].tolist()
config = cachebuild.CompileConfig(compile_ranges=((1, 64),), backend="eager_fusion")
model.forward = torch.compile(model.forward, backend=cachebuild.backend(config))
with torch.no_grad():
    got = model.generate(prompt, **options)[0].tolist()
print(json.dumps({"same": want == got, "failed": cachebuild.stats()["failed"]}))
"""


@pytest.mark.slow
def test_mamba_generates_eagers_tokens_through_torch_compile(tmp_path):
    """Mamba's generate hands the backend a graph holding a functorch transform; it
    crashed the write finder (``Cannot access storage of BatchedTensorImpl``)."""
    import models

    env = {"CACHEBUILD_DIR": str(tmp_path / "store")}
    assert models.run_python(MAMBA_CHILD, env=env) == {"same": True, "failed": 0}
    assert models.run_python(MAMBA_CHILD, env=env) == {"same": True, "failed": 0}


def test_a_transform_that_makes_constants_is_refused_in_one_line(tmp_path, fresh_dynamo):
    """``jacrev`` builds its basis as constant tensors while it runs: no piece can hold
    them, so the model is refused before anything is built or run."""
    import cachebuild
    from cachebuild.errors import UsageError
    from cachebuild.store import LocalStore

    class Jacobian(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) + torch.func.jacrev(lambda v: v.tanh() * 2)(x[0]).sum(0)

    config = cachebuild.CompileConfig(compile_ranges=((1, 8),), backend="eager_fusion")
    compiled = cachebuild.compile(Jacobian().eval(), config, {0: 0},
                                  store=LocalStore(tmp_path / "store"))
    built = cachebuild.stats()["built"]
    with torch.no_grad(), pytest.raises(UsageError, match="functorch transform") as refused:
        compiled(torch.randn(3, 4))
    assert "\n" not in str(refused.value)
    assert cachebuild.stats()["built"] == built
