"""The fuzz driver for ``test_trust_fuzz``: a server process that is fed mutated state.

``python trust_fuzz.py CONFIG.json`` runs a bounded number of rounds. Before each round
the shared tier (Redis) is put back as it was after a clean ``warm``; then one thing is
mutated (random bytes, wrong types, huge sizes, deep nesting, escape sequences):

- ``record``: a whole record document in Redis (its fields, its text);
- ``manifest``: one value somewhere inside a record's manifest;
- ``chunk``: a blob's chunk (bytes flipped, cut, grown, replaced, a huge one, the wrong
  Redis type, deleted);
- ``row``: an index row, a manifest row or a counter of a copy of the warm local store,
  as text or as a pickle (which would create a canary file if it were ever unpickled);
- ``member``: a member of a bundle of the warm store (its bytes, or its name), imported
  with ``cachebuild import``.

Then the server starts from that state: ``cachebuild.compile`` on the tiny model, called
at two sizes and compared with eager, plus ``verify``, ``ls --json`` and ``explain`` of
the shared records. A round passes if each either works (the same output as eager) or
stops with a one-line ``CachebuildError``; it fails on any other exception (a traceback),
on a round that runs longer than ``ROUND_SECONDS`` (a hang), or if the canary exists
(something unverified ran). Prints a JSON report.
"""

from __future__ import annotations

import io
import json
import os
import pickle
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

ROUND_SECONDS = 60
SURFACES = ("record", "manifest", "chunk", "row", "member")


class Hang(Exception):
    pass


class Planted:
    """What a pickled index row holds: creates the canary if it is ever unpickled."""

    def __init__(self, canary: str) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.canary, "w"))


# -- mutations ------------------------------------------------------------------------------

def junk(rng: random.Random) -> Any:
    """A value of the wrong type, size or content."""
    pick = rng.randrange(14)
    if pick == 0:
        return rng.randbytes(rng.randrange(0, 48)).decode("latin-1")
    if pick == 1:
        return rng.choice([None, True, False, 0, -1, 1 << 70, -(1 << 70), 3.5, 1e308])
    if pick == 2:
        return rng.choice([[], {}, [None], {"": None}])
    if pick == 3:
        return "x" * (1 << rng.randrange(8, 21))
    if pick == 4:
        value: Any = "deep"
        for _ in range(rng.randrange(20, 400)):
            value = [value] if rng.random() < 0.5 else {"d": value}
        return value
    if pick == 5:
        return "\x1b]0;owned\x07\x1b[2J[red]markup[/red] :skull:"
    if pick == 6:
        return rng.choice(["../../../../etc/passwd", "/etc/passwd", "fn:os:system",
                           "op:__class__::__init__", "a" * 32, "ab" * 16, "entry"])
    if pick == 7:
        return [rng.randrange(-5, 1 << 40) for _ in range(rng.randrange(0, 8))]
    if pick == 8:
        return {"t": [{"n": "x"}], "nodes": [{"op": "call_function", "target": "fn:os:system"}]}
    if pick == 9:
        return float(rng.choice(["nan", "inf", "-inf"]))
    if pick == 10:
        return rng.randrange(1 << 62)
    if pick == 11:
        return [junk(rng) for _ in range(rng.randrange(1, 4))]
    if pick == 12:
        return "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randrange(1, 40)))
    return str(rng.random())


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (dict keys and list indices)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:50]):
            out += paths(v, (*prefix, i))
    return out


def mutate_value(rng: random.Random, doc: Any) -> Any:
    """``doc`` with one value somewhere inside replaced, deleted or renamed."""
    path = rng.choice(paths(doc))
    if not path:
        return junk(rng)
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    action = rng.randrange(4)
    if action == 0 and isinstance(parent, dict):
        del parent[last]
    elif action == 1 and isinstance(parent, dict):
        parent[str(junk(rng))[:20]] = parent.pop(last)
    else:
        parent[last] = junk(rng)
    return doc


def mutate_text(rng: random.Random, text: bytes) -> bytes:
    """JSON text with a value changed, or the text itself damaged."""
    action = rng.randrange(6)
    if action <= 2:
        try:
            return json.dumps(mutate_value(rng, json.loads(text))).encode()
        except (ValueError, RecursionError):
            pass
    if action == 3 and text:
        return text[:rng.randrange(len(text))]
    if action == 4:
        return b"[" * 100_000 + b"]" * 100_000
    return rng.randbytes(rng.randrange(0, 200))


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    action = rng.randrange(5)
    if action == 0 and data:
        i = rng.randrange(len(data))
        return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
    if action == 1 and data:
        return data[:rng.randrange(len(data))]
    if action == 2:
        return data + rng.randbytes(rng.randrange(1, 5000))
    if action == 3:
        return rng.randbytes(rng.randrange(0, 5000))
    return bytes(rng.randrange(1 << 20, 4 << 20))


