"""Trust, with a model: ``cachebuild warm`` and a server (``cachebuild.compile`` in a fresh
process) against stores and a real redis-server that were tampered with, rotated, filled
or fed bad input.

The model is the tests' tiny decoder (one layer, ``eager_fusion``: two unique targets,
quick to build), written as a MODEL.py. Items of issue 12: 2 (tampered remote targets,
key rotation, escaped manifests), 4 (one store, one policy), 6 (stored graphs naming any
callable), 8 (a server on a full disk), 11 (bad input through the library and the CLI).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path

import pytest
import xxhash
from mounts import tmpfs
from redis_server import RedisServer, require_redis_server
from trust import assert_one_line_error, clean_env, cli, fill, python, require_root

from cachebuild.store.blob import encode_blob
from cachebuild.store.remote import chunk_key, record_key

pytestmark = pytest.mark.slow

MODEL_PY = """
import cachebuild
import models


def build():
    model = models.make(models.Decoder, layers=1)
    return cachebuild.ModelSpec(model, models.inputs(8), {0: 0, 1: 0}, models.config(%s))
"""

#: A server: compiles the model from MODEL.py with the store the environment configures,
#: checks it against eager at three sizes, and prints its counters. An error raised on
#: purpose is printed the way the CLI prints it (one line) and exits 1; anything else is a
#: traceback, which the tests treat as a failure.
SERVER = r"""
import json, sys
import torch
import cachebuild
from cachebuild.errors import CachebuildError
from cachebuild.modelfile import load_spec

try:
    spec = load_spec(sys.argv[1])
    compiled = cachebuild.compile(spec.model, spec.config, spec.dynamic_dims)
    import models
    with torch.no_grad():
        for tokens in (1, 5, 17):
            args = models.inputs(tokens)
            torch.testing.assert_close(compiled(*args), spec.model(*args), rtol=1e-4, atol=1e-4)
except CachebuildError as e:
    print("error:", " ".join(str(e).split()), file=sys.stderr)
    sys.exit(1)
