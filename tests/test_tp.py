"""Tensor-parallel groups of real processes (gloo on CPU): every rank's output equals the
unsharded model's, N ranks starting cold at once on one store build each unique target
once in total, the second start of the group builds nothing, and `cachebuild warm
--world-size N` builds a group's targets in one process with no process group."""

from __future__ import annotations

import pytest
import tp_group
from tp_group import run_group, summed


def assert_cold_group(reports, world, unique):
    assert [r["rank"] for r in reports] == list(range(world))
    assert all(r["world"] == world for r in reports)
    # Equal shards: one entry, the same targets on every rank.
    assert len({r["entry"] for r in reports}) == 1
    assert all(r["keys"] == reports[0]["keys"] for r in reports)
    assert len(reports[0]["keys"]) == unique
    # Each unique target built by one process while the others waited and loaded it.
    assert summed(reports, "built") == unique
    assert summed(reports, "failed") == 0
    assert all(r["stats"]["loaded"] == unique for r in reports)


def assert_warm_group(reports, unique):
    for r in reports:
        s = r["stats"]
        assert (s["built"], s["traced"], s["entries_loaded"], s["loaded"]) == (0, 0, 1, unique)


@pytest.mark.slow
def test_two_ranks_eager_fusion_cold_then_warm(tmp_path):
    store = tmp_path / "store"
    cold = run_group(2, store)
    assert_cold_group(cold, 2, unique=3)  # first piece, a middle layer, the last piece
    assert summed(cold, "traced") == 2
    warm = run_group(2, store)
    assert_warm_group(warm, unique=3)
    assert warm[0]["keys"] == cold[0]["keys"]


def test_four_ranks_eager_fusion_share_as_two_do(tmp_path):
    """Four ranks cold at once build each target once; as many unique targets as with two
    ranks (every rank's shard is equal), and a second start builds nothing."""
    store = tmp_path / "store"
    cold = run_group(4, store)
    assert_cold_group(cold, 4, unique=3)
    warm = run_group(4, store)
    assert_warm_group(warm, unique=3)


def test_uneven_shards_get_their_own_targets(tmp_path):
    """World size 3 with 4 KV heads: rank 0 holds two, ranks 1 and 2 one each. Ranks 1 and
    2 share every target; rank 0 has its own where its shard differs; each unique target
    is built once in total."""
    store = tmp_path / "store"
    reports = run_group(3, store, env={"LLAMA_KV_HEADS": "4"}, sizes=(1, 32))
    assert reports[1]["keys"] == reports[2]["keys"]
    assert reports[1]["entry"] == reports[2]["entry"] != reports[0]["entry"]
    assert set(reports[0]["keys"]).isdisjoint(reports[1]["keys"])  # every piece is sharded
    assert summed(reports, "built") == len(set(reports[0]["keys"]) | set(reports[1]["keys"]))


def test_two_ranks_through_torch_compile_build_once(tmp_path):
    """torch.compile's front door: Dynamo traces on every rank, targets are still built
    once for the group and loaded by the second start."""
    store = tmp_path / "store"
    env = {"FRONT_DOOR": "torch.compile"}
    cold = run_group(2, store, env=env)
    unique = len(cold[0]["keys"])  # every target in the store (Dynamo's graphs for 1 and s0)
    assert unique >= 3 and summed(cold, "built") == unique and summed(cold, "failed") == 0
    warm = run_group(2, store, env=env)
    assert summed(warm, "built") == 0 and all(r["stats"]["loaded"] == unique for r in warm)


@pytest.mark.slow
@pytest.mark.parametrize(("flavour", "kind"), [("aoti", "aoti-cpu"), ("standalone", "standalone")])
def test_two_ranks_inductor_cold_then_warm(tmp_path, flavour, kind):
    """Inductor artifacts with the all-reduce inside: built once for both ranks."""
    store = tmp_path / "store"
    env = {"LLAMA_LAYERS": "1", "LLAMA_BACKEND": "inductor", "LLAMA_FLAVOUR": flavour}
    cold = run_group(2, store, env=env)
    assert_cold_group(cold, 2, unique=2)
    assert cold[0]["kinds"] == [kind]
    warm = run_group(2, store, env=env)
    assert_warm_group(warm, unique=2)


@pytest.mark.slow
def test_warm_world_size_then_four_ranks_build_nothing(tmp_path):
    """`cachebuild warm --world-size 4` plans every rank under a fake process group and
    builds each unique AOTI target once, in worker processes with no process group; the
    four real ranks then start warm."""
    store = tmp_path / "store"
    env = {"LLAMA_LAYERS": "1", "LLAMA_BACKEND": "inductor", "LLAMA_FLAVOUR": "aoti"}
    said = tp_group.cli("--cache-dir", str(store), "warm", "--world-size", "4", "--jobs", "2",
                        str(tp_group.EXAMPLE), env=env)
    assert "2 targets: 0 already stored, 2 built, 0 failed" in said
    assert "(ranks 0-3)" in said  # one entry serves every rank
    warm = run_group(4, store, env=env)
    assert_warm_group(warm, unique=2)
