"""Trust, shared tier: anyone who can write to Redis (without the signing key) can write
anything there, and none of it stops a server or runs in one.

A real redis-server; readers are fresh processes that open the store the environment
configures (``open_store()``), as servers do. Items of issue 12: 2 (unsigned metadata),
3 (``push --all`` with unsigned blobs), 9 (bounds on what is read), 10 (tracebacks
instead of a refused item: a lock key with no expiry, names that are not keys).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
import xxhash
from clock import ManualClock
from redis_server import (  # noqa: F401  (the `server` fixture; stores closed after each test)
    RedisServer,
    close_opened_stores,
    closed_after_test,
    redis_server_fixture,
)
from trust import clean_env, cli, python

from cachebuild.errors import LockTimeout
from cachebuild.store.blob import encode_blob
from cachebuild.store.local import LocalStore
from cachebuild.store.remote import PREFIX, RedisRemote, chunk_key, lock_key, record_key
from cachebuild.store.tiered import TieredStore

pytestmark = pytest.mark.redis

KEY = "fleet-key-for-trust-tests"


def new_key() -> str:
    return secrets.token_hex(16)


def writer(root: Path, url: str) -> TieredStore:
    """A store of the fleet writing to ``url`` (closed when the test ends)."""
    local = closed_after_test(LocalStore(root, signing_key=KEY.encode()))
    return TieredStore(local, RedisRemote(url))


def env_for(l1: Path, url: str, **extra: str) -> dict[str, str]:
    return clean_env(**{"CACHEBUILD_DIR": str(l1), "CACHEBUILD_REMOTE": url,
                        "CACHEBUILD_SIGNING_KEY": KEY, **extra})


def doc_of(server: RedisServer, key: str) -> dict:
    return json.loads(server.client().get(record_key(key)))


def set_doc(server: RedisServer, key: str, doc: dict) -> None:
    server.client().set(record_key(key), json.dumps(doc))


#: A server's view of keys: what contains, get_record and get say, in a fresh process.
READ = r"""
import json, sys
from cachebuild.store import open_store

store = open_store()
out = {}
for key in json.loads(sys.argv[1]):
    present = store.contains(key)
    record = store.get_record(key)
    data = store.get(key)
    out[key] = {"present": present, "kind": record.kind if record else None,
                "manifest": record.manifest if record else None,
                "refs": list(record.refs) if record else None,
                "data": data.decode() if data is not None else None}
