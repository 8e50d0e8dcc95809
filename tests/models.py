"""Tiny models and helpers shared by the build, warm and front-door tests.

The decoder is TinyLlama-shaped and small: token embedding, layers of (RMSNorm, fused
QKV projection, rotary embedding, attention, output projection, RMSNorm, SwiGLU MLP),
final norm and LM head. Attention is the custom op ``cachebuild_tests::attention``,
defined through ``torch.library.Library`` (not ``@custom_op``, whose wrapper imports
Dynamo on first call) so a process that only loads artifacts and runs eagerly imports
neither Dynamo nor Inductor.

This module is imported by tests and, by name (``import models``), by the child
processes they start; it must stay cheap to import.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import cachebuild

TESTS_DIR = Path(__file__).resolve().parent
ATTENTION = "cachebuild_tests::attention"

HIDDEN, HEADS, KV_HEADS, MLP, VOCAB = 32, 4, 2, 64, 64

_LIB = torch.library.Library("cachebuild_tests", "DEF")
_LIB.define("attention(Tensor q, Tensor k, Tensor v) -> Tensor")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over one sequence: q [T, H, D], k/v [T, KV, D] -> [T, H, D]."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1).contiguous()


_LIB.impl("attention", _attention, "CompositeExplicitAutograd")


@torch.library.register_fake(ATTENTION, lib=_LIB)
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


TRANSPOSED = "cachebuild_tests::transposed_mix"
_LIB.define("transposed_mix(Tensor x) -> Tensor")


def _transposed_mix(x: torch.Tensor) -> torch.Tensor:
    """``2 * x``, laid out column-major: not the layout its fake output claims."""
    return (2 * x).t().contiguous().t()


_LIB.impl("transposed_mix", _transposed_mix, "CompositeExplicitAutograd")


@torch.library.register_fake(TRANSPOSED, lib=_LIB)
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, mlp: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.input_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.post_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.gate_up = nn.Linear(hidden, 2 * mlp, bias=False)
        self.down = nn.Linear(mlp, hidden, bias=False)
        self.register_buffer("inv_freq", _inv_freq(self.head_dim), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv(self.input_norm(x)).split(
            [self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = rotate(q.view(t, self.heads, d), positions, self.inv_freq)
        k = rotate(k.view(t, self.kv_heads, d), positions, self.inv_freq)
        a = torch.ops.cachebuild_tests.attention(q, k, v.view(t, self.kv_heads, d))
        x = x + self.o_proj(a.reshape(t, -1))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Decoder(nn.Module):
    """forward(input_ids [T], positions [T]) -> logits [T, vocab]."""

    def __init__(self, layers: int = 2, hidden: int = HIDDEN, heads: int = HEADS,
                 kv_heads: int = KV_HEADS, mlp: int = MLP, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, kv_heads, mlp) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.lm_head(self.norm(x))


class TransposedWeights(nn.Module):
    """Falcon's linear layers: ``x @ self.weight.T`` (Dynamo records ``w.T`` as
    ``getattr(w, 'T')``), and a head tied to the embedding the same way.
    forward(input_ids [T], positions [T]) -> logits [T, vocab]."""

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS, vocab: int = VOCAB) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.dense = nn.Parameter(torch.empty(hidden, hidden))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        t, d = x.shape[0], x.shape[1] // self.heads
        q, k, v = (x @ self.qkv.T).chunk(3, dim=-1)
        a = torch.ops.cachebuild_tests.attention(q.view(t, self.heads, d),
                                                 k.view(t, self.heads, d),
                                                 v.view(t, self.heads, d))
        x = x + a.reshape(t, -1) @ self.dense.T
        return x @ self.embed.weight.T


class RenamedLayer(nn.Module):
    """``Layer`` with every attribute named differently; the same computation."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, mlp: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = heads, kv_heads, hidden // heads
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.wqkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, hidden, bias=False)
        self.ffn_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.w13 = nn.Linear(hidden, 2 * mlp, bias=False)
        self.w2 = nn.Linear(mlp, hidden, bias=False)
        self.register_buffer("rope_freq", _inv_freq(self.hd), persistent=False)

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        t, d = h.shape[0], self.hd
        q, k, v = self.wqkv(self.attn_norm(h)).split(
            [self.n_heads * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q = rotate(q.view(t, self.n_heads, d), pos, self.rope_freq)
        k = rotate(k.view(t, self.n_kv, d), pos, self.rope_freq)
        a = torch.ops.cachebuild_tests.attention(q, k, v.view(t, self.n_kv, d))
        h = h + self.wo(a.reshape(t, -1))
        gate, up = self.w13(self.ffn_norm(h)).chunk(2, dim=-1)
        return h + self.w2(F.silu(gate) * up)


class RenamedDecoder(nn.Module):
    """``Decoder`` with every attribute named differently; the same computation."""

    def __init__(self, layers: int = 2, hidden: int = HIDDEN, heads: int = HEADS,
                 kv_heads: int = KV_HEADS, mlp: int = MLP, vocab: int = VOCAB) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(RenamedLayer(hidden, heads, kv_heads, mlp)
                                    for _ in range(layers))
        self.final_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.output = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.blocks:
            h = block(h, pos)
        return self.output(self.final_norm(h))


class LayerStack(nn.Module):
    """forward(hidden_states [T, hidden], positions [T]) -> [T, hidden]: a static dim."""

    def __init__(self, layers: int = 2, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(hidden, HEADS, KV_HEADS, MLP) for _ in range(layers))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, positions)
        return x


class TransposedMix(nn.Module):
    """forward(x [T, hidden]) -> [T, hidden], split at ``transposed_mix``."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.cachebuild_tests.transposed_mix(self.up(x))
        return self.down(y) + y.cumsum(-1)


def make(cls: type[nn.Module] = Decoder, seed: int = 0, **kwargs: Any) -> nn.Module:
    """A model of ``cls`` with weights drawn from ``seed``, in eval mode."""
    torch.manual_seed(seed)
    model = cls(**kwargs).eval()
    # Non-zero, non-default weights everywhere (norm weights start at one).
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model


def inputs(tokens: int, seed: int = 1, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, positions)`` for ``tokens`` tokens."""
    g = torch.Generator().manual_seed(seed + tokens)
    return torch.randint(0, vocab, (tokens,), generator=g), torch.arange(tokens)


def hidden_inputs(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden_states, positions)`` for ``LayerStack``."""
    g = torch.Generator().manual_seed(seed + tokens)
    return torch.randn(tokens, HIDDEN, generator=g), torch.arange(tokens)


def config(**overrides: Any) -> cachebuild.CompileConfig:
    """The tests' usual config: eager_fusion, split at the test attention op."""
    values: dict[str, Any] = {"splitting_ops": (ATTENTION,), "compile_ranges": ((1, 32),),
                              "backend": "eager_fusion"}
    values.update(overrides)
    return cachebuild.CompileConfig(**values)


#: Float32 tolerance between a compiled piece and eager (fusion and codegen reorder math).
TOL = {"rtol": 1e-4, "atol": 1e-4}


def assert_matches_eager(compiled: Any, model: nn.Module, args: tuple[Any, ...]) -> None:
    with torch.no_grad():
        out = compiled(*args)
        ref = model(*args)
    for o, r in zip(*map(torch.utils._pytree.tree_leaves, (out, ref)), strict=True):
        assert not isinstance(r, torch.Tensor) or (o.shape == r.shape and o.dtype == r.dtype)
    torch.testing.assert_close(out, ref, **TOL)
    assert_same_layout(out, ref)


def assert_same_layout(out: Any, ref: Any) -> None:
    """Every tensor of ``out`` has the strides of ``ref``'s (where a stride means anything:
    dims of size one have none that does), as torch.compile keeps eager's."""
    outs, refs = torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(ref)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs, strict=True):
        if isinstance(r, torch.Tensor):
            kept = [(n, a, b) for n, a, b in zip(r.shape, o.stride(), r.stride(), strict=True)
                    if n != 1]
            assert all(a == b for _, a, b in kept), (o.shape, o.stride(), r.stride())


