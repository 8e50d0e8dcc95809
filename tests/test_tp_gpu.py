"""Tensor parallelism on two GPUs of one host (NCCL), and artifacts moving between GPUs.

- A group of two ranks (``cuda:0``, ``cuda:1``) starting cold at once on one store builds
  each unique target once in total (a standalone artifact also once more, as the copy for
  the other GPU: its code names its GPU), captures its CUDA graphs per rank (piecewise, at
  every size it then runs), and every replay equals the unsharded model run eagerly; the
  second start of the group builds nothing.
- An artifact built on ``cuda:0`` loads and runs on ``cuda:1``: AOTI packages and
  eager_fusion graphs as they are (AOTI is given the device index at load), standalone
  artifacts as a copy built once for ``cuda:1``.

Float32, so that the sharded sums and the unsharded ones agree to 1e-3. Run with
``tools/tp_gpu.sh`` (or ``pytest -m cuda tests/test_tp_gpu.py``); skipped without two GPUs.

With one GPU: a one-rank NCCL group whose all-reduces are captured into CUDA graphs, and
two ranks sharing the GPU over gloo that build each CUDA target once in total.
"""

from __future__ import annotations

import json

import models
import pytest
import tp_group
from tp_group import run_group, summed


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA GPUs of one host")

FLAVOURS = [("inductor", "aoti"), ("inductor", "standalone"), ("eager_fusion", "auto")]
GPU = {"LLAMA_DEVICE": "cuda", "LLAMA_DTYPE": "float32"}
UNIQUE = 3  # two layers: the first piece, a middle layer, the last piece

ON_ONE_GPU = """
import json, os

import torch

import cachebuild
from cachebuild.modelfile import import_model
from cachebuild.store import LocalStore

llama = import_model(os.environ["LLAMA"])
torch.manual_seed(0)
model = llama.make_model()  # on LLAMA_DEVICE
compiled = cachebuild.compile(model, llama.config(), {0: 0, 1: 0},
                              store=LocalStore(os.environ["STORE"]))
with torch.no_grad():
    for tokens in json.loads(os.environ["SIZES"]):
        ids, pos = llama.example_inputs(model, tokens)
        out = compiled(ids, pos)
        assert out.device == next(model.parameters()).device
        torch.testing.assert_close(out, model(ids, pos), rtol=1e-3, atol=1e-3)
print(json.dumps({"stats": cachebuild.stats()}))
"""


def on_gpu(index: int, store, backend: str, flavour: str) -> dict:
    env = {**tp_group.TINY, **GPU, "LLAMA_DEVICE": f"cuda:{index}", "LLAMA_BACKEND": backend,
           "LLAMA_FLAVOUR": flavour, "STORE": str(store),
           "LLAMA": str(tp_group.EXAMPLE.with_name("llama.py")),
           "SIZES": json.dumps(list(tp_group.SIZES))}
    return models.run_python(ON_ONE_GPU, env=env)["stats"]


@two_gpus
@pytest.mark.parametrize(("backend", "flavour"), FLAVOURS)
def test_built_on_gpu0_runs_on_gpu1(tmp_path, backend, flavour):
    store = tmp_path / "store"
    first = on_gpu(0, store, backend, flavour)
    assert first["built"] == UNIQUE and first["device_copies"] == 0
    moved = on_gpu(1, store, backend, flavour)
    copies = UNIQUE if flavour == "standalone" else 0
    assert moved["traced"] == 0 and moved["entries_loaded"] == 1
    assert moved["built"] == copies and moved["device_copies"] == copies
    again = on_gpu(1, store, backend, flavour)
    assert again["built"] == 0 and again["traced"] == 0 and again["device_copies"] == copies


@two_gpus
@pytest.mark.parametrize(("backend", "flavour"), FLAVOURS)
def test_two_gpu_group_builds_once_and_replays_graphs(tmp_path, backend, flavour):
    store = tmp_path / "store"
    env = {**GPU, "LLAMA_BACKEND": backend, "LLAMA_FLAVOUR": flavour, "CUDAGRAPHS": "1"}
    copies = UNIQUE if flavour == "standalone" else 0
    cold = run_group(2, store, env=env)
    assert len({r["entry"] for r in cold}) == 1
    assert all(r["keys"] == cold[0]["keys"] for r in cold) and len(cold[0]["keys"]) == UNIQUE
    assert summed(cold, "built") == UNIQUE + copies
    assert summed(cold, "device_copies") == copies
    assert summed(cold, "failed") == 0
    # Graphs captured on each rank at every size it ran, replayed at the second call of
    # each, and each run equalled the unsharded model (checked in the rank).
    assert all(r["captured"] == sorted(tp_group.SIZES) for r in cold)
    assert all(r["replays"] >= len(tp_group.SIZES) for r in cold)
    warm = run_group(2, store, env=env)
    for r in warm:
        assert (r["stats"]["built"], r["stats"]["traced"], r["stats"]["entries_loaded"]) == (0, 0, 1)
        assert r["captured"] == sorted(tp_group.SIZES)
    assert summed(warm, "device_copies") == copies


# -- what one GPU shows --------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "flavour"), FLAVOURS)
def test_one_rank_nccl_group_captures_its_collectives(tmp_path, backend, flavour):
    """World size 1 over NCCL: the pieces' all-reduces run through NCCL inside captured CUDA
    graphs (piecewise, at every size), each replay equal to the model run eagerly; the
    second start builds nothing."""
    store = tmp_path / "store"
    env = {**GPU, "LLAMA_DEVICE": "cuda:0", "LLAMA_BACKEND": backend, "LLAMA_FLAVOUR": flavour,
           "CUDAGRAPHS": "1"}
    cold = run_group(1, store, env=env)
    assert cold[0]["stats"]["built"] == UNIQUE and cold[0]["stats"]["failed"] == 0
    assert cold[0]["captured"] == sorted(tp_group.SIZES)
    warm = run_group(1, store, env=env)
    assert (warm[0]["stats"]["built"], warm[0]["stats"]["traced"]) == (0, 0)
    assert warm[0]["captured"] == sorted(tp_group.SIZES)


@pytest.mark.parametrize(("backend", "flavour"), FLAVOURS)
def test_two_ranks_on_one_gpu_build_each_target_once(tmp_path, backend, flavour):
    """Two ranks sharing GPU 0 over gloo (NCCL refuses two ranks on one GPU), cold at once
    on one store: CUDA targets built once in total, every rank's output equal to the
    unsharded model; the second start builds nothing."""
    store = tmp_path / "store"
    env = {**GPU, "LLAMA_DEVICE": "cuda:0", "LLAMA_DIST_BACKEND": "gloo",
           "LLAMA_BACKEND": backend, "LLAMA_FLAVOUR": flavour}
    cold = run_group(2, store, env=env)
    assert len({r["entry"] for r in cold}) == 1 and len(cold[0]["keys"]) == UNIQUE
    assert summed(cold, "built") == UNIQUE and summed(cold, "failed") == 0
    assert summed(cold, "device_copies") == 0  # both on the GPU the targets were built for
    warm = run_group(2, store, env=env)
    for r in warm:
        assert (r["stats"]["built"], r["stats"]["traced"], r["stats"]["entries_loaded"]) == (0, 0, 1)