print(json.dumps(cachebuild.stats()))
"""

SUMMARY = re.compile(r"(\d+) targets?: (\d+) already stored, (\d+) built, (\d+) failed")


def model_file(tmp_path: Path, config: str = "") -> Path:
    path = tmp_path / "model.py"
    path.write_text(MODEL_PY % config)
    return path


def serve(model: Path, env: dict[str, str]) -> dict:
    proc = python(SERVER, str(model), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def warm(model: Path, env: dict[str, str]) -> tuple[int, int, int, int]:
    proc = cli("warm", str(model), "--jobs", "1", env=env, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    found = SUMMARY.search(proc.stderr + proc.stdout)
    assert found, proc.stderr[-2000:]
    return tuple(int(g) for g in found.groups())  # type: ignore[return-value]


# -- 2: tampered remote targets and a rotated key -------------------------------------------


def test_tampered_remote_targets_are_rebuilt_and_a_new_key_rebuilds_once(tmp_path):
    require_redis_server()
    model = model_file(tmp_path)
    with RedisServer() as server:
        def env(l1: str, key: str) -> dict[str, str]:
            return clean_env(CACHEBUILD_DIR=str(tmp_path / l1), CACHEBUILD_REMOTE=server.url,
                             CACHEBUILD_SIGNING_KEY=key)

        assert warm(model, env("builder", "fleet-signing-key-A")) == (2, 0, 2, 0)
        targets = [k.decode().rsplit(":", 1)[1] for k in server.client().keys(record_key("*"))]
        targets = [k for k in targets if json.loads(server.client().get(record_key(k)))
                   ["record"]["kind"] not in ("entry", "guards")]
        assert len(targets) == 2
        # Without the key: one target re-framed unsigned, the other loses its chunk.
        client = server.client()
        blob = encode_blob(targets[0], "fx-graph", b'{"nodes": []}')
        doc = json.loads(client.get(record_key(targets[0])))
        client.set(chunk_key(targets[0], 0), blob)
        doc.update(length=len(blob), xxh3_128=xxhash.xxh3_128_hexdigest(blob))
        client.set(record_key(targets[0]), json.dumps(doc))
        client.delete(chunk_key(targets[1], 0))
        # Another machine: both are missing, so both are built; warm succeeds, and so
        # does the server after it, loading everything.
        assert warm(model, env("second", "fleet-signing-key-A")) == (2, 0, 2, 0)
        assert serve(model, env("second", "fleet-signing-key-A"))["built"] == 0
        # The fleet rotates its key: each machine rebuilds once, then loads.
        assert warm(model, env("rotated", "fleet-signing-key-B")) == (2, 0, 2, 0)
        stats = serve(model, env("rotated", "fleet-signing-key-B"))
        assert stats["built"] == 0 and stats["traced"] == 0


def test_explain_prints_remote_manifests_escaped(tmp_path):
    require_redis_server()
    model = model_file(tmp_path)
    with RedisServer() as server:
        env = clean_env(CACHEBUILD_DIR=str(tmp_path / "l1"), CACHEBUILD_REMOTE=server.url,
                        CACHEBUILD_ALLOW_UNSIGNED="1")
        client = server.client()
        wanted = {"range": [1, 32]}
        # The nearest (same bucket) names a factor whose value is printed.
        weird = [{"bucket": wanted, "backend": "\x1b]0;owned\x07\x1b[2J[red]x[/red]"},
                 {"bucket": [], "graph": [1, [2, {"deep": "\x1b[31m"}]]},
                 {"bucket": "not a bucket", "passes": {"passes": "not a list"}}]
        for i, manifest in enumerate([*weird, "a string", [1, 2]]):
            k = secrets.token_hex(16)
            blob = encode_blob(k, "fx-graph", b"{}")
            client.set(chunk_key(k, 0), blob)
            client.set(record_key(k), json.dumps({
                "format": 1, "chunks": 1, "length": len(blob),
                "xxh3_128": xxhash.xxh3_128_hexdigest(blob),
                "record": {"key": k, "kind": "fx-graph", "size": 2, "checksum": "0" * 32,
                           "created": float(i), "manifest": manifest, "refs": []}}))
        proc = cli("explain", str(model), env=env, timeout=600)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert "missing; nearest" in proc.stdout
        assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout
        assert "\\x1b" in proc.stdout and "[red]x[/red]" in proc.stdout


# -- 4: one store, one policy ---------------------------------------------------------------


def test_compile_refuses_unsigned_blobs_exactly_as_the_cli_does(tmp_path):
    model = model_file(tmp_path)
    store = tmp_path / "store"
    assert warm(model, clean_env(CACHEBUILD_DIR=str(store))) == (2, 0, 2, 0)  # no key yet
    strict = clean_env(CACHEBUILD_DIR=str(store), CACHEBUILD_SIGNING_KEY="fleet-signing-key",
                       CACHEBUILD_REQUIRE_SIGNATURE="1")
    proc = cli("verify", env=strict)
    assert proc.returncode == 1
    # Two targets, the entry and the seal of its guards.
    assert proc.stderr.count("unsigned, and CACHEBUILD_REQUIRE_SIGNATURE is set") == 4
    assert "0 damaged, 4 unsigned (refused)" in proc.stdout and "damaged" not in proc.stderr
    # The library, from the same environment, refuses the same blobs: it rebuilds them.
    stats = serve(model, strict)
    assert stats["built"] == 2 and stats["traced"] == 1
    assert cli("verify", env=strict).returncode == 0


# -- 6: stored graphs naming any callable ----------------------------------------------------


def _graph(*calls: tuple[str, str, list]) -> list[dict]:
    """A stored graph of input ``x``: each call ``(name, target, args)`` in turn, the last
    one's value returned. ``"x"`` and earlier names in ``args`` refer to those nodes."""
    def arg(a: object) -> object:
        return {"n": a} if isinstance(a, str) and a in names else a

    names = {"x"}
    nodes = [{"name": "x", "op": "placeholder", "target": "x", "args": {"t": []},
              "kwargs": {"d": []}}]
    for name, target, args in calls:
        op = "call_method" if not target.startswith(("fn:", "op:")) else "call_function"
        nodes.append({"name": name, "op": op, "target": target,
                      "args": {"t": [arg(a) for a in args]}, "kwargs": {"d": []}})
        names.add(name)
    nodes.append({"name": "output", "op": "output", "target": "output",
                  "args": {"t": [{"t": [{"n": calls[-1][0]}]}]}, "kwargs": {"d": []}})
    return nodes


