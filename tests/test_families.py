"""Model families this project did not write, through both front doors and every backend.

Every family of ``hf_families`` (Llama, Qwen2, Qwen3, Mistral with a sliding window,
Gemma, Phi-3, GPT-2, Qwen2-MoE, BERT) is compiled cold in a fresh process with
``eager_fusion`` and an Inductor flavour, then warm in another fresh process (with other
random weights) that must trace nothing, build nothing and import no compiler; both
match eager at several sizes of the bucket. Two families also go through the
``standalone`` flavour and through ``torch.compile``'s front door with every backend.
Cold runs happen in child processes too: transformers keeps per-process registries of the
model classes built so far, which the trace reads, so a test session's history must not
leak into an entry.
"""

from __future__ import annotations

import json

import models
import pytest
import torch

import cachebuild

# transformers (hf_families) is imported inside the tests: importing it imports Triton,
# which must not happen while tests are collected (test_kernels sets Triton's interpreter
# mode when it is collected).
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "gpt2", "qwen2_moe", "bert"]

#: Runs in a fresh process: each case of CASES ([front door, backend, flavour, store]) on
#: FAMILY's model, checked against eager at the family's sizes; prints the counter deltas
#: per case and how many frames Dynamo compiled.
CHILD = """
import json, os, sys

import torch

import cachebuild
import hf_families as H
from cachebuild.store import LocalStore

family = H.FAMILIES[os.environ["FAMILY"]]
model = family.model(seed=int(os.environ["SEED"]), cache=bool(os.environ.get("CACHE")))
results, checks = {}, []
for door, backend, flavour, store in json.loads(os.environ["CASES"]):
    config = H.compile_config(family, backend, flavour)
    before = cachebuild.stats()
    if door == "compile":
        compiled = cachebuild.compile(model, config, {0: 0}, store=LocalStore(store))
        sizes = family.sizes
    else:
        dynamo = torch.compile(model, backend=cachebuild.backend(config, store=LocalStore(store)),
                               fullgraph=True)

        def compiled(ids, dynamo=dynamo):
            torch._dynamo.mark_dynamic(ids, 0)
            return dynamo(ids)

        sizes = [s for s in family.sizes if s > 1]  # size 1 would be a static recompile
    with torch.no_grad():
        checks += [(size, compiled(*H.ids(size))) for size in sorted(sizes, reverse=True)]
    after = cachebuild.stats()
    results["/".join((door, backend, flavour))] = {
        k: after[k] - before[k] for k in after if isinstance(after[k], int)}
# Counted before the eager runs (importing transformers imports Dynamo and Inductor
# already, so what is imported tells nothing here; frames Dynamo compiled do).
from torch._dynamo.utils import counters

frames = counters["frames"]["total"]
with torch.no_grad():
    for size, out in checks:
        H.assert_close(out, model(*H.ids(size)))
print(json.dumps({"results": results, "frames": frames}))
"""

#: The cases of each family beyond ``cachebuild.compile`` with eager_fusion and the
#: family's Inductor flavour. The torch.compile cases share the stores of the
#: cachebuild.compile cases: the pieces of Dynamo's graph have the keys cachebuild.compile
#: built, so they load them (test_generate builds through torch.compile's door cold).
TORCH_DOOR = [("compile", "inductor", "standalone"), ("torch", "eager_fusion", "auto"),
              ("torch", "inductor", "aoti"), ("torch", "inductor", "standalone")]
EXTRA = {"llama": TORCH_DOOR, "qwen2": TORCH_DOOR}


def cases(family, root) -> list[list[str]]:
    out = [("compile", "eager_fusion", "auto")]
    if family.name != "phi3":  # Phi-3 through Inductor: test_phi3_aoti below
        out.append(("compile", "inductor", family.inductor))
    out += EXTRA.get(family.name, [])
    return [[*case, str(root / "-".join(case[1:]))] for case in out]


def run(family: str, case_list, seed: int, **env) -> dict:
    return models.run_python(CHILD, env={"FAMILY": family, "SEED": str(seed),
                                         "CASES": json.dumps(case_list), **env})


def test_every_family_is_tested():
    import hf_families

    assert sorted(FAMILIES) == sorted(hf_families.FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_family_cold_then_warm_in_a_fresh_process(tmp_path, name):
    import hf_families

    family = hf_families.FAMILIES[name]
    case_list = cases(family, tmp_path)
    cold = run(name, case_list, seed=0)
    for case, delta in cold["results"].items():
        assert delta["failed"] == 0, case
        if case.startswith("compile"):
            assert delta["traced"] == 1 and delta["built"] >= 1, (case, delta)
        else:  # loaded (in this process already) what compile built
            assert delta["built"] == 0 and delta["unique"] >= 1, (case, delta)
    warm = run(name, case_list, seed=1)
    for case, delta in warm["results"].items():
        assert delta["built"] == 0 and delta["traced"] == 0 and delta["failed"] == 0, (case, delta)
        if case.startswith("compile"):
            assert delta["entries_loaded"] == 1, (case, delta)
    if all(door == "compile" for door, *_ in case_list):
        assert warm["frames"] == 0  # guards checked without Dynamo: it compiled no frame


OLD_DYNAMO = tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13)


@pytest.mark.parametrize("door", [
    pytest.param("compile", marks=pytest.mark.xfail(
        OLD_DYNAMO, strict=True, reason="torch 2.11 and 2.12's guard builder cannot give the guards' "
        "values of transformers' cache (a one-line UsageError says so)")),
    "torch"])
def test_default_use_cache_passes_output_and_cache_through(tmp_path, door):
    """transformers' default ``use_cache=True``: the model output dataclass with its
    DynamicCache comes back as eager returns it, cold and warm."""
    case_list = [[door, "eager_fusion", "auto", str(tmp_path / "store")]]
    cold = run("llama", case_list, seed=0, CACHE="1")
    warm = run("llama", case_list, seed=1, CACHE="1")
    (cold_delta,), (warm_delta,) = cold["results"].values(), warm["results"].values()
    assert cold_delta["built"] >= 1 and warm_delta["built"] == 0
    if door == "compile":
        assert warm_delta["entries_loaded"] == 1 and warm_delta["traced"] == 0


def test_eager_fusion_range_target_is_not_specialised_to_the_hint(open_local, tmp_path):
    """A biased linear on ``[1, T, H]`` (Qwen2) was stored specialised to the range's hint
    (16): the first call at another size raised "shape '[16, 64]' is invalid"."""
    import hf_families

    family = hf_families.FAMILIES["qwen2"]
    model = family.model()
    config = cachebuild.CompileConfig(splitting_ops=(hf_families.SDPA,),
                                      compile_ranges=((1, 32),), backend="eager_fusion")
    compiled = cachebuild.compile(model, config, {0: 0}, store=open_local(tmp_path / "store"))
    hf_families.check_sizes(compiled, model, (16, 5, 1, 32))


@pytest.mark.slow
def test_phi3_aoti_matches_eager_past_one_token(open_local, tmp_path):
    """Phi-3 hands the splitting op a fused-qkv view rotated through torch.cat: SDPA's
    output follows those strides, and the next AOTI piece reads its input with the strides
    it was compiled for only because the runtime copies it to them."""
    import hf_families

    family = hf_families.FAMILIES["phi3"]
    model = family.model()
    compiled = cachebuild.compile(model, hf_families.compile_config(family, "inductor", "aoti"),
                                  {0: 0}, store=open_local(tmp_path / "store"))
    with torch.no_grad():
        for size in (9, 24, 2):
            hf_families.assert_close(compiled(*hf_families.ids(size)),
                                     model(*hf_families.ids(size)))
