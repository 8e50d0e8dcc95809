"""The fuzz driver of ``test_trust_fuzz_store.py``: stored graphs, guard lists,
records, manifests and bundles, mutated, then read the way a server reads them.

``python store_fuzz.py CONFIG.json`` warms the tests' tiny model (one layer,
``eager_fusion``) into a store without a key and a copy signed with one (that requires
signatures), then runs a bounded number of rounds, each one surface in turn:

- ``graph``: a stored graph (a target's artifact, the entry's stitching graph or one of
  its pieces) with a node changed: a target from a pool of what must never run
  (``aten::from_file`` on a path in the watched folder, ``aten::save``, ``os.system``,
  ``getattr(x, '__class__')``, a storage, a huge power), junk arguments, a node removed;
- ``guards``: the entry's guard list with a record changed, added (one naming a module
  whose import leaves a canary) or removed, half the time with a seal for the new list
  (what a writer of a keyless store can add);
- ``record``: an index record, as JSON and as a row of a copy of the store;
- ``manifest``: a target's manifest, explained;
- ``bundle``: a member of a bundle of the store (bytes, name or record), imported.

After each graph or guard round a server warm-starts from the store (no Dynamo: a miss
is counted, never traced) and runs the model at a size, comparing with eager. A round
fails on a traceback from loading or checking (an exception that is not a one-line
``CachebuildError``), a hang (``ROUND_SECONDS``), a canary (an import a guard named, or
anything the signed store did not verify running), or a file effect (anything created,
changed or read in the watched folder). A mutated graph that loads in the keyless store
and computes something else is not a failure (a keyless store promises no integrity);
one that does in the signed store is. Prints a JSON report.
"""

from __future__ import annotations

import copy
import io
import json
import os
import random
import shutil
import signal
import sqlite3
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Any

ROUND_SECONDS = 20
SURFACES = ("graph", "guards", "record", "manifest", "bundle")
KEY = b"store-fuzz-key"
#: A time long past (2001): any read of a file stamped with it moves its access time
#: (relatime moves one older than a day), so a read of the watched folder shows.
LONG_AGO = 1_000_000_000


class Hang(Exception):
    pass