def test_stored_graphs_that_run_commands_or_touch_files_never_run(tmp_path):
    """Graphs naming only operators still cannot write or read files: the audit's
    ``from_file(shared=True)`` + ``copy_`` that planted a ``.pth`` file, the same call
    reading ``/etc/passwd`` into an output, ``aten::save``, and ``os.system``."""
    model = model_file(tmp_path)
    store_dir = tmp_path / "store"
    env = clean_env(CACHEBUILD_DIR=str(store_dir))
    assert warm(model, env)[2] == 2
    planted = tmp_path / "site-packages" / "evil.pth"
    planted.parent.mkdir()
    attacks = {
        r"graph calls os\.system, which stored graphs may not call":
            _graph(("y", "fn:os:system", [f"touch {planted}"])),
        r"graph calls operator aten::from_file, which stored graphs may not call: "
        r"aten::from_file is not in the table":
            _graph(("f", "op:aten::from_file", [str(planted), True, 64]),
                   ("y", "copy_", ["f", "x"])),
        r"graph calls torch\.from_file, which stored graphs may not call":
            _graph(("y", "fn:torch:from_file", ["/etc/passwd", False, 64])),
        r"graph calls operator aten::save, which stored graphs may not call":
            _graph(("y", "op:aten::save", ["x", str(planted)])),
        r"graph calls method untyped_storage":
            _graph(("s", "untyped_storage", ["x"]), ("y", "resize_", ["s", 0])),
    }
    (tmp_path / "attacks.json").write_text(json.dumps(list(attacks.values())))
    proc = python(SERVE_EACH, str(model), str(tmp_path / "attacks.json"), env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.splitlines()[-1])
    for why, error in zip(attacks, errors, strict=True):
        assert re.search(r"stored graph of target [0-9a-f]+ was not loaded: " + why, error), error
        assert "\n" not in error
    assert not planted.exists() and not any(planted.parent.iterdir())


#: A server started once per stored graph: for each graph in a JSON list, the store's
#: graph targets are replaced by it (as someone who can write the store would), and the
#: model is compiled afresh (nothing loaded earlier is reused); prints each one-line error.
SERVE_EACH = r"""
import json, sys
import torch
import cachebuild
from cachebuild import process_state
from cachebuild.errors import CachebuildError
from cachebuild.modelfile import load_spec
from cachebuild.store import open_store

spec = load_spec(sys.argv[1])
errors = []
for nodes in json.loads(open(sys.argv[2]).read()):
    store = open_store()
    for record in list(store.records(kind="fx-graph")):
        store.delete(record.key)
        store.put(record.key, json.dumps({"nodes": nodes}).encode(), kind="fx-graph",
                  manifest=record.manifest)
    process_state.current().loaded.clear()
    try:
        compiled = cachebuild.compile(spec.model, spec.config, spec.dynamic_dims, store=store)
        import models
        with torch.no_grad():
            compiled(*models.inputs(5))
        errors.append("ran")
    except CachebuildError as e:
        errors.append(str(e))
    store.close()
print(json.dumps(errors))
"""


# -- 8: a server on a full disk ---------------------------------------------------------------


def test_a_server_loads_its_stored_targets_from_a_full_disk(tmp_path):
    require_root()
    model = model_file(tmp_path)
    with tmpfs(tmp_path / "disk", "80m") as disk:
        env = clean_env(CACHEBUILD_DIR=str(disk / "store"))
        assert warm(model, env)[2] == 2
        fill(disk)
        stats = serve(model, env)
        assert stats["built"] == 0 and stats["traced"] == 0 and stats["loaded"] == 2


# -- 11: bad input ------------------------------------------------------------------------------