# -- the driver -----------------------------------------------------------------------------

class Driver:
    def __init__(self, config: dict[str, Any]) -> None:
        import redis

        sys.path.insert(0, config["tests"])
        self.cfg = config
        self.work = Path(config["work"])
        self.canary = self.work / "canary"
        self.client = redis.Redis.from_url(config["url"])
        # Redis as a clean warm left it, restored before every round.
        self.snapshot = {k: self.client.dump(k) for k in self.client.keys("*")}
        self.records = sorted(k for k in self.client.keys("cachebuild:v1:rec:*"))

    def restore(self) -> None:
        self.client.flushdb()
        for k, v in self.snapshot.items():
            self.client.restore(k, 0, v)

    def run(self, rounds: int, seed: int) -> dict[str, Any]:
        from cachebuild.modelfile import load_spec

        self.spec = load_spec(self.cfg["model"])
        report: dict[str, Any] = {"seed": seed, "rounds": 0, "ok": 0, "errors": 0,
                                  "failures": [], "by_surface": {}}
        signal.signal(signal.SIGALRM, self._hang)
        for n in range(rounds):
            rng = random.Random(seed * 1_000_003 + n)
            surface = SURFACES[n % len(SURFACES)]
            what = ""
            signal.alarm(ROUND_SECONDS)
            try:
                self.restore()
                what, outcomes = getattr(self, f"round_{surface}")(rng, n)
            except Hang:
                outcomes = [("hang", "round did not finish in time")]
            except BaseException:
                outcomes = [("traceback", traceback.format_exc()[-2500:])]
            finally:
                signal.alarm(0)
            if self.canary.exists():
                outcomes.append(("unverified", "the canary exists: something unverified ran"))
                self.canary.unlink()
            stats = report["by_surface"].setdefault(surface, {"ok": 0, "errors": 0})
            for kind, detail in outcomes:
                if kind == "ok":
                    report["ok"] += 1
                    stats["ok"] += 1
                elif kind == "error":
                    report["errors"] += 1
                    stats["errors"] += 1
                else:
                    report["failures"].append({"round": n, "surface": surface, "what": what,
                                               "kind": kind, "detail": detail})
            report["rounds"] += 1
        return report

    def _hang(self, *_: Any) -> None:
        raise Hang()

    # -- surfaces ---------------------------------------------------------------------------

    def round_record(self, rng: random.Random, n: int) -> tuple[str, list]:
        name = rng.choice(self.records)
        self.client.set(name, mutate_text(rng, self.client.get(name)))
        return f"record {name.decode()}", self.serve(self._fresh(n), remote=True)

    def round_manifest(self, rng: random.Random, n: int) -> tuple[str, list]:
        name = rng.choice(self.records)
        doc = json.loads(self.client.get(name))
        manifest = doc["record"].get("manifest") or {}
        doc["record"]["manifest"] = mutate_value(rng, manifest) if manifest else junk(rng)
        self.client.set(name, json.dumps(doc))
        return f"manifest of {name.decode()}", self.serve(self._fresh(n), remote=True)

    def round_chunk(self, rng: random.Random, n: int) -> tuple[str, list]:
        key = rng.choice(self.records).decode().rsplit(":", 1)[1]
        chunk = f"cachebuild:v1:blob:{key}:0"
        action = rng.randrange(4)
        if action == 0:
            self.client.delete(chunk)
        elif action == 1:
            self.client.delete(chunk)
            self.client.rpush(chunk, b"not a string")
        elif action == 2:
            self.client.setrange(chunk, rng.randrange(1 << 20, 64 << 20), b"!")
        else:
            self.client.set(chunk, mutate_bytes(rng, self.client.get(chunk) or b""))
        return f"chunk of {key}", self.serve(self._fresh(n), remote=True)

    def round_row(self, rng: random.Random, n: int) -> tuple[str, list]:
        l1 = self._fresh(n)
        shutil.copytree(self.cfg["golden"], l1)
        db = sqlite3.connect(l1 / "v1" / "index" / "cache.db")
        rows = [r[0] for r in db.execute("SELECT key FROM Cache")]
        name = rng.choice(rows)
        action = rng.randrange(4)
        if action == 0:  # a pickle where text belongs: must never be unpickled
            db.execute("UPDATE Cache SET mode=4, value=? WHERE key=?",
                       (pickle.dumps(Planted(str(self.canary))), name))
        elif action == 1:
            value = junk(rng) if rng.random() < 0.5 else rng.randbytes(20)
            if not isinstance(value, str | bytes | float) and not (
                    type(value) is int and abs(value) < 1 << 63):
                value = json.dumps(value)  # what SQLite cannot hold, as JSON text
            db.execute("UPDATE Cache SET value=? WHERE key=?", (value, name))
        else:
            (value,) = db.execute("SELECT value FROM Cache WHERE key=?", (name,)).fetchone()
            text = value.encode() if isinstance(value, str) else bytes(str(value), "ascii")
            db.execute("UPDATE Cache SET value=? WHERE key=?",
                       (mutate_text(rng, text).decode("latin-1"), name))
        db.commit()
        db.close()
        outcomes = self.serve(l1, remote=False)
        return f"index row {name}", outcomes + self.commands(l1)

    def round_member(self, rng: random.Random, n: int) -> tuple[str, list]:
        src = Path(self.cfg["bundle"])
        out = self.work / f"bundle-{n}.tar"
        with tarfile.open(src) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
        target = rng.randrange(len(members))
        with tarfile.open(out, "w") as dst:
            for i, (member, data) in enumerate(members):
                name = member.name
                if i == target:
                    if rng.random() < 0.2:
                        name = rng.choice(["../../evil", "/etc/evil", "objects/zz",
                                           f"records/{'0' * 32}.json", name + "/x"])
                    elif name.endswith(".json"):
                        data = mutate_text(rng, data)
                    else:
                        data = mutate_bytes(rng, data)
                info = tarfile.TarInfo(name)
                info.size = len(data)
                dst.addfile(info, io.BytesIO(data))
        l1 = self._fresh(n)
        outcomes = [self.command(["import", str(out)], l1)]
        out.unlink()
        return f"bundle member {target}", outcomes + self.serve(l1, remote=False)

    # -- the server and the commands ------------------------------------------------------------

    def _fresh(self, n: int) -> Path:
        path = self.work / f"l1-{n}"
        shutil.rmtree(path, ignore_errors=True)
        return path

    def _options(self, l1: Path, remote: bool) -> Any:
        from cachebuild.store.options import StoreOptions

        return StoreOptions(cache_dir=l1, remote=self.cfg["url"] if remote else None,
                            signing_key=self.cfg["key"].encode())

    def serve(self, l1: Path, *, remote: bool) -> list[tuple[str, str]]:
        import torch
        import torch._dynamo

        import cachebuild
        from cachebuild import process_state
        from cachebuild.errors import CachebuildError
        from cachebuild.store import open_store

        process_state.current().loaded.clear()  # as in a fresh server: nothing loaded earlier is reused
        torch._dynamo.reset()
        out: list[tuple[str, str]] = []
        try:
            store = open_store(self._options(l1, remote))
            try:
                spec = self.spec
                compiled = cachebuild.compile(spec.model, spec.config, spec.dynamic_dims,
                                              store=store)
                import models
                with torch.no_grad():
                    for tokens in (3, 11):
                        args = models.inputs(tokens)
                        torch.testing.assert_close(compiled(*args), spec.model(*args),
                                                   rtol=1e-4, atol=1e-4)
                out.append(("ok", ""))
                out += self.explain_shared(store)
            finally:
                store.close()
        except CachebuildError as e:
            out.append(("error", str(e)) if "\n" not in str(e) else ("multiline", str(e)))
        return out

    def explain_shared(self, store: Any) -> list[tuple[str, str]]:
        """What ``explain`` does with the shared tier's records, without tracing."""
        from cachebuild.building.nearest import explain
        from cachebuild.cli.common import printable

        stored = [(r.key, r.manifest) for r in store.records(shared=True)
                  if r.kind != "entry" and r.manifest]
        why = explain({"bucket": {"range": [1, 32]}, "graph": {}}, stored)
        text = "; ".join(printable(r, 300) for r in why.reasons)
        if "\x1b" in text:
            return [("unescaped", text)]
        return [("ok", "")]

    def command(self, args: list[str], l1: Path) -> tuple[str, str]:
        """A CLI command, in this process, on ``l1``: a usage or store error exits 1 or
        2 with one ``error:`` line; anything else escaping is a traceback."""
        from click.testing import CliRunner

        from cachebuild.cli import main as cli

        env = {"CACHEBUILD_SIGNING_KEY": self.cfg["key"], "CACHEBUILD_REMOTE": ""}
        result = CliRunner().invoke(cli.main, ["--cache-dir", str(l1), *args], env=env)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            return ("traceback", "".join(traceback.format_exception(result.exception))[-2500:])
        if result.exit_code not in (0, 1, 2):
            return ("exit", f"{args}: exit {result.exit_code}")
        return ("ok", "") if result.exit_code == 0 else ("error", result.output[-300:])

    def commands(self, l1: Path) -> list[tuple[str, str]]:
        return [self.command(args, l1) for args in (["verify"], ["ls", "--json"], ["stats"])]


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    start = time.monotonic()
    driver = Driver(config)
    report = driver.run(config["rounds"], config["seed"])
    report["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    os.environ.pop("CACHEBUILD_DIR", None)
    main()