class Failure(Exception):
    """What must never happen, whatever the input."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


# -- what mutated graphs may name -------------------------------------------------------------

def graph_targets(watched: Path) -> list[tuple[str, str, list[Any]]]:
    """(op, target, args) of nodes a mutation may put in a graph: what must never run or
    touch a file, and some that may. ``"@"`` in args stands for a node of the graph."""
    evil = str(watched / "evil.pth")
    secret = str(watched / "secret")
    return [
        ("call_function", "op:aten::from_file", [evil, True, 64]),
        ("call_function", "op:aten::from_file", [secret, False, 8]),
        ("call_function", "op:aten::from_file.out", [evil, True, 64, "@"]),
        ("call_function", "op:aten::save", ["@", evil]),
        ("call_function", "op:aten::_print", [evil]),
        ("call_function", "op:aten::manual_seed", [3]),
        ("call_function", "op:debugprims::load_tensor", [secret, [2], [1]]),
        ("call_function", "op:aten::set_", ["@", "@"]),
        ("call_function", "op:aten::record_stream", ["@", "@"]),
        ("call_function", "op:profiler::_record_function_enter_new", [evil, None]),
        ("call_function", "fn:os:system", [f"touch {evil}"]),
        ("call_function", "fn:builtins:eval", ["__import__('os').system('true')"]),
        ("call_function", "fn:builtins:open", [evil, "w"]),
        ("call_function", "fn:builtins:__import__", ["fuzz_planted_module"]),
        ("call_function", "fn:importlib:import_module", ["fuzz_planted_module"]),
        ("call_function", "fn:torch:from_file", [evil, True, 64]),
        ("call_function", "fn:torch:frombuffer", ["@"]),
        ("call_function", "fn:torch:save", ["@", evil]),
        ("call_function", "fn:torch:load", [secret]),
        ("call_function", "fn:torch._C._VariableFunctions:_from_blob", [0, [8], [1]]),
        ("call_function", "fn:builtins:getattr", ["@", "__class__"]),
        ("call_function", "fn:builtins:getattr", ["@", "grad_fn"]),
        ("call_function", "fn:builtins:getattr", ["@", "T"]),
        ("call_function", "fn:operator:pow", [3, 1 << 40]),
        ("call_function", "fn:operator:lshift", [1, 1 << 40]),
        ("call_function", "fn:operator:mul", [[0], 1 << 40]),
        ("call_function", "fn:math:factorial", [1 << 30]),
        # The closed language (issue 32): what reached memory a graph was not given.
        ("call_function", "op:aten::_reshape_alias.default", ["@", [1 << 40], [1]]),
        ("call_function", "op:aten::_reshape_alias.default", ["@", [3415], [1]]),
        ("call_function", "op:aten::as_strided.default", ["@", [3415], [1]]),
        ("call_function", "op:aten::_sparse_coo_tensor_unsafe.default", ["@", "@", [4]]),
        ("call_function", "op:aten::set_.source_Tensor", ["@", "@"]),
        ("call_function", "op:aten::sum", ["@"]),
        ("call_function", "op:aten::add.out", ["@", "@"]),
        ("call_function", "op:aten::empty.memory_format", [[64]]),
        ("call_function", "fn:math:prod", [[(1 << 62) + 1] * 4096]),
        ("call_function", "fn:math:lcm", [(1 << 62) + 1, (1 << 62) + 3]),
        ("call_function", "fn:builtins:round", [12345, -(1 << 40)]),
        ("call_method", "new", ["@"]),
        ("call_method", "data_ptr", ["@"]),
        ("call_method", "__pow__", ["@", 1 << 40]),
        ("call_function", "fn:operator:getitem", ["@", 0]),
        ("call_function", "op:aten::add", ["@", "@"]),
        ("call_function", "op:aten::mul", ["@", 2]),
        ("call_function", "op:aten::index_copy_", ["@", 0, "@", "@"]),
        ("call_method", "untyped_storage", ["@"]),
        ("call_method", "numpy", ["@"]),
        ("call_method", "share_memory_", ["@"]),
        ("call_method", "register_hook", ["@", "@"]),
        ("call_method", "__reduce_ex__", ["@", 2]),
        ("call_method", "tolist", ["@"]),
        ("call_method", "view", ["@", -1]),
    ]


def mutate_graph(rng: random.Random, nodes: list[dict], watched: Path) -> list[dict]:
    """``nodes`` with one node replaced, added, changed or removed."""
    from trust_fuzz import mutate_value

    nodes = copy.deepcopy(nodes)
    inner = [i for i, n in enumerate(nodes) if n.get("op") not in ("placeholder", "output")]
    names = [n["name"] for n in nodes if n.get("op") != "output" and isinstance(n, dict)]
    action = rng.randrange(6)
    if action <= 2 or not inner:
        op, target, args = rng.choice(graph_targets(watched))
        data = [{"n": rng.choice(names)} if a == "@" and names else a for a in args]
        node = {"name": f"fuzz_{rng.randrange(1 << 20)}", "op": op, "target": target,
                "args": {"t": data}, "kwargs": {"d": []}}
        if action == 0 and inner:  # in place of a node, under its name
            i = rng.choice(inner)
            node["name"] = nodes[i]["name"]
            nodes[i] = node
        else:
            nodes.insert(rng.choice(inner or [len(nodes) - 1]) if inner else 0, node)
    elif action == 3:
        del nodes[rng.choice(inner)]
    elif action == 4:
        i = rng.choice(inner)
        nodes[i] = mutate_value(rng, nodes[i])
    else:
        nodes = mutate_value(rng, nodes)
    return nodes


def mutate_guards(rng: random.Random, guards: list) -> Any:
    """A guard list with a record changed, added or removed, or replaced by junk."""
    from trust_fuzz import junk, mutate_value

    guards = copy.deepcopy(guards)
    action = rng.randrange(6)
    if action == 0:
        guards.append([[["module", "fuzz_planted_module"], ["attr", "value"]], "equals",
                       None, 1])
    elif action == 1:
        root = rng.choice([["module", rng.choice(["os", "sys", "fuzz_planted_module",
                                                  "antigravity", "this"])],
                           ["env", "HOME"], ["state", "default_dtype"], ["model"],
                           ["arg", rng.randrange(-2, 5)], ["varargs", 0], ["kwargs"]])
        steps = [rng.choice([["attr", rng.choice(["__class__", "__globals__", "system",
                                                  "layers", "__dict__", "environ"])],
                             ["item", rng.choice([0, "os", "x"])], ["type"], ["dict"],
                             ["nthkey", rng.randrange(3)], ["itemkey", 0], ["call", "x"]])
                 for _ in range(rng.randrange(0, 4))]
        guards.append([[root, *steps], rng.choice(["type", "id", "equals", "len", "keys",
                                                   "contains", "in_dict", "exists",
                                                   "tensor", "process_group", "call"]),
                       junk(rng) if rng.random() < 0.5 else None, junk(rng)])
    elif action == 2 and guards:
        del guards[rng.randrange(len(guards))]
    elif action == 3:
        return []
    elif action == 4 and guards:
        return mutate_value(rng, guards)
    else:
        return junk(rng)
    return guards


# -- the driver -------------------------------------------------------------------------------

class Driver:
    def __init__(self, config: dict[str, Any]) -> None:
        sys.path.insert(0, config["tests"])
        self.work = Path(config["work"])
        self.watched = self.work / "watched"
        self.watched.mkdir()
        (self.watched / "secret").write_bytes(b"not for graphs" * 8)
        self.canary = self.work / "canary"
        lib = self.work / "lib"
        lib.mkdir()
        (lib / "fuzz_planted_module.py").write_text(
            f"open({str(self.canary)!r}, 'w').close()\nvalue = 1\n")
        sys.path.insert(0, str(lib))
        self.reads: list[str] = []
        self._mutated = False  # the signed store holds a blob its key did not sign
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple) -> None:
        # Python-level opens of anything in the watched folder (C code is caught by the
        # folder's listing and the secret's access time).
        if event == "open" and args and isinstance(args[0], str | bytes | os.PathLike):
            path = os.fsdecode(args[0])
            if path.startswith(str(self.watched)):
                self.reads.append(path)

    def _snapshot(self) -> list[tuple[str, int, int]]:
        return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                      for p in self.watched.rglob("*"))

    # -- set-up ------------------------------------------------------------------------

    def setup(self) -> None:
        import models
        import torch

        import cachebuild
        from cachebuild.store import LocalStore, export_bundle

        self.model = models.make(models.Decoder, layers=1)
        self.config = models.config()
        self.dims = {0: 0, 1: 0}
        self.args = models.inputs(5)
        with torch.no_grad():
            self.expected = self.model(*self.args)
        plain = self.work / "plain"
        store = LocalStore(plain)
        compiled = cachebuild.compile(self.model, self.config, self.dims, store=store)
        with torch.no_grad():
            compiled(*self.args)
        self.golden = {r.key: (r, store.get(r.key, touch=False)) for r in store.records()}
        store.close()
        # The same records, signed, in a store that requires signatures.
        signed = self.work / "signed"
        keyed = LocalStore(signed, signing_key=KEY, require_signature=True)
        for record, payload in self.golden.values():
            keyed.put(record.key, payload, kind=record.kind, manifest=record.manifest,
                      refs=record.refs)
        keyed.close()
        self.stores = {"plain": plain, "signed": signed}
        self.bundle = self.work / "golden.tar"
        with LocalStore(plain) as store:
            export_bundle(store, self.bundle)
        self.entry_key = next(k for k, (r, _) in self.golden.items() if r.kind == "entry")
        self.graph_keys = [k for k, (r, _) in self.golden.items() if r.kind == "fx-graph"]
        (self.watched / "secret").touch()
        os.utime(self.watched / "secret", (LONG_AGO, LONG_AGO))  # any read moves it (relatime)
        self.baseline = self._snapshot()
        self.secret_atime = (self.watched / "secret").stat().st_atime_ns

    # -- rounds ------------------------------------------------------------------------

    def run(self, rounds: int, seed: int) -> dict[str, Any]:
        report: dict[str, Any] = {"seed": seed, "rounds": 0, "failures": [], "by_surface": {}}
        signal.signal(signal.SIGALRM, self._hang)
        for n in range(rounds):
            rng = random.Random(seed * 1_000_003 + n)
            surface = SURFACES[n % len(SURFACES)]
            stats = report["by_surface"].setdefault(surface, {})
            outcome, detail = "", ""
            signal.alarm(ROUND_SECONDS)
            try:
                outcome = getattr(self, f"round_{surface}")(rng)
            except Failure as e:
                outcome, detail = e.kind, str(e)
            except Hang:
                outcome, detail = "hang", "round did not finish in time"
            except BaseException:
                outcome, detail = "traceback", traceback.format_exc()[-2500:]
            finally:
                signal.alarm(0)
            for kind, what in self._effects():
                outcome, detail = kind, what
            stats[outcome] = stats.get(outcome, 0) + 1
            if outcome in ("traceback", "hang", "canary", "file", "unverified"):
                report["failures"].append({"round": n, "surface": surface, "kind": outcome,
                                           "detail": detail})
            report["rounds"] += 1
        return report

    def _hang(self, *_: Any) -> None:
        raise Hang()

    def _effects(self) -> list[tuple[str, str]]:
        """What a round left that no round may: a canary, a file effect."""
        found = []
        if self.canary.exists():
            found.append(("canary", "a module a guard or graph named was imported"))
            self.canary.unlink()
        if "fuzz_planted_module" in sys.modules:
            del sys.modules["fuzz_planted_module"]
        now = self._snapshot()
        if now != self.baseline or self.reads or \
                (self.watched / "secret").stat().st_atime_ns != self.secret_atime:
            found.append(("file", f"the watched folder changed or was read: {now} {self.reads}"))
            for path in self.watched.iterdir():
                if path.name != "secret":
                    path.unlink() if path.is_file() else shutil.rmtree(path)
            self.reads.clear()
            os.utime(self.watched / "secret", (LONG_AGO, LONG_AGO))
            self.baseline = self._snapshot()
            self.secret_atime = (self.watched / "secret").stat().st_atime_ns
        return found

    def _rewrite(self, which: str, key: str, payload: bytes) -> None:
        """Replace ``key``'s blob as a writer without the key would (unsigned)."""
        from cachebuild.store import LocalStore

        record = self.golden[key][0]
        with LocalStore(self.stores[which]) as store:
            store.delete(key)
            store.put(key, payload, kind=record.kind, manifest=record.manifest,
                      refs=record.refs)

    def _restore(self, which: str, keys: list[str]) -> None:
        from cachebuild.store import LocalStore

        signing = KEY if which == "signed" else None
        with LocalStore(self.stores[which], signing_key=signing) as store:
            for key in keys:
                record, payload = self.golden.get(key, (None, None))
                store.delete(key)
                if record is not None:
                    store.put(key, payload, kind=record.kind, manifest=record.manifest,
                              refs=record.refs)

    def serve(self, which: str) -> str:
        """A warm start from store ``which`` and a call: "ok" (eager's output), "miss"
        (no usable entry or target: a server would trace), "refused" (a one-line error),
        or "ran-otherwise" (a graph that passed every check computed something else or
        raised while running)."""
        import torch

        from cachebuild import process_state
        from cachebuild.building.build import Builder
        from cachebuild.building.planner import Planner
        from cachebuild.errors import CachebuildError
        from cachebuild.serving.runtime import ModelRuntime
        from cachebuild.store import LocalStore

        process_state.current().loaded.clear()
        signing = KEY if which == "signed" else None
        store = LocalStore(self.stores[which], signing_key=signing,
                           require_signature=signing is not None)
        try:
            try:  # loading and checking: only one-line errors may come out
                planner = Planner(self.model, self.config, self.dims, store)
                found = planner.lookup(self.args)
                entry = found.entry
                if entry is None or not all(store.contains(k) for k in entry.target_keys()):
                    return "miss"
                builder = Builder(store, self.config, planner.passes, "cpu")
                loaded = {k: builder.load(k) for k in entry.target_keys()}
                if any(v is None for v in loaded.values()):
                    return "miss"
                runtime = ModelRuntime(entry, loaded, self.model, self.config, self.dims)
            except CachebuildError as e:
                if "\n" in str(e):
                    raise Failure("traceback", f"a multi-line error: {e}") from None
                return "refused"
            if which == "signed" and self._mutated:
                # Every blob a round rewrote is unsigned: it may never load from here.
                raise Failure("unverified", "the signed store loaded what it did not verify")
            try:
                with torch.no_grad():
                    out = runtime(*self.args)
            except CachebuildError:
                return "refused"
            except Exception:
                return "ran-otherwise"
            same = isinstance(out, torch.Tensor) and out.shape == self.expected.shape and \
                torch.allclose(out, self.expected, rtol=1e-4, atol=1e-4)
            return "ok" if same else "ran-otherwise"
        finally:
            store.close()

    def round_graph(self, rng: random.Random) -> str:
        from cachebuild.trust.fxjson import GraphFormatError, data_to_module

        which = rng.choice(["plain", "signed"])
        key = rng.choice([*self.graph_keys, self.entry_key])
        record, payload = self.golden[key]
        doc = json.loads(payload)
        if key == self.entry_key:
            graphs = [("stitch",)] + [("pieces", i, "nodes") for i in range(len(doc["pieces"]))]
            where = rng.choice(graphs)
        else:
            where = ("nodes",)
        holder = doc
        for part in where[:-1]:
            holder = holder[part]
        holder[where[-1]] = mutate_graph(rng, holder[where[-1]], self.watched)
        # The loader on its own: a graph is refused, or loads.
        try:
            data_to_module(holder[where[-1]], {})
        except GraphFormatError as e:
            if "\n" in str(e):
                raise Failure("traceback", f"a multi-line error: {e}") from None
        self._mutated = True
        self._rewrite(which, key, json.dumps(doc).encode())
        try:
            return which + ":" + self.serve(which)
        finally:
            self._restore(which, [key])
            self._mutated = False

    def round_guards(self, rng: random.Random) -> str:
        from cachebuild.keys import guard_seal_key
        from cachebuild.store import LocalStore
        from cachebuild.tracing.guards import GuardSet, check_data

        which = rng.choice(["plain", "signed"])
        doc = json.loads(self.golden[self.entry_key][1])
        doc["guards"] = mutate_guards(rng, doc["guards"])
        try:  # the guard list on its own: refused, or read with plain reads
            GuardSet(check_data(doc["guards"])).values(self.model, self.args)
        except ValueError:
            pass
        self._mutated = True
        self._rewrite(which, self.entry_key, json.dumps(doc).encode())
        sealed = None
        if rng.random() < 0.5:
            try:
                sealed = guard_seal_key(self.entry_key, doc["guards"])
            except (TypeError, ValueError, RecursionError):
                sealed = None
            if sealed is not None:
                with LocalStore(self.stores[which]) as store:
                    store.put(sealed, b"", kind="guards")
        try:
            return which + ":" + self.serve(which)
        finally:
            self._restore(which, [self.entry_key, *([sealed] if sealed else [])])
            self._mutated = False

    def round_record(self, rng: random.Random) -> str:
        from trust_fuzz import junk, mutate_text

        from cachebuild.errors import CachebuildError
        from cachebuild.store import LocalStore
        from cachebuild.store.index import parse_row
        from cachebuild.store.record import BadRecord, Record

        key = rng.choice(list(self.golden))
        text = mutate_text(rng, json.dumps(self.golden[key][0].to_json()).encode())
        for read in (lambda: Record.from_json(json.loads(text), key=key),
                     lambda: parse_row(key, text)):
            try:
                read()
            except (BadRecord, ValueError, RecursionError):
                pass
        # As a row of a copy of the store, read by what a server and `ls`/`verify` do.
        copy_dir = self.work / "record-copy"
        shutil.rmtree(copy_dir, ignore_errors=True)
        shutil.copytree(self.stores["plain"], copy_dir)
        db = sqlite3.connect(copy_dir / "v1" / "index" / "cache.db")
        value: Any = text.decode("latin-1") if rng.random() < 0.8 else junk(rng)
        if not isinstance(value, str | bytes | float) and not (
                type(value) is int and abs(value) < 1 << 63):
            value = json.dumps(value)
        db.execute("UPDATE Cache SET value=? WHERE key=?", (value, key))
        db.commit()
        db.close()
        try:
            with LocalStore(copy_dir) as store:
                list(store.records())
                store.verify()
                store.get(key)
                store.stats()
        except CachebuildError:
            return "refused"
        return "read"

    def round_manifest(self, rng: random.Random) -> str:
        from trust_fuzz import junk, mutate_value

        from cachebuild.building.nearest import explain
        from cachebuild.cli.common import printable
        from cachebuild.keys import diff_manifests

        key = rng.choice(self.graph_keys)
        manifest = copy.deepcopy(self.golden[key][0].manifest)
        mutated = mutate_value(rng, manifest) if rng.random() < 0.9 else junk(rng)
        if not isinstance(mutated, dict):
            return "not-a-manifest"
        why = explain(self.golden[key][0].manifest, [(key, mutated)])
        text = "; ".join(printable(r, 300) for r in why.reasons)
        if "\x1b" in text or "\x07" in text:
            raise Failure("traceback", f"an escape sequence reached the output: {text!r}")
        try:
            diff_manifests(self.golden[key][0].manifest, mutated)
        except (TypeError, ValueError, RecursionError):
            pass
        return "explained"

    def round_bundle(self, rng: random.Random) -> str:
        from trust_fuzz import mutate_bytes, mutate_text

        from cachebuild.errors import CachebuildError
        from cachebuild.store import LocalStore, import_bundle

        with tarfile.open(self.bundle) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
        target = rng.randrange(len(members))
        out = self.work / "fuzzed.tar"
        with tarfile.open(out, "w") as dst:
            for i, (member, data) in enumerate(members):
                name = member.name
                if i == target:
                    pick = rng.random()
                    if pick < 0.15:
                        name = rng.choice(["../../evil", "/etc/evil", "objects/zz",
                                           str(self.watched / "evil.pth"),
                                           f"records/{'0' * 32}.json", name + "/x"])
                    elif name.endswith(".json"):
                        data = mutate_text(rng, data)
                    elif name.startswith("objects/") and pick < 0.6:
                        data = self._mutated_blob(rng, name.split("/", 1)[1], data)
                    else:
                        data = mutate_bytes(rng, data)
                info = tarfile.TarInfo(name)
                info.size = len(data)
                dst.addfile(info, io.BytesIO(data))
        dest = self.work / "imported"
        shutil.rmtree(dest, ignore_errors=True)
        try:
            with LocalStore(dest) as store:
                import_bundle(store, out, trust=True)  # trusted, so a server loads it
        except CachebuildError:
            return "refused"
        # A server starting from what was imported.
        self.stores["imported"] = dest
        self._mutated = False
        return "imported:" + self.serve("imported")

    def _mutated_blob(self, rng: random.Random, key: str, blob: bytes) -> bytes:
        """A well-framed blob (checksum right, unsigned) whose payload is a mutated graph
        or entry: what someone who can write a bundle without the key can make."""
        from cachebuild.store.blob import encode_blob

        record, payload = self.golden.get(key, (None, None))
        if record is None or record.kind not in ("fx-graph", "entry"):
            return blob
        doc = json.loads(payload)
        if record.kind == "entry":
            doc["guards"] = mutate_guards(rng, doc["guards"])
        else:
            doc["nodes"] = mutate_graph(rng, doc["nodes"], self.watched)
        return encode_blob(key, record.kind, json.dumps(doc).encode())


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    start = time.monotonic()
    driver = Driver(config)
    driver.setup()
    setup = time.monotonic() - start
    report = driver.run(config["rounds"], config["seed"])
    report["setup_seconds"] = round(setup, 1)
    report["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    for name in list(os.environ):
        if name.startswith("CACHEBUILD_") and name != "CACHEBUILD_PROBE_DIR":
            del os.environ[name]
    main()
