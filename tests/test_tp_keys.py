"""Tensor-parallel keys, planned in this one process under torch's fake process group:
rank-free and index-free, with the world size and the group layout; equal shards share
targets (across world sizes too), uneven ones do not, and `explain` says which; entries
check the layout; collectives meet stand-in groups while a piece is built alone; graphs
name the model's GPU by type."""

from __future__ import annotations

import json

import models
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import tp_group

from cachebuild import compat
from cachebuild.backends.protocol import DeviceBound
from cachebuild.building.build import Builder, BuildJob, device_copy, jobs_of
from cachebuild.building.entry import record_entry
from cachebuild.building.nearest import explain
from cachebuild.building.planner import Planner
from cachebuild.graph.facts import InputMeta, unpin_device
from cachebuild.keys import make_key
from cachebuild.modelfile import load_spec
from cachebuild.tracing.distributed import fake_world, local_groups


class ShardedMLP(nn.Module):
    """One MLP shard per rank, ``per_rank`` wide whatever the world size (the model grows
    with it): a rank's shard has the same shapes at every world size. Split at the test
    splitting op between the column-parallel half (no collective) and the row-parallel
    half (an all-reduce)."""

    def __init__(self, hidden: int = 32, per_rank: int = 16) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.up = nn.Linear(hidden, per_rank, bias=False)
        self.down = nn.Linear(per_rank, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.cachebuild_tests.transposed_mix(torch.nn.functional.silu(self.up(self.norm(x))))
        return x + funcol.all_reduce(self.down(h), "sum", dist.group.WORLD)


MLP_CONFIG = models.config(splitting_ops=(models.TRANSPOSED,))


def plan_mlp(world: int, store, rank: int = 0, record: bool = False):
    with fake_world(rank, world):
        planner = Planner(models.make(ShardedMLP), MLP_CONFIG, {0: 0}, store)
        args = (torch.randn(8, 32),)
        found = planner.lookup(args)
        entry = found.entry or planner.trace(args, found)
        if record:
            record_entry(entry, store)
    return found, entry


def plan_llama(monkeypatch, world: int, rank: int, store, **sizes: str):
    for name, value in {**tp_group.TINY, **sizes}.items():
        monkeypatch.setenv(name, value)
    with fake_world(rank, world):
        spec = load_spec(tp_group.EXAMPLE)
        planner = Planner(spec.model, spec.config, spec.dynamic_dims, store)
        return planner.trace(spec.example_inputs)


def piece_targets(entry):
    """piece index → its target (one bucket here)."""
    return {t.piece: t for t in entry.targets()}


def test_ranks_of_equal_shards_share_entry_and_targets(open_local, monkeypatch, tmp_path):
    store = open_local(tmp_path / "store")
    rank0, rank1 = (plan_llama(monkeypatch, 2, r, store) for r in (0, 1))
    assert rank0.key == rank1.key
    assert rank0.target_keys() == rank1.target_keys()
    layouts = {i: t.manifest.get("distributed") for i, t in piece_targets(rank0).items()}
    # The first piece (embedding, norm, QKV projection) calls no collective: no layout.
    assert layouts[0] is None
    assert all(v == {"world_size": 2, "groups": {"0": {"size": 2, "rank_steps": [1]}}}
               for i, v in layouts.items() if i > 0)
    text = json.dumps(rank0.manifests)
    assert "cpu:" not in text and '"rank"' not in text


def test_world_sizes_share_the_targets_their_shards_allow(open_local, tmp_path):
    """A piece without collectives and the same shard shapes has one key at world sizes 2
    and 4; a piece with an all-reduce differs by the layout alone, and explain says so."""
    store = open_local(tmp_path / "store")
    _, two = plan_mlp(2, store)
    _, four = plan_mlp(4, store)
    a, b = piece_targets(two), piece_targets(four)
    assert a[0].key == b[0].key
    assert a[2].key != b[2].key
    why = explain(b[2].manifest, [(a[2].key, a[2].manifest)])
    assert why.nearest == a[2].key
    assert why.reasons == ["world size 2 → 4", "process group '0': 2 → 4 ranks"]


def test_uneven_shard_has_its_own_targets_and_explain_says_why(open_local, monkeypatch, tmp_path):
    store = open_local(tmp_path / "store")
    ranks = [plan_llama(monkeypatch, 3, r, store, LLAMA_KV_HEADS="4") for r in range(3)]
    assert ranks[1].target_keys() == ranks[2].target_keys()
    assert set(ranks[0].target_keys()).isdisjoint(ranks[1].target_keys())
    stored = [(t.key, t.manifest) for t in ranks[1].targets()]
    for target in ranks[0].targets():
        why = explain(target.manifest, stored)
        nearest = dict(stored)[why.nearest]
        assert nearest["graph"]["nodes"][0] == target.manifest["graph"]["nodes"][0]
        assert any(r.startswith("input ") and "→" in r for r in why.reasons), why.reasons
        assert not any("world size" in r for r in why.reasons)


def test_an_entry_is_used_only_with_the_layout_it_was_traced_with(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    plan_mlp(2, store, record=True)
    found, four = plan_mlp(4, store, record=True)  # same parameter shapes, same entry key
    assert found.entry is None
    assert "process group '0' of 2 → process group '0' of 4" in found.why
    assert "world size 2 → 4" in found.why
    assert found.key != make_key(found.factors) and store.contains(found.key)  # a variant
    for world in (2, 4):
        again, entry = plan_mlp(world, store)
        assert again.why == "fresh" and entry.layouts()[0]["world_size"] == world


def test_local_groups_stand_in_and_restore():
    layout = {"world_size": 2, "groups": {"0": {"size": 4, "rank_steps": [1]}}}
    with fake_world(0, 2):
        real = compat.registered_group("0")
        with local_groups(layout):
            assert compat.registered_group("0").size() == 4
            x = torch.arange(4.0)
            y = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_reduce(x, "sum", "0"))
            assert torch.equal(y, x)  # communicates nothing
        assert compat.registered_group("0") is real
    with local_groups(layout):  # no process group at all: what a warm worker has
        assert compat.registered_group("0").size() == 4
    assert compat.registered_group("0") is None
    with pytest.raises(ValueError, match="malformed"), local_groups({"groups": {"0": {"size": "2"}}}):
        pass


def test_graphs_name_the_models_gpu_by_type():
    graph = torch.fx.Graph()
    n = graph.placeholder("n")
    a = graph.call_function(torch.arange, (n,), {"device": torch.device("cuda", 1)})
    b = graph.call_function(torch.zeros, ((2,),), {"device": torch.device("cuda", 0)})
    graph.output((a, b))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert unpin_device(gm, "cuda:1") == 1
    assert a.kwargs["device"] == torch.device("cuda")  # the model's GPU: whichever is current
    assert b.kwargs["device"] == torch.device("cuda", 0)  # another GPU, named on purpose
    assert unpin_device(gm, "cpu") == 0


def test_each_rank_builds_on_its_own_gpu_and_copies_have_their_own_keys(open_local, tmp_path):
    """No GPU needed: what a rank on cuda:1 does with a job an entry traced on cuda:0
    holds, and the key of a standalone artifact's copy for another GPU index."""
    _, entry = plan_mlp(2, open_local(tmp_path / "store"))
    job = next(iter(jobs_of(entry, MLP_CONFIG).values()))
    on_gpu0 = BuildJob(job.target, job.nodes,
                       [InputMeta(m.kind, m.dtype, m.shape, m.stride, "cuda:0") for m in job.input_metas],
                       job.config)
    here = Builder(None, MLP_CONFIG, device="cuda:1").here(on_gpu0)
    assert {m.device for m in here.input_metas} == {"cuda:1"}
    assert here.target == job.target  # the same target: its key has no index
    assert Builder(None, MLP_CONFIG, device="cpu").here(on_gpu0) is on_gpu0
    copy = device_copy(on_gpu0, "cuda:1")
    assert copy.target.key not in (job.target.key, device_copy(on_gpu0, "cuda:2").target.key)
    assert copy.target.key == device_copy(on_gpu0, "cuda:1").target.key
    assert copy.target.manifest["device_copy"] == {"of": job.target.key, "device": "cuda:1"}


def test_standalone_artifact_refuses_another_gpu_before_writing(tmp_path):
    from cachebuild.backends.inductor import load_standalone
    from cachebuild.backends.pack import pack

    payload = pack({"artifact.bin": b"not read", "build.json": b'{"device": "cuda:0"}'})

    class OneBlob:
        def get(self, key):
            return payload

        def scratch_dir(self, *, in_memory=False):
            raise AssertionError("nothing may be written for an artifact of another GPU")

    with pytest.raises(DeviceBound, match="built for cuda:0 and cannot run on cuda:1") as e:
        load_standalone("k" * 32, OneBlob(), "cuda:1")
    assert e.value.built_for == "cuda:0"


def test_cli_plans_and_explains_a_world_size(tmp_path):
    """`plan --world-size 3` names the ranks sharing each target; after warming world size
    2, `explain --world-size 3` names the layout change and the uneven rank's shapes."""
    store = str(tmp_path / "store")
    env = {"LLAMA_KV_HEADS": "4"}
    said = tp_group.cli("--cache-dir", store, "plan", "--world-size", "3", str(tp_group.EXAMPLE),
                        env=env)
    assert "3 ranks: 2 entries, 6 unique targets" in said
    assert "ranks 1-2" in said and "rank 0 " in said
    tp_group.cli("--cache-dir", store, "warm", "--world-size", "2", "--jobs", "1",
                 str(tp_group.EXAMPLE), env=env)
    said = " ".join(tp_group.cli("--cache-dir", store, "explain", "--world-size", "3",
                                 str(tp_group.EXAMPLE), env=env).split())  # unwrapped
    # Not stored, but world size 2's same pieces are: "stale" (plan's word), with the ranks.
    assert "stale for ranks 1-2" in said and "stale for rank 0" in said
    assert "world size 2 → 3" in said
    assert "parameter layers.0.o_proj.weight" in said  # the uneven rank's entry, in words
