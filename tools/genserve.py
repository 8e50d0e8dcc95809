"""A server of ``examples/generate.py`` started in one benchmark mode: what
``bench_generate.py`` measures and ``profile_decode.py`` profiles.

Modes:

- ``eager``: no compile; the eager forward captured as whole CUDA graphs per decode size;
- ``torch_cold`` / ``torch_warm``: ``torch.compile(model, fullgraph=True)`` with the token
  dim dynamic, on an empty / a warm Inductor cache; graphs captured the same way as eager's;
- ``cb_<graphs>_<flavour>[+policy]``: ``cachebuild.compile`` on a store ``cachebuild warm``
  filled, with ``<graphs>`` ``warm`` (piecewise), ``full``, ``fp`` (full_and_piecewise) or
  ``fdo`` (full_decode_only), and the capture policy named after a ``+`` (default: auto,
  which is lazy for this model: it writes its cache).

Capture sizes: the decode batch sizes (1, 2, 4, 8, 16, 32) and two prefill sizes (64: one
request's prompt; 512: eight of them); full graphs for decode steps at the decode sizes.
On a CPU (``--device cpu``) there are no CUDA graphs: eager and torch.compile run as they
are, cachebuild's graph modes run their logic without graphs (``ReplayCapture``); that is
for trying the tools, not for figures.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DECODE_SIZES = (1, 2, 4, 8, 16, 32)
PREFILL_SIZES = (64, 512)
PROMPT = 64
GRAPHS = {"warm": "piecewise", "full": "full", "fp": "full_and_piecewise",
          "fdo": "full_decode_only"}


@dataclasses.dataclass(frozen=True)
class Mode:
    """A parsed mode name."""

    name: str
    engine: str  # eager, torch, cachebuild
    graphs: str = "full"
    flavour: str = ""
    policy: str = "auto"


def parse(mode: str) -> Mode:
    """``mode`` taken apart; ValueError naming the choices for a name that is none."""
    if mode in ("eager", "torch_cold", "torch_warm"):
        return Mode(mode, "torch" if mode.startswith("torch") else "eager")
    base, _, policy = mode.partition("+")
    parts = base.split("_", 2)
    if len(parts) == 3 and parts[0] == "cb" and parts[1] in GRAPHS:
        return Mode(mode, "cachebuild", GRAPHS[parts[1]], parts[2], policy or "auto")
    if len(parts) == 3 and parts[:2] == ["cb", "build"]:
        return Mode(mode, "build", flavour=parts[2])
    raise ValueError(f"unknown mode {mode!r}: eager, torch_cold, torch_warm, cb_build_<flavour>, "
                     f"or cb_<{'|'.join(GRAPHS)}>_<flavour>[+eager|+lazy|+background]")


def model_env(layers: int, hidden: int, device: str) -> dict[str, str]:
    """The example's size knobs: the TinyLlama shape at ``layers`` and ``hidden``."""
    heads = 32 if hidden >= 1024 else 8
    return {"LLAMA_DEVICE": device, "LLAMA_LAYERS": str(layers), "LLAMA_HIDDEN": str(hidden),
            "LLAMA_HEADS": str(heads), "LLAMA_KV_HEADS": str(max(heads // 8, 1)),
            "LLAMA_MLP": str(hidden * 11 // 4),
            "LLAMA_VOCAB": "32000" if hidden >= 1024 else "1024",
            "LLAMA_MAX_TOKENS": str(max(DECODE_SIZES) * PROMPT), "GEN_BLOCKS": "320",
            "GEN_MAX_BLOCKS": "8",
            "GEN_CAPTURE": ",".join(map(str, DECODE_SIZES + PREFILL_SIZES)),
            "GEN_DECODE": ",".join(map(str, DECODE_SIZES))}


class Timer:
    """Times a block on the device: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def around(self, fn: Callable[[], Any]) -> tuple[Any, Callable[[], float]]:
        """``fn()``'s result and a function that gives its milliseconds (waiting for the
        device when called)."""
        if self.cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()

            def ms() -> float:
                end.synchronize()
                return start.elapsed_time(end)

            return out, ms
        t0 = time.perf_counter()
        out = fn()
        took = (time.perf_counter() - t0) * 1e3
        return out, lambda: took


@dataclasses.dataclass
class Server:
    """A started server: the model, the forward it serves with, the example module, and
    the seconds its start took (from the process's ``started``)."""

    mode: Mode
    model: Any
    forward: Any
    generate: Any
    timer: Timer
    t: dict[str, Any]

    def engine(self) -> Any:
        return self.generate.Engine(self.model, self.forward, DECODE_SIZES + PREFILL_SIZES)

    def runtime(self) -> Any:
        return getattr(self.forward, "runtime", None)




def setup(parser: Any, args: Any, prefix: str) -> tuple[list[str], Path, dict[str, str]]:
    """What a tool over several modes starts from: ``args.modes`` checked (a bad name is a
    usage error), the work folder (``args.work`` or a new temporary one) and the base
    environment of every mode's process."""
    import tempfile

    modes = args.modes.split(",")
    for mode in modes:
        try:
            parse(mode)
        except ValueError as e:
            parser.error(str(e))
    work = args.work or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **model_env(args.layers, args.hidden, args.device),
           "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-prime")}
    return modes, work, env

def mode_env(env: dict[str, str], work: Path, mode: str) -> tuple[dict[str, str], Path | None]:
    """``env`` for one mode's process, with its caches under ``work``: torch.compile's modes
    share one Inductor cache, every other mode has its own; a cachebuild mode gets the store
    of its flavour (returned too, else None) and the backend that flavour names."""
    parsed = parse(mode)
    menv = dict(env)
    menv["TORCHINDUCTOR_CACHE_DIR"] = str(work / ("inductor-torch" if parsed.engine == "torch"
                                                  else f"inductor-{mode}"))
    if not parsed.flavour:
        return menv, None
    backend, flavour = (("eager_fusion", "auto") if parsed.flavour == "eager_fusion"
                        else ("inductor", parsed.flavour))
    store = work / f"store-{parsed.flavour}"
    menv.update({"CACHEBUILD_DIR": str(store), "LLAMA_BACKEND": backend,
                 "LLAMA_FLAVOUR": flavour})
    return menv, store

def start(mode_name: str, started: float) -> Server:
    """Import, build the model, compile and capture as ``mode_name`` says, in this process."""
    mode = parse(mode_name)
    t: dict[str, Any] = {}
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import generate

    import cachebuild

    device = os.environ.get("LLAMA_DEVICE", "cuda")
    timer = Timer(device)
    t["import"] = time.time() - started
    torch.manual_seed(0)
    model = generate.make_model()
    timer.sync()
    t["model_built"] = time.time() - started
    t["call_start"] = time.time()
    with torch.no_grad():
        if mode.engine == "cachebuild":
            # the backend and flavour: the environment's (LLAMA_BACKEND, LLAMA_FLAVOUR)
            config = dataclasses.replace(generate.config(), cudagraph_mode=mode.graphs,
                                         capture=mode.policy)
            forward: Any = cachebuild.compile(model, config, dynamic_dims=generate.DYNAMIC)
            forward.prepare(*generate.example_inputs(model))  # load; eager policy: capture
        else:
            fn: Any = model
            if mode.engine == "torch":
                fn = torch.compile(model, fullgraph=True)
                args = generate.example_inputs(model)
                for a in args:
                    torch._dynamo.mark_dynamic(a, 0)
                fn(*args)
            forward = fn
            if timer.cuda:
                sys.path.insert(0, str(Path(__file__).resolve().parent))
                from benchlib import Graphed

                forward = Graphed(fn, lambda a: a[0].shape[0])
                engine = generate.Engine(model, forward, DECODE_SIZES)
                for size in sorted(DECODE_SIZES, reverse=True):  # captures each size
                    engine._step([(generate.Sequence([0]), 0, 0)] * size, decode=True)
                for layer in model.layers:
                    layer.kv_cache.zero_()
                forward.capturing = False
        timer.sync()
    t["ready"] = time.time() - started
    return Server(mode, model, forward, generate, timer, t)


def decode_batch(server: Server, batch: int, seed: int) -> tuple[Any, list[Any], list[int]]:
    """``batch`` prompts of PROMPT tokens prefilled together: the engine, the sequences and
    each one's next token."""
    import torch

    engine = server.engine()
    vocab = server.model.embed.num_embeddings
    g = torch.Generator().manual_seed(seed)
    seqs = [server.generate.Sequence(torch.randint(0, vocab, (PROMPT,), generator=g).tolist())
            for _ in range(batch)]
    rows = [(s, tok, i) for s in seqs for i, tok in enumerate(s.tokens)]
    last = engine._step(rows)[[PROMPT * (i + 1) - 1 for i in range(batch)]]
    return engine, seqs, last.argmax(-1).tolist()


def next_rows(seqs: list[Any], tokens: list[int]) -> list[tuple[Any, int, int]]:
    """The decode rows after ``tokens`` were sampled for ``seqs`` (appended to them)."""
    for s, tok in zip(seqs, tokens, strict=True):
        s.generated.append(tok)
    return [(s, s.generated[-1], len(s.tokens) + len(s.generated) - 1) for s in seqs]
