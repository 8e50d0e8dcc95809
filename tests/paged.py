"""The paged example (``examples/generate.py``) served step by step beside eager: prefills
and decode steps, each call's logits and every layer's KV cache compared with eager's
after every call. Used on CPU (the logic) and on a GPU (CUDA graphs, its effect).

Imported by tests by name (``import paged``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

import cachebuild

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import generate  # noqa: E402

#: Calls ``serve_beside_eager`` makes by policy: each is served by a full graph, a
#: piecewise graph, or without graphs (the calls that capture included).
SERVED = {"lazy": {"full": 3, "piecewise": 2, "none": 3},
          "eager": {"full": 4, "piecewise": 4, "none": 0}}

#: What the test serves: two prefills of 16 tokens (two prompts of 8), one of 4 (a capture
#: size that is also a decode size: its piecewise graph and the decode steps' full graph
#: share the size), then decode steps of 4 sequences.
CAPTURE = (1, 2, 4, 8, 16)
DECODE = (1, 2, 4)
PROMPT = 8


def make_pair(device: str, monkeypatch: Any, dtype: str = "float32") -> tuple[Any, Any]:
    """The paged model twice, with equal weights and empty caches, on ``device``. The
    example reads its sizes from the environment, also while it serves: they are set
    through ``monkeypatch`` (pytest's), for the test's time only."""
    for name, value in {"LLAMA_DEVICE": device, "LLAMA_DTYPE": dtype, "LLAMA_LAYERS": "2",
                        "GEN_BLOCKS": "32", "GEN_MAX_BLOCKS": "4"}.items():
        monkeypatch.setenv(name, value)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(generate.make_model())
    return models[0], models[1]


def config(mode: str, policy: str, backend: str = "eager_fusion",
           flavour: str = "auto") -> cachebuild.CompileConfig:
    return cachebuild.CompileConfig(
        splitting_ops=(generate.WRITE, generate.ATTEND), compile_ranges=((1, 64),),
        backend=backend, flavour=flavour, cudagraph_mode=mode, capture=policy,
        capture_sizes=CAPTURE, decode_sizes=DECODE)


def _caches(model: Any) -> list[torch.Tensor]:
    return [layer.kv_cache for layer in model.layers]


def serve_beside_eager(compiled: Any, model: Any, eager: Any, steps: int = 4) -> int:
    """Prefills and decode steps through ``compiled`` (over ``model``) and ``eager`` alike:
    after every call its logits and every layer's cache equal eager's (float32; on a GPU
    within 1e-3, where the compiled pieces' kernels round otherwise than eager's). The
    calls made."""
    vocab = model.embed.num_embeddings
    rtol = atol = 1e-3 if model.embed.weight.is_cuda else 1e-4
    g = torch.Generator().manual_seed(0)
    # eager pads as the compiled one does: its padding rows write the null block alike
    engines = [generate.Engine(model, compiled, CAPTURE), generate.Engine(eager, None, CAPTURE)]
    calls = 0

    def both(rows_of: Any, decode: bool) -> list[int]:
        nonlocal calls
        outs = [e._step(rows_of(i), decode=decode) for i, e in enumerate(engines)]
        torch.testing.assert_close(outs[0], outs[1], rtol=rtol, atol=atol)
        for got, want in zip(_caches(model), _caches(eager), strict=True):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        calls += 1
        return outs[1].argmax(-1).tolist()

    for prompts, tokens in ((2, PROMPT), (2, PROMPT), (1, 4)):  # prefills of 16, 16 and 4
        drawn = [torch.randint(0, vocab, (tokens,), generator=g).tolist()
                 for _ in range(prompts)]
        seqs = [[generate.Sequence(list(t)) for t in drawn] for _ in engines]
        both(lambda i, s=seqs: [(q, t, p) for q in s[i] for p, t in enumerate(q.tokens)], False)
        for engine, mine in zip(engines, seqs, strict=True):
            for q in mine:
                engine.free += q.blocks
    drawn = [torch.randint(0, vocab, (3,), generator=g).tolist() for _ in range(4)]
    seqs = [[generate.Sequence(list(t)) for t in drawn] for _ in engines]
    last = both(lambda i: [(q, t, p) for q in seqs[i] for p, t in enumerate(q.tokens)],
                False)[2::3]  # each sequence's last prompt token
    for _ in range(steps):
        for mine in seqs:
            for q, token in zip(mine, last, strict=True):
                q.generated.append(token)
        last = both(lambda i: [(q, q.generated[-1], len(q.tokens) + len(q.generated) - 1)
                               for q in seqs[i]], True)
    return calls
