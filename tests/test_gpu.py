"""The piecewise build graph on a CUDA GPU, with the machine's environment as it is.

``auto`` must pick AOTInductor (the probe finds a C++ compiler whose libraries load and
can be captured). A cold build, then warm processes: nothing built or traced, neither
Dynamo nor Inductor imported, outputs equal to eager at bf16 tolerance, and capture in
every graph mode at every default size with replays equal to eager.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
import llama
import cachebuild
from cachebuild.store import LocalStore
torch.manual_seed(0)
model = llama.make_model()
base = llama.config()
cfg = cachebuild.CompileConfig(splitting_ops=base.splitting_ops, compile_ranges=base.compile_ranges,
                               cudagraph_mode=sys.argv[3], capture=sys.argv[4])
compiled = cachebuild.compile(model, cfg, {0: 0, 1: 0}, store=LocalStore(sys.argv[2]))
ids, pos = llama.example_inputs(model, 8)
with torch.no_grad():
    start = time.perf_counter()
    first = compiled(ids, pos)  # load (or build); graphs as the policy says
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    torch.testing.assert_close(first, model(ids, pos), rtol=3e-2, atol=5e-2)
    rt = compiled.runtime
    if sys.argv[4] == "lazy":
        for n in cfg.capture_sizes:
            compiled(*llama.example_inputs(model, n))
    ready = compiled.wait_captured(timeout=600)
    sizes = list(rt.captured_sizes) or [1, 2, 7, 64]
    worst = 0.0
    for tokens in sizes + [3, 100, 300]:  # captured sizes, then three that are not
        ids, pos = llama.example_inputs(model, tokens)
        out = compiled(ids, pos).clone()
        ref = model(ids, pos)
        torch.testing.assert_close(out, ref, rtol=3e-2, atol=5e-2)
        worst = max(worst, (out.float() - ref.float()).abs().max().item())
# looked at before anything below imports Dynamo to read its counters
compilers = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
compiles = {}
if compilers:
    from torch._dynamo.utils import counters
    compiles = {"dynamo_unique_graphs": counters["stats"]["unique_graphs"],
                "inductor_cache_misses": counters["inductor"]["fxgraph_cache_miss"]}
store = LocalStore(sys.argv[2])
kinds = sorted({store.get_record(k).kind for k in rt.entry.target_keys()})
state = compiled.capture_state()
capturer = rt.capturer
pieces = [r for size in capturer.pieces_at.values() for r in size] if capturer else []
print(json.dumps({
    "stats": cachebuild.stats(), "kinds": kinds, "worst": worst, "sizes": list(rt.captured_sizes),
    "compilers": compilers[:5], "compiles": compiles, "ready": ready, "first_s": first_s,
    "copies": max((len(r.copies) for r in (pieces or list(capturer.ready.values()))), default=0)
              if capturer else 0,
    "replays": [r.replays for r in capturer.ready.values()] if capturer else [],
    "misses": sum(r.misses for r in rt.replayers()),
    "state": state and {k: v for k, v in state.__dict__.items() if k != "per_size"}}))
"""


def run(store: Path, mode: str, policy: str = "auto", layers: int = 2) -> dict:
    env = {**os.environ, "LLAMA_DEVICE": "cuda", "LLAMA_LAYERS": str(layers)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "examples"), str(store), mode,
                           policy],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """One cold build (no graphs) into a store every test of this module then loads."""
    store = tmp_path_factory.mktemp("gpu") / "store"
    cold = run(store, "none")
    return store, cold


def test_auto_picks_aoti_and_a_warm_process_imports_no_compiler(warmed):
    from cachebuild.backends.probe import cached_verdicts

    store, cold = warmed
    for verdict in cached_verdicts():
        print(verdict.describe())
    assert cold["kinds"] == ["aoti-cuda"], cold["kinds"]
    assert cold["stats"]["built"] == cold["stats"]["unique"] > 0
    assert cold["stats"]["fallbacks"] == 0
    warm = run(store, "none")
    assert warm["stats"]["built"] == 0 and warm["stats"]["traced"] == 0
    assert warm["stats"]["loaded"] == warm["stats"]["unique"]
    assert warm["compilers"] == [], warm["compilers"]
    print(f"cold {cold['stats']['seconds']}, warm {warm['stats']['seconds']}, "
          f"worst |out-eager| {warm['worst']:.3g}")