print(json.dumps(out))
"""


def read(l1: Path, url: str, keys: list[str], **extra: str) -> dict:
    proc = python(READ, json.dumps(keys), env=env_for(l1, url, **extra))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


# -- 2: unsigned metadata -----------------------------------------------------------------


def test_record_fields_of_the_wrong_type_cost_only_metadata(tmp_path, server):
    w = writer(tmp_path / "w", server.url)
    changes = {"created": "yesterday", "size": "big", "refs": 5, "kind": "no such kind!",
               "manifest": [1, 2], "checksum": None}
    keys = {}
    for field, value in [*changes.items(), ("kind", None)]:
        k = new_key()
        w.put(k, f"payload of {field}".encode(), kind="target", manifest={"graph": field})
        doc = doc_of(server, k)
        if value is None:
            del doc["record"][field]
        else:
            doc["record"][field] = value
        set_doc(server, k, doc)
        keys[k] = field
    got = read(tmp_path / "r", server.url, list(keys))
    for k, field in keys.items():
        # The blob is signed and verifies, so it is loaded; the record, now unsigned and
        # ill-formed, contributes nothing: the kind comes from the blob's header.
        assert got[k] == {"present": True, "kind": "target", "manifest": None, "refs": [],
                          "data": f"payload of {field}"}, field


def test_a_target_counts_as_present_only_once_its_bytes_verify(tmp_path, server):
    w = writer(tmp_path / "w", server.url)
    reframed, no_chunk, forged_kind, good = (new_key() for _ in range(4))
    for k in (reframed, no_chunk, forged_kind, good):
        w.put(k, b"the real artifact " + k.encode(), kind="target")
    client = server.client()
    # Someone who can write to Redis, without the key: an unsigned blob with a matching
    # record digest, a deleted chunk, and a record that names another kind.
    blob = encode_blob(reframed, "target", b"attacker's code")
    doc = doc_of(server, reframed)
    client.set(chunk_key(reframed, 0), blob)
    doc.update(length=len(blob), xxh3_128=xxhash.xxh3_128_hexdigest(blob))
    set_doc(server, reframed, doc)
    client.delete(chunk_key(no_chunk, 0))
    doc = doc_of(server, forged_kind)
    doc["record"]["kind"] = "entry"
    set_doc(server, forged_kind, doc)
    got = read(tmp_path / "r", server.url, [reframed, no_chunk, forged_kind, good])
    for k in (reframed, no_chunk, forged_kind):
        assert got[k] == {"present": False, "kind": None, "manifest": None, "refs": None,
                          "data": None}, k
    assert got[good]["present"] and got[good]["data"] == "the real artifact " + good
    # A reader with another key (a rotation): nothing verifies, nothing is present.
    rotated = read(tmp_path / "r2", server.url, [good], CACHEBUILD_SIGNING_KEY="a-new-fleet-signing-key")
    assert rotated[good]["present"] is False and rotated[good]["data"] is None


def test_refs_from_redis_never_decide_what_gc_keeps(open_local, tmp_path, server):
    w = writer(tmp_path / "w", server.url)
    targets = [new_key(), new_key()]
    for t in targets:
        w.put(t, b"target " + t.encode(), kind="target")
    entry = new_key()
    payload = json.dumps({"pieces": [{"targets": [{"bucket": {}, "key": t}]} for t in targets]})
    w.put(entry, payload.encode(), kind="entry", refs=targets)
    decoy = new_key()
    doc = doc_of(server, entry)
    doc["record"]["refs"] = [decoy]  # tampered: would leave the real targets unprotected
    set_doc(server, entry, doc)
    l1 = tmp_path / "server"
    got = read(l1, server.url, [entry, *targets])
    assert got[entry]["refs"] == targets  # from the verified payload, not from Redis
    env = env_for(l1, server.url)
    assert cli("pin", entry, env=env).returncode == 0
    proc = cli("gc", "--max-size", "0", env=env)
    assert proc.returncode == 0 and "3 kept by pins" in proc.stdout, proc.stdout + proc.stderr
    local = open_local(l1, signing_key=KEY.encode())
    assert all(local.contains(k) for k in (entry, *targets))


def test_forged_records_are_never_shown(tmp_path, server):
    w = writer(tmp_path / "w", server.url)
    honest, forged, unsigned = new_key(), new_key(), new_key()
    for k in (honest, forged, unsigned):
        w.put(k, b"x", kind="target", manifest={"graph": "g", "k": k})
    doc = doc_of(server, forged)
    doc["record"]["manifest"]["graph"] = "\x1b]0;owned\x07[red]forged[/red]"
    set_doc(server, forged, doc)
    doc = doc_of(server, unsigned)
    del doc["record"]["sig"]
    set_doc(server, unsigned, doc)
    code = ("from cachebuild.store import open_store\n"
            "print(sorted(r.key for r in open_store().records(shared=True)))")
    proc = python(code, env=env_for(tmp_path / "r", server.url))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str([honest])


# -- 3: push --all with unsigned blobs ----------------------------------------------------


def test_push_all_signs_what_the_local_store_holds_unsigned(open_local, tmp_path, server):
    l1 = tmp_path / "l1"
    before = open_local(l1)  # warmed before the fleet key was configured
    keys = [new_key(), new_key()]
    for k in keys:
        before.put(k, b"built unsigned " + k.encode(), kind="target")
    before.close()
    proc = cli("push", "--all", env=env_for(l1, server.url))
    assert proc.returncode == 0, proc.stderr
    assert "pushed 2" in proc.stdout
    assert "2 unsigned in the local store, signed with CACHEBUILD_SIGNING_KEY" in proc.stdout
    got = read(tmp_path / "other", server.url, keys)
    assert all(got[k]["data"] == "built unsigned " + k for k in keys)


def test_push_reports_a_damaged_remote_copy_and_replaces_it_with_replace(
        open_local, tmp_path, server):
    l1 = tmp_path / "l1"
    w = writer(l1, server.url)
    key = new_key()
    w.put(key, b"artifact " + key.encode(), kind="target")
    w.close()
    chunk = chunk_key(key, 0)
    client = server.client()
    damaged = bytearray(client.get(chunk))
    damaged[-3] ^= 0x01
    client.set(chunk, bytes(damaged))
    doc = doc_of(server, key)
    doc["xxh3_128"] = xxhash.xxh3_128_hexdigest(bytes(damaged))
    set_doc(server, key, doc)

    proc = cli("push", "--all", env=env_for(l1, server.url))
    assert proc.returncode == 1, proc.stderr
    assert "0 already there, 1 rejected" in proc.stdout
    assert f"copy of {key} failed verification here" in proc.stderr
    assert "--replace" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("push", "--all", "--replace", env=env_for(l1, server.url))
    assert proc.returncode == 0, proc.stderr
    assert "pushed 1" in proc.stdout and "1 replaced" in proc.stdout
    assert read(tmp_path / "other", server.url, [key])[key]["data"] == "artifact " + key


# -- 9: bounds ----------------------------------------------------------------------------

MEMORY = r"""
import json, resource, sys
from cachebuild.store import open_store