BAD_CALLS = r"""
import json
import cachebuild, models
from cachebuild.errors import ConfigError

calls = {
    "config='fast'": lambda: cachebuild.compile(models.make(), config="fast"),
    "dynamic_dims={'0': 0}": lambda: cachebuild.compile(models.make(), dynamic_dims={"0": 0}),
    "compile_sizes=(3.7,)": lambda: cachebuild.CompileConfig(compile_sizes=(3.7,)),
    "compile_sizes=('8',)": lambda: cachebuild.CompileConfig(compile_sizes=("8",)),
    "pad_to_capture_size='no'": lambda: cachebuild.CompileConfig(pad_to_capture_size="no"),
    "range to inf": lambda: cachebuild.CompileConfig(compile_ranges=((1, float("inf")),)),
    "splitting_ops=None": lambda: cachebuild.CompileConfig(splitting_ops=None),
    "capture_sizes=('x',)": lambda: cachebuild.CompileConfig(capture_sizes=("x",)),
    "inductor_options=5": lambda: cachebuild.CompileConfig(inductor_options=5),
    "nosuchlib::op": lambda: cachebuild.compile(
        models.make(), models.config(splitting_ops=("nosuchlib::op",)), {0: 0, 1: 0})(
        *models.inputs(4)),
}
out = {}
for name, call in calls.items():
    try:
        call()
        out[name] = "accepted"
    except ConfigError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def test_bad_config_values_are_one_line_config_errors(tmp_path):
    proc = python(BAD_CALLS, env=clean_env(CACHEBUILD_DIR=str(tmp_path / "store")))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for name, message in json.loads(proc.stdout.splitlines()[-1]).items():
        assert message != "accepted" and "\n" not in message, (name, message)
    # Through the command line: exit 2, one line.
    env = clean_env(CACHEBUILD_DIR=str(tmp_path / "store"))
    (tmp_path / "bad").mkdir()
    bad = model_file(tmp_path / "bad", "compile_sizes=(3.7,)")
    assert_one_line_error(cli("plan", str(bad), env=env), 2, r"must be a whole number, got 3\.7")
    model = model_file(tmp_path)
    assert_one_line_error(cli("warm", str(model), "--device", "nonsense!!", env=env), 2,
                          r"--device 'nonsense!!' is not a device")
    assert_one_line_error(cli("warm", str(model), "--device", "cuda:0", env=env), 2,
                          r"--device 'cuda:0' is not usable here")


# -- issue 25, 6: guards are data --------------------------------------------------------

EPS_MODEL_PY = """
import torch
import cachebuild
import models


def build():
    model = models.make(models.Decoder, layers=1)
    for m in model.modules():
        if isinstance(m, torch.nn.RMSNorm):
            m.eps = %r
    return cachebuild.ModelSpec(model, models.inputs(8), {0: 0, 1: 0}, models.config())
"""


#: A server that, three times, finds the model entry edited as someone who can write a
#: store without a signing key could (the blob re-framed, its checksum right), then starts
#: a model from that store (a fresh compile, nothing loaded earlier reused) and compares
#: it with eager: a guard added that names a module whose import leaves a canary; no
#: guards at all, for a model whose RMSNorm eps differs from the traced one's; a guard
#: path step no reader knows. Prints how many traces each start took.
GUARD_SERVER = r"""
import json, sys
import torch
import cachebuild
from cachebuild import process_state
from cachebuild.counters import COUNTERS
from cachebuild.modelfile import load_spec
from cachebuild.store import LocalStore

store_dir, traced_model, other_model = sys.argv[1:4]
edits = [
    (lambda doc: doc["guards"].append(
        [[["module", "planted_guard_module"], ["attr", "value"]], "equals", None, 1]),
     traced_model),
    (lambda doc: doc.update(guards=[]), other_model),
    (lambda doc: doc["guards"].append([[["model"], ["call", "x"]], "equals", None, 1]),
     other_model),
]
traces = []
for edit, path in edits:
    store = LocalStore(store_dir)
    (record,) = list(store.records(kind="entry"))
    doc = json.loads(store.get(record.key))
    edit(doc)
    store.delete(record.key)
    store.put(record.key, json.dumps(doc).encode(), kind="entry", manifest=record.manifest,
              refs=record.refs)
    spec = load_spec(path)
    process_state.current().loaded.clear()
    before = COUNTERS.traced
    compiled = cachebuild.compile(spec.model, spec.config, spec.dynamic_dims, store=store)
    import models
    with torch.no_grad():
        for tokens in (3, 9):
            args = models.inputs(tokens)
            torch.testing.assert_close(compiled(*args), spec.model(*args), rtol=1e-4, atol=1e-4)
    traces.append(COUNTERS.traced - before)
    store.close()