#: graph pool bytes by (graph mode, policy), as the capture tests measured them
POOLS: dict[tuple[str, str], int] = {}


@pytest.mark.parametrize("policy", ["background", "lazy", "eager"])
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_capture_after_warm_load_in_every_graph_mode(warmed, mode, policy):
    store, _ = warmed
    warm = run(store, mode, policy)
    assert warm["stats"]["built"] == 0 and warm["stats"]["traced"] == 0
    assert warm["kinds"] == ["aoti-cuda"]
    assert warm["ready"] and len(warm["sizes"]) == 51, warm["state"]
    assert warm["state"]["failed"] == {} and warm["state"]["policy"] == policy
    # capture after a warm load imports no compiler, let alone compiles with one; the
    # example's attention is a torch.library.custom_op, whose wrapper would import Dynamo
    assert warm["compilers"] == [], warm["compilers"]
    # every captured size replayed once; the three others ran without graphs
    assert all(r >= 1 for r in warm["replays"]), warm["replays"]
    assert warm["misses"] == 0
    if mode == "piecewise":
        # a piece copies only what an eager splitting op produced (the attention output);
        # ids and positions have fixed addresses that every piece reads in place
        assert warm["copies"] == 1, warm["copies"]
    else:
        assert warm["copies"] == 2, warm["copies"]  # full: the two call arguments
    state = warm["state"]
    POOLS[(mode, policy)] = state["pool_bytes"]
    print(f"{mode}/{policy}: first output {warm['first_s']:.3f} s; {len(warm['sizes'])} sizes, "
          f"{state['graphs']} graphs in {state['seconds']:.2f} s of passes "
          f"({ {k: round(v, 2) for k, v in state['split'].items()} }), graph pool "
          f"{state['pool_bytes'] / 2**20:.0f} MiB, static buffers "
          f"{state['buffer_bytes'] / 2**20:.1f} MiB, worst |out-eager| {warm['worst']:.3g}")


def test_piecewise_pool_is_at_most_twice_the_full_pool(warmed):
    """Piecewise graphs of every size share one pool in which a piece's output that only
    the next pieces read is not kept: at most twice what full graphs of the sizes take."""
    store, _ = warmed
    pools = {mode: POOLS.get((mode, "eager")) or run(store, mode, "eager")["state"]["pool_bytes"]
             for mode in ("piecewise", "full")}
    print(f"graph pools: {pools}")
    assert pools["piecewise"] <= 2 * pools["full"], pools


def test_an_edit_of_one_kernels_constant_reuses_the_cuda_wrappers_object(tmp_path):
    """A one-line edit that changes a constant in one kernel (the final norm's epsilon)
    rebuilds one target, and its AOTInductor wrapper is not compiled again: the package
    links its kernels' binaries, so the wrapper's source is unchanged (``compilers``)."""
    model = tmp_path / "llama.py"
    text = (ROOT / "examples" / "llama.py").read_text()
    edit = ("self.norm = nn.RMSNorm(hidden, eps=1e-5)", "self.norm = nn.RMSNorm(hidden, eps=1e-6)")
    assert edit[0] in text
    model.write_text(text)
    env = {**os.environ, "LLAMA_DEVICE": "cuda", "LLAMA_LAYERS": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def warm() -> str:
        proc = subprocess.run([sys.executable, "-m", "cachebuild.cli", "-v", "--cache-dir",
                               str(tmp_path / "store"), "warm", str(model)],
                              capture_output=True, text=True, env=env, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    warm()
    model.write_text(text.replace(*edit))
    said = warm()
    assert ", 1 built, 0 failed" in said, said[-3000:]
    phases = [line for line in said.splitlines() if line.startswith("  export ")]
    assert len(phases) == 1 and "cxx_wrapper" not in phases[0], said[-3000:]
    assert "C++ objects reused" in phases[0]