store = open_store()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
results = [store.get(k) is None for k in json.loads(sys.argv[1])]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"misses": results, "grew_kib": after - before}))
"""


def test_junk_in_redis_is_refused_before_it_is_downloaded(tmp_path, server):
    w = writer(tmp_path / "w", server.url)
    big_chunk, big_record = new_key(), new_key()
    for k in (big_chunk, big_record):
        w.put(k, b"small", kind="target")
    client = server.client()
    client.setrange(chunk_key(big_chunk, 0), 128 << 20, b"!")  # a 128 MiB chunk
    client.setrange(record_key(big_record), 64 << 20, b"}")  # a 64 MiB record
    proc = python(MEMORY, json.dumps([big_chunk, big_record]),
                  env=env_for(tmp_path / "r", server.url))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["misses"] == [True, True]
    assert out["grew_kib"] < 48 << 10, out  # far less than what was there to download


# -- 10: a lock that never expires, names that are not keys ------------------------------

LOCK = r"""
import sys
from cachebuild.store import LocalStore, open_store
from cachebuild.store.options import StoreOptions
from cachebuild.store.remote import RedisRemote
from cachebuild.store.tiered import TieredStore

options = StoreOptions.from_env()
store = TieredStore(LocalStore(options.cache_dir, signing_key=options.signing_key),
                    RedisRemote(options.remote), lock_ttl=1.0,
                    allow_unsigned=options.allow_unsigned)
with store.lock(sys.argv[1]):
    store.put(sys.argv[1], b"built locally", kind="target")