def counters_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """The integer counters of ``cachebuild.stats()`` that changed between two snapshots."""
    return {k: after[k] - before[k] for k in after if isinstance(after[k], int)}


# -- a pass written for the tests ------------------------------------------------------

SILU_PASS = '''
"""A test pass: silu(x) -> x * sigmoid(x)."""
from typing import ClassVar

import torch

from cachebuild.passes import FusionPass


class SiluToSigmoid(FusionPass):
    name: ClassVar[str] = "silu_to_sigmoid"

    def __call__(self, graph):
        matches = 0
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target == torch.ops.aten.silu.default:
                with graph.inserting_before(node):
                    sig = graph.call_function(torch.ops.aten.sigmoid.default, (node.args[0],))
                    mul = graph.call_function(torch.ops.aten.mul.Tensor, (node.args[0], sig))
                node.replace_all_uses_with(mul)
                graph.erase_node(node)
                matches += 1
        return matches{suffix}
'''


def load_silu_pass(path: Path, module_name: str, suffix: str = "") -> Any:
    """Write the test pass (its last line ending in ``suffix``) to ``path``, import it as
    ``module_name`` and return an instance whose uuid is already computed."""
    import importlib.util

    path.write_text(SILU_PASS.format(suffix=suffix))
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # inspect finds a class's source through its module
    spec.loader.exec_module(module)
    instance = module.SiluToSigmoid()
    # The uuid hashes the source file as it is when first asked: ask before any edit.
    instance.uuid()
    return instance