print(json.dumps({"traces": traces, "imported": "planted_guard_module" in sys.modules}))
"""


def test_edited_or_deleted_guards_are_a_miss_and_never_import(tmp_path):
    store_dir = tmp_path / "store"
    (tmp_path / "lib").mkdir()
    env = clean_env(CACHEBUILD_DIR=str(store_dir), PYTHONPATH=os.pathsep.join(
        [str(tmp_path / "lib"), clean_env()["PYTHONPATH"]]))
    traced, other = tmp_path / "model.py", tmp_path / "other.py"
    traced.write_text(EPS_MODEL_PY % 1e-5)
    other.write_text(EPS_MODEL_PY % 0.1)
    assert warm(traced, env)[2] == 2
    # A module whose import leaves a canary: a guard that names it must not import it.
    canary = tmp_path / "imported"
    (tmp_path / "lib" / "planted_guard_module.py").write_text(
        f"open({str(canary)!r}, 'w').close()\nvalue = 1\n")
    proc = python(GUARD_SERVER, str(store_dir), str(traced), str(other), env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    # Each edited entry was a miss: traced again, and every output right (without its
    # guards, the entry of eps 1e-5 would have served the model of eps 0.1).
    assert out == {"traces": [1, 1, 1], "imported": False}
    assert not canary.exists()


# -- issue 25, 7: bad arguments ------------------------------------------------------------

BAD_CONFIGS = r"""
import json
import cachebuild
from cachebuild.config import check_inductor_options
from cachebuild.errors import ConfigError

# A config with options: checking them is left for later when Inductor is not loaded.
import sys
fine = cachebuild.CompileConfig(inductor_options={"max_autotune": True})
imported = "torch._inductor.config" in sys.modules
calls = {
    "range to 2**70": lambda: cachebuild.CompileConfig(compile_ranges=((1, 2**70),)),
    "capture size 10**12": lambda: cachebuild.CompileConfig(capture_sizes=(10**12,)),
    "compile size 2**40": lambda: cachebuild.CompileConfig(
        compile_ranges=((1, 2**31 - 1),), compile_sizes=(2**40,)),
    "100k capture sizes": lambda: cachebuild.CompileConfig(capture_sizes=range(1, 100_001)),
    "10k ranges": lambda: cachebuild.CompileConfig(
        compile_ranges=[(2 * i + 1, 2 * i + 1) for i in range(10_000)]),
    "NaN option": lambda: cachebuild.CompileConfig(inductor_options={"max_autotune": float("nan")}),
    "inf in a list": lambda: cachebuild.CompileConfig(
        inductor_options={"max_autotune_gemm_backends": [1, float("inf")]}),
    "unknown option": lambda: check_inductor_options(
        cachebuild.CompileConfig(inductor_options={"max_autotuen": True})),
}
out = {}
for name, call in calls.items():
    try:
        call()
        out[name] = "accepted"
    except ConfigError as e:
        out[name] = str(e)
out["imported before"] = imported
check_inductor_options(fine)  # a known option passes
print(json.dumps(out))
"""


def test_configs_beyond_bounds_and_unknown_options_are_one_line_errors(tmp_path):
    proc = python(BAD_CONFIGS, env=clean_env(CACHEBUILD_DIR=str(tmp_path / "store")))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out.pop("imported before") is False
    for name, message in out.items():
        assert message != "accepted" and "\n" not in message, (name, message)
    assert "did you mean 'max_autotune'" in out["unknown option"]
    # Through the command line: a model file whose config names an unknown option.
    (tmp_path / "bad").mkdir()
    bad = model_file(tmp_path / "bad", "inductor_options={'max_autotuen': True}")
    env = clean_env(CACHEBUILD_DIR=str(tmp_path / "store"))
    assert_one_line_error(cli("plan", str(bad), env=env), 2,
                          r"Inductor has no setting 'max_autotuen'")


def test_bad_command_line_values_are_one_line_usage_errors(tmp_path):
    env = clean_env(CACHEBUILD_DIR=str(tmp_path / "store"))
    model = model_file(tmp_path)
    (tmp_path / "adir").mkdir()
    for args, match in [
        (["stats", "--prometheus", str(tmp_path / "adir")], r"is a directory"),
        (["stats", "--prometheus", str(tmp_path / "missing" / "m.prom")], r"does not exist"),
        (["warm", str(model), "--world-size", str(10**20)], r"not in the range 1<=x<=1024"),
        (["plan", str(model), "--world-size", "20000"], r"not in the range 1<=x<=1024"),
        (["explain", str(model), "--world-size", "0"], r"not in the range"),
        (["warm", str(model), "--jobs", str(10**20)], r"not in the range 1<=x<=256"),
    ]:
        assert_one_line_error(cli(*args, env=env), 2, match)
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.prom"))