"""


def test_a_lock_key_that_never_expires_is_waited_on_briefly(open_local, tmp_path, server,
                                                           caplog):
    k = new_key()
    server.client().set(lock_key(k), "not a cachebuild lock")  # no expiry
    clock = ManualClock()
    store = TieredStore(open_local(tmp_path / "r", signing_key=KEY.encode(), clock=clock),
                        RedisRemote(server.url, clock=clock), lock_ttl=1.0)
    with caplog.at_level("WARNING"), store.lock(k):  # taken under the local lock alone
        store.put(k, b"built locally", kind="target")
    # Waited one lock lifetime (by the store's clock), not the 600 s a holder gets.
    assert 1.0 <= clock.monotonic() < 2.0
    assert "never expires" in caplog.text


def test_names_in_redis_that_are_not_keys_are_skipped(tmp_path, server):
    w = writer(tmp_path / "w", server.url)
    good = new_key()
    w.put(good, b"fine", kind="target")
    client = server.client()
    for name in ("zz-not-hex", "ABCDEF0123456789ABCDEF", "../../etc", "\x1b[31mred"):
        client.set(f"{PREFIX}rec:{name}", json.dumps({"format": 1}))
    code = ("import json\nfrom cachebuild.store import open_store\n"
            "from cachebuild.store.transfer import pull\n"
            "counts = pull(open_store())\n"
            "print(json.dumps(counts.as_dict()))")
    proc = python(code, env=env_for(tmp_path / "r", server.url))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.splitlines()[-1])
    assert counts["transferred"] == 1 and counts["failed"] == 0
    # And the library refuses a name that is not a key with a count, not an exception.
    code = ("import json\nfrom cachebuild.store import open_store\n"
            "from cachebuild.store.transfer import pull\n"
            "print(json.dumps(pull(open_store(), ['zz', 'ab' * 16]).as_dict()))")
    proc = python(code, env=env_for(tmp_path / "r2", server.url))
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.splitlines()[-1])
    assert counts["rejected"] == 1 and counts["missing"] == 1


# -- issue 25, 2: laundering ---------------------------------------------------------------


def test_an_artifact_pulled_unsigned_stays_marked_and_push_all_will_not_sign_it(open_local, tmp_path, server):
    untrusted = server.url[:-1] + "1"  # another database: a remote the fleet does not trust
    planted = new_key()
    with pytest.warns(UserWarning, match="without a signing key"):
        attacker = TieredStore(open_local(tmp_path / "attacker"), RedisRemote(untrusted),
                               allow_unsigned=True)
    attacker.put(planted, b"whoever wrote to the untrusted remote", kind="target")
    l1 = tmp_path / "l1"
    keyless = clean_env(CACHEBUILD_DIR=str(l1), CACHEBUILD_REMOTE=untrusted,
                        CACHEBUILD_ALLOW_UNSIGNED="1")
    proc = python("from cachebuild.store import open_store\n"
                  f"print(open_store().get({planted!r}))", env=keyless)
    assert proc.returncode == 0 and "whoever wrote" in proc.stdout, proc.stderr[-2000:]
    # The machine also builds something of its own, before the fleet key is set.
    own = new_key()
    open_local(l1).put(own, b"built here", kind="target")
    # ls and verify say where the pulled one came from.
    local = clean_env(CACHEBUILD_DIR=str(l1))
    listed = {r["key"]: r for r in json.loads(cli("ls", "--json", env=local).stdout)}
    assert listed[planted]["unsigned_from"].startswith(f"remote {untrusted}")
    assert listed[own]["unsigned_from"] is None
    assert "entered unsigned from" in cli("ls", env=local).stdout
    checked = cli("verify", env=local)
    assert checked.returncode == 0 and f"unsigned {planted}: entered this store" in checked.stderr
    # With the fleet key, push --all signs what was built here but not what was pulled.
    fleet = env_for(l1, server.url)
    pushed = cli("push", "--all", env=fleet)
    assert pushed.returncode == 1, pushed.stdout + pushed.stderr
    assert f"not pushed {planted}: it entered the local store unsigned" in pushed.stderr
    assert "pushed 1 " in pushed.stdout
    got = read(tmp_path / "server", server.url, [planted, own])
    assert got[planted]["present"] is False and got[own]["data"] == "built here"
    # Named with --vouch it is signed and pushed, and stays marked where it lands.
    vouched = cli("push", "--vouch", planted, env=fleet)
    assert vouched.returncode == 0, vouched.stdout + vouched.stderr
    assert json.loads(server.client().get(record_key(planted)))["record"][
        "unsigned_from"].startswith(f"remote {untrusted}")
    again = tmp_path / "again"
    assert read(again, server.url, [planted])[planted]["present"] is True
    assert open_local(again, signing_key=KEY.encode()).get_record(planted).unsigned_from


def test_a_bundle_is_the_source_of_what_no_key_verified(open_local, tmp_path):
    keyless = open_local(tmp_path / "keyless")
    k = new_key()
    keyless.put(k, b"pulled from somewhere", kind="target", unsigned_from="remote redis://x/0")
    built = new_key()
    keyless.put(built, b"built on the keyless machine", kind="target")
    keyless.close()
    bundle = tmp_path / "b.tar"
    assert cli("export", str(bundle), env=clean_env(CACHEBUILD_DIR=str(tmp_path / "keyless"))
               ).returncode == 0
    dest = tmp_path / "fleet"
    proc = cli("import", str(bundle), "--allow-unsigned",
               env=clean_env(CACHEBUILD_DIR=str(dest), CACHEBUILD_SIGNING_KEY=KEY))
    assert proc.returncode == 0, proc.stderr
    store = open_local(dest, signing_key=KEY.encode())
    # The source is the bundle file imported, whatever its records say: a name written in
    # a bundle would let it borrow another source's trust.
    from cachebuild.store import bundle_source

    assert store.get_record(k).unsigned_from == bundle_source(bundle)
    assert store.get_record(built).unsigned_from == bundle_source(bundle)


# -- issue 25, 4: bounds on totals ---------------------------------------------------------

SHARED = r"""
import json, resource
from cachebuild.store import open_store

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
records = list(open_store().records(shared=True))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"records": len(records), "grew_kib": after - before}))
"""


def test_records_one_command_reads_are_bounded_in_total(open_local, tmp_path, server):
    from cachebuild.store.remote import MAX_SHARED_RECORD_BYTES

    # A keyless writer adds well-formed records, each within the per-record cap.
    with pytest.warns(UserWarning, match="without a signing key"):
        w = TieredStore(open_local(tmp_path / "w"), RedisRemote(server.url),
                        allow_unsigned=True)
    big = "m" * (12 << 20)
    for i in range(8):  # 96 MiB of records
        w.put(new_key(), b"x", kind="target", manifest={"graph": big, "i": i})
    env = clean_env(CACHEBUILD_DIR=str(tmp_path / "r"), CACHEBUILD_REMOTE=server.url,
                    CACHEBUILD_ALLOW_UNSIGNED="1")
    proc = python(SHARED, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["records"] == MAX_SHARED_RECORD_BYTES // (12 << 20)
    assert out["grew_kib"] < 80 << 10, out  # what all of them would take, read and parsed
    assert "left the rest out" in proc.stderr


def test_junk_chunks_are_refused_before_the_rest_is_downloaded(tmp_path, server):
    w = writer(tmp_path / "w", server.url)
    huge, many = new_key(), new_key()
    for k in (huge, many):
        w.put(k, b"small", kind="target")
    client = server.client()
    # One chunk longer than any writer makes, with a record that agrees with it.
    client.setrange(chunk_key(huge, 0), (64 << 20) - 1, b"!")
    doc = doc_of(server, huge)
    doc.update(length=64 << 20, xxh3_128="0" * 32)
    set_doc(server, huge, doc)
    # Eight chunks of 8 MiB, each within bounds, whose first holds no blob header.
    client.delete(chunk_key(many, 0))
    for i in range(8):
        client.setrange(chunk_key(many, i), (8 << 20) - 1, b"!")
    doc = doc_of(server, many)
    doc.update(length=64 << 20, chunks=8, xxh3_128="0" * 32)
    set_doc(server, many, doc)
    proc = python(MEMORY, json.dumps([huge, many]), env=env_for(tmp_path / "r", server.url))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["misses"] == [True, True]
    assert out["grew_kib"] < 32 << 10, out  # one 8 MiB chunk, not 64 MiB of them
    assert "not a cachebuild blob" in proc.stderr


# -- issue 25, 5: lock squatting -----------------------------------------------------------

SQUAT = r"""
import sys, time
import redis
client = redis.Redis.from_url(sys.argv[1])
name, value = sys.argv[2], sys.argv[3]
print("squatting", flush=True)
while True:  # a keyless writer that keeps the lock alive, as a holder would
    client.set(name, value, px=3000)
    time.sleep(0.2)