# -- child processes -------------------------------------------------------------------

def run_python(code: str, *, env: dict[str, str] | None = None, extra_path: list[str] = (),
               timeout: float = 600) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; return the JSON it prints on its last line.

    The child imports ``models`` from this directory and shares the test session's
    Inductor cache and probe directories (they are in ``os.environ``).
    """
    child_env = dict(os.environ)
    child_env.update(env or {})
    path = [*map(str, extra_path), str(TESTS_DIR)]
    child_env["PYTHONPATH"] = os.pathsep.join(path + [child_env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_pythons(code: str, envs: list[dict[str, str]], timeout: float = 900
                ) -> list[dict[str, Any]]:
    """``run_python(code, env=e)`` for each of ``envs``, all at once (independent cold
    builds take turns on the cores); their JSON results in order. Output goes to files, so
    that no child waits on a full pipe while another is read."""
    with tempfile.TemporaryDirectory(prefix="cachebuild-children-") as folder:
        procs = []
        for i, env in enumerate(envs):
            child_env = {**os.environ, **env}
            child_env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR),
                                                       child_env.get("PYTHONPATH", "")])
            out, err = (open(Path(folder) / f"{i}.{k}", "w+") for k in ("out", "err"))
            procs.append((subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                                           env=child_env, stdout=out, stderr=err, text=True),
                          out, err))
        results = []
        for proc, out, err in procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            out.close()
            err.close()
            assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{stderr[-4000:]}"
            results.append(json.loads(stdout.strip().splitlines()[-1]))
        return results


def run_side_by_side(commands: list[tuple[list[str], dict[str, str], Path | str | None]],
                     timeout: float = 900) -> list[subprocess.CompletedProcess[str]]:
    """Run ``commands`` (argv, environment replacing this one's, working directory) all
    at once, output to files (no child waits on a full pipe); each one's exit code,
    stdout and stderr, in order."""
    with tempfile.TemporaryDirectory(prefix="cachebuild-children-") as folder:
        procs = []
        for i, (argv, env, cwd) in enumerate(commands):
            out, err = (open(Path(folder) / f"{i}.{k}", "w+") for k in ("out", "err"))
            procs.append((subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=err,
                                           text=True), out, err))
        done = []
        for proc, out, err in procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(),
                                                    err.read()))
            out.close()
            err.close()
        return done


def start_python(code: str, *, env: dict[str, str] | None = None,
                 stdin: int | None = None) -> subprocess.Popen:
    """Start ``code`` in a fresh interpreter (see ``run_python``); collect with ``finish``.
    ``stdin=subprocess.PIPE``: the test talks to it."""
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), child_env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=child_env,
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


# -- one AOTInductor-warmed store per test session -------------------------------------

#: The AOTI configuration the slow tests share: one range, 2 layers, 3 unique targets.
AOTI_RANGE = (1, 32)
AOTI_SIZES = (1, 5, 32)
_AOTI: dict[str, Any] = {}


def aoti_config() -> cachebuild.CompileConfig:
    return config(backend="inductor", flavour="aoti", compile_ranges=(AOTI_RANGE,))


def aoti_store() -> dict[str, Any]:
    """A store warmed once per session with the AOTI build of a 2-layer ``Decoder``.

    Returns ``{"path", "stats", "target_keys", "kinds"}``: the store directory, the
    counters of the warming compile (whose outputs matched eager at ``AOTI_SIZES``), its
    entry's target keys and the artifact kinds stored for them.
    """
    if not _AOTI:
        from cachebuild.store import LocalStore

        folder = tempfile.mkdtemp(prefix="cachebuild-aoti-store-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        path = Path(folder) / "store"
        model = make(Decoder, layers=2)
        before = cachebuild.stats()
        compiled = cachebuild.compile(model, aoti_config(), {0: 0, 1: 0}, store=LocalStore(path))
        for size in AOTI_SIZES:
            assert_matches_eager(compiled, model, inputs(size))
        _AOTI.update(path=path, stats=counters_delta(before, cachebuild.stats()),
                     target_keys=compiled.runtime.entry.target_keys(),
                     kinds=sorted({LocalStore(path).get_record(k).kind
                                   for k in compiled.runtime.entry.target_keys()}))
    return _AOTI