"""


def squatter(server, key: str, value: str):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", SQUAT, server.url, lock_key(key), value],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "squatting"
    return proc


@pytest.mark.parametrize("signed", [True, False])
def test_a_lock_held_by_someone_who_cannot_prove_to_be_a_builder_does_not_stop_a_build(
        open_local, tmp_path, server, signed):
    k = new_key()
    # With a key: a token without the fleet's HMAC, or a builder's real token copied
    # after it was made (it proves nothing once it is old).
    from cachebuild.store.redis_lock import lock_token

    copied = lock_token(lock_key(k), "a" * 32, KEY.encode(), now_ms=1_000)
    squat = squatter(server, k, copied if signed else "not a builder")
    try:
        env = env_for(tmp_path / "r", server.url) if signed else clean_env(
            CACHEBUILD_DIR=str(tmp_path / "r"), CACHEBUILD_REMOTE=server.url,
            CACHEBUILD_ALLOW_UNSIGNED="1")
        # A builder with the default lock lifetime and timeout: it waits briefly (two
        # seconds with a key, one lock lifetime without: 1 s here), never 600 s.
        ttl = "60.0" if signed else "1.0"
        proc = python(LOCK.replace("lock_ttl=1.0", f"lock_ttl={ttl}"), k, env=env, timeout=120)
    finally:
        squat.kill()
        squat.wait()
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "cannot prove to be a builder of this fleet" in proc.stderr
    assert open_local(tmp_path / "r", signing_key=KEY.encode() if signed else None).get(k) \
        == b"built locally"


def test_builders_of_the_fleet_still_wait_for_each_other(tmp_path, server):
    from cachebuild.store.redis_lock import RemoteLock
    from cachebuild.store.remote import RedisRemote

    k = new_key()
    clock = ManualClock()
    held = RemoteLock(RedisRemote(server.url), k, lock_key(k), ttl=0.6,
                      signing_key=KEY.encode(), clock=clock)
    assert held.acquire(timeout=None)
    try:
        value = server.client().get(lock_key(k))
        clock.advance(0.2)
        assert held.renew()  # a fresh token under the same lock
        assert server.client().get(lock_key(k)) != value
        other = RedisRemote(server.url, clock=clock)
        with pytest.raises(LockTimeout):  # a proven holder is waited on, not overridden
            with other.lock(k, ttl=0.6, timeout=1.0, signing_key=KEY.encode()):
                pass
    finally:
        held.release()
    assert not server.client().exists(lock_key(k))


def test_a_signature_or_lock_value_in_other_than_ascii_is_refused_not_raised():
    """Text from Redis that is no signature (found by the fuzzer: non-ASCII characters)
    made ``hmac.compare_digest`` raise TypeError, which a server's start met as a
    traceback: it is simply not authentic."""
    import time

    from cachebuild.store.redis_lock import lock_token, proven
    from cachebuild.store.signing import SIGNATURE, record_signed_by, sign_record

    key = b"k" * 32
    shared = {"kind": "target", "size": 1}
    good = {**shared, SIGNATURE: sign_record(key, shared)}
    assert record_signed_by(key, good)
    assert not record_signed_by(key, {**shared, SIGNATURE: "é" * 64})
    now = time.time()
    token = lock_token("name", "nonce", key, int(now * 1000))
    assert proven("name", token, key, 60, now)
    assert not proven("name", "nonce.١٢٣.é", key, 60, now)
