"""Stored KV is bound to its key. What someone who can write the disk store (its files and its
SQLite index) or the Redis does to a key's blob -- re-point the key at another key's blob,
overwrite the blob with another key's bytes, swap two blob files, replay an old blob of the
same key or an older version of a rewritten record, truncate it, leave an unsealed blob where
blobs are sealed -- is refused (counted by reason, logged once) and read as a miss (the block
is recomputed), on both tiers, through ``get_many`` and ``read_into``. The blobs context
windows share on purpose (a link of the same content without encryption, a re-seal per key
with it) still read back, and a thaw does not re-seal a swapped block for a new key."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch
from window_helpers import BS, block, block_keys, contents, converse

from cwm_plugin.connector import records
from cwm_plugin.errors import NotFound, RefusedBlob
from cwm_plugin.store.blob import codec, container
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.windows.engine import WindowEngine, WindowIncomplete
from cwm_plugin.windows.model import manifest_key

G = bytes(range(16)) + b"\x00\x00"       # a namespace digest, TP rank 0
RANK1 = bytes(range(16)) + b"\x00\x01"   # the same namespace, rank 1
MASTER = "44" * 32
SALT = "tenant-salt"
SHAPE = (2, 3, 16, 32)
TIERS = [pytest.param("disk", marks=pytest.mark.unit),
         pytest.param("redis", marks=pytest.mark.redis)]


def key(name: str, group: bytes = G) -> bytes:
    return group + hashlib.sha256(name.encode()).digest()


def content(name: str) -> bytes:
    """A block's content identity (in real stores: its tokens' unsalted hash chain)."""
    return hashlib.sha256(b"content:" + name.encode()).digest()


@dataclass
class Place:
    """One durable tier holding the blocks, and raw access to its bytes and index: what an
    attacker who can write the store uses (files, SQL, Redis commands), not the tier's code."""

    tier: str
    make: Callable[..., KVStore]
    root: Path
    url: str | None = None

    def open(self, **kw) -> KVStore:
        if self.tier == "disk":
            return self.make(disk_path=str(self.root), memory_bytes=0, **kw)
        return self.make(redis_url=self.url, redis_write="through", memory_bytes=0, **kw)

    def blob_of(self, store: KVStore, k: bytes) -> str:
        return getattr(store, self.tier).lookup_many([k])[0]

    def read(self, store: KVStore, k: bytes) -> bytes:
        return getattr(store, self.tier).get(self.blob_of(store, k))

    def overwrite(self, store: KVStore, k: bytes, data: bytes) -> None:
        """Put ``data`` where ``k``'s blob is (its index entry left as it is)."""
        blob_id = self.blob_of(store, k)
        if self.tier == "disk":
            path = store.disk.path(blob_id)
            tmp = path.with_suffix(".planted")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        else:
            self._redis().set(f"cwm:{{b:{blob_id}}}", data)

    def repoint(self, k: bytes, blob_id: str) -> None:
        """Point ``k`` at ``blob_id`` in the index."""
        if self.tier == "disk":
            with contextlib.closing(sqlite3.connect(self.root / "index.sqlite", timeout=30)) \
                    as db, db:
                assert db.execute("UPDATE keys SET blob_id = ? WHERE key = ?",
                                  (blob_id, k)).rowcount == 1
        else:      # the string holding the key's blob id (its name spells the key in hex)
            r = self._redis()
            names = [n for n in r.scan_iter(match="cwm:*:k:*")
                     if k[:18].hex().encode() in n and n.endswith(k[18:].hex().encode())]
            assert len(names) == 1
            r.set(names[0], blob_id)

    def _redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@pytest.fixture(params=TIERS)
def place(request, make_store, tmp_path) -> Place:
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else None
    return Place(request.param, make_store, tmp_path / "d", url)


def refused(store: KVStore, reason: str) -> float:
    return store.metrics.errors.labels(f"refused_{reason}")._value.get()


def read_into(store: KVStore, keys: list[bytes], salt: str | None,
              ids: list[bytes] | None = None) -> list[str | None]:
    got: list[int] = []
    served = store.read_into(keys, lambda i, t: got.append(i) or True, shape=SHAPE,
                             dtype=torch.bfloat16, salt=salt, contents=ids)
    assert got == [i for i, s in enumerate(served) if s is not None]
    return served


def assert_refused(store: KVStore, k: bytes, salt: str | None, reason: str,
                   caplog: pytest.LogCaptureFixture, expected: bytes | None = None) -> None:
    """``k`` reads as a miss (twice through get, once through read_into; the last two
    expecting the content ``expected`` as the connector does), each read counted under
    ``reason``, logged once, nothing raised."""
    before = refused(store, reason)
    ids = None if expected is None else [expected]
    with caplog.at_level(logging.WARNING):
        assert store.get(k, salt=salt) is None
        assert store.get_many([k], salt=salt, contents=ids) == [None]
        assert read_into(store, [k], salt, ids) == [None]
    assert refused(store, reason) - before == 3
    assert sum("refused blob" in r.getMessage() for r in caplog.records) == 1
    assert reason in caplog.text


@pytest.mark.parametrize("encrypted", [False, True])
@pytest.mark.parametrize("how", ["repoint", "overwrite"])
@pytest.mark.parametrize("b_group", [G, RANK1], ids=["same_group", "other_rank"])
def test_another_keys_blob_is_refused(place, kv_block, caplog, encrypted, how, b_group):
    """Key A re-pointed at key B's blob, or A's blob overwritten with B's bytes: B of A's own
    group (and salt: only the key, or without encryption the content, tells them apart) or of
    another rank."""
    s = place.open(encryption_key=MASTER if encrypted else None)
    salt = SALT if encrypted else None
    a, b = key("a"), key("b", b_group)
    s.put(a, kv_block(1), salt=salt, content=content("a")).result()
    s.put(b, kv_block(2), salt=salt, content=content("b")).result()
    if how == "repoint":
        place.repoint(a, place.blob_of(s, b))
    else:
        place.overwrite(s, a, place.read(s, b))
    assert_refused(s, a, salt, "foreign_key" if b_group == G else "foreign_group", caplog,
                   expected=content("a"))
    assert s.metrics.errors.labels("corrupt")._value.get() == 0
    assert torch.equal(s.get(b, salt=salt), kv_block(2))       # B's blob is left alone
    assert s.contains_many([a]) == [True]   # not dropped: the bytes may be another key's


def test_two_swapped_blob_files_of_a_window_are_refused(place):
    """The blobs of blocks 0 and 1 swapped on disk (in Redis) under a window that shares them
    with its session, without encryption: every key of either block -- the session's own,
    the window's, a thawed session's -- reads a miss, not the other block's KV."""
    s = place.open()
    tokens = converse(s, "salt-a", 2 * BS)
    eng = WindowEngine(s, wait_s=0)
    eng.freeze("t1", "w", session="a", salt="salt-a")
    eng.thaw("t1", "w", session="b", salt="salt-b")
    ids = contents(tokens, 2)
    for salt in ("salt-a", "salt-b"):             # before: each key reads its own block
        got = s.get_many(block_keys(tokens, salt, 2)[0], contents=ids)
        assert [torch.equal(t, block(i, 0)) for i, t in enumerate(got)] == [True, True]
    a0, a1 = block_keys(tokens, "salt-a", 2)[0]
    first, second = place.read(s, a0), place.read(s, a1)
    place.overwrite(s, a0, second)
    place.overwrite(s, a1, first)
    for salt in ("salt-a", "salt-b"):
        keys = block_keys(tokens, salt, 2)[0]
        before = refused(s, "foreign_key")
        assert s.get_many(keys, contents=ids) == [None, None]
        assert read_into(s, keys, None, ids) == [None, None]
        assert refused(s, "foreign_key") - before == 4
    assert s.metrics.errors.labels("corrupt")._value.get() == 0


@pytest.mark.parametrize("encrypted", [False, True])
def test_an_older_version_of_a_rewritten_record_is_refused(place, caplog, encrypted):
    """A context record rewritten under its key, and its older version written back where the
    new one is: refused as replayed by a process that read or wrote the newer one (with
    encryption the revision is sealed with it, so no one can make an old version look new)."""
    s = place.open(encryption_key=MASTER if encrypted else None)
    rec = records.context_record_key(SALT)
    s.put(rec, records.json_tensor({"turn": 1}), salt=SALT, replace=True).result()
    then = place.read(s, rec)
    s.put(rec, records.json_tensor({"turn": 2}), salt=SALT, replace=True).result()
    assert records.tensor_json(s.get(rec, salt=SALT)) == {"turn": 2}
    place.overwrite(s, rec, then)
    assert_refused(s, rec, SALT, "replayed", caplog)
    reader = place.open(encryption_key=MASTER if encrypted else None)   # another process
    assert records.tensor_json(reader.get(rec, salt=SALT)) == {"turn": 1}  # never saw turn 2


def test_an_older_sealed_window_manifest_is_refused(place):
    """A window's manifest rewritten (its description patched), the older sealed version
    written back: the window reads as missing rather than as it was."""
    s = place.open(encryption_key=MASTER)
    converse(s, "salt-a", 2 * BS)
    eng = WindowEngine(s, wait_s=0)
    eng.freeze("t1", "w", session="a", salt="salt-a", description="before")
    mkey = manifest_key("t1", "w")
    then = place.read(s, mkey)
    eng.patch("t1", "w", description="after")
    assert eng.get("t1", "w").description == "after"
    place.overwrite(s, mkey, then)
    with pytest.raises(NotFound):
        eng.get("t1", "w")
    assert refused(s, "replayed") >= 1


@pytest.mark.parametrize("old", ["no_salt_for_the_empty_salt", "the_old_master_key"])
def test_a_replayed_old_blob_of_the_same_key_is_refused(place, kv_block, caplog, old):
    """The key's blob as it was before, written back over today's: sealed for the same key
    under no salt where the request has the empty salt (one HKDF key for both, before), or
    under the master key of before a rotation."""
    k = key("k")
    if old == "no_salt_for_the_empty_salt":
        s = place.open(encryption_key=MASTER)
        s.put(k, kv_block(1), salt=None).result()
        then = place.read(s, k)
        s.put(k, kv_block(2), salt="", replace=True).result()
        salt = ""
    else:
        before = place.open(encryption_key=MASTER)
        before.put(k, kv_block(1), salt=SALT).result()
        then = place.read(before, k)
        before.close()
        s = place.open(encryption_key="55" * 32)
        s.put(k, kv_block(2), salt=SALT, replace=True).result()
        salt = SALT
    assert torch.equal(s.get(k, salt=salt), kv_block(2))
    place.overwrite(s, k, then)
    assert container.peek(place.read(s, k))["key"] == k.hex()       # it names the right key
    assert_refused(s, k, salt, "foreign_salt", caplog)


@pytest.mark.parametrize("planted", ["saved_before_encryption", "written_over_a_sealed_blob"])
def test_a_plaintext_blob_where_blobs_are_sealed_is_refused(place, kv_block, caplog, planted):
    k = key("k")
    if planted == "saved_before_encryption":
        plain = place.open()
        plain.put(k, kv_block(1)).result()
        plain.close()
        s = place.open(encryption_key=MASTER)
    else:
        s = place.open(encryption_key=MASTER)
        s.put(k, kv_block(1), salt=SALT).result()
        place.overwrite(s, k, codec.encode(kv_block(3), key=k, fingerprint="test-fp"))
    assert_refused(s, k, SALT, "plaintext", caplog)


@pytest.mark.parametrize("encrypted", [False, True])
def test_a_truncated_blob_is_a_corrupt_miss_and_the_block_is_saved_again(place, kv_block,
                                                                         encrypted):
    s = place.open(encryption_key=MASTER if encrypted else None)
    salt = SALT if encrypted else None
    k = key("k")
    s.put(k, kv_block(1), salt=salt).result()
    data = place.read(s, k)
    place.overwrite(s, k, data[:len(data) // 2])
    assert read_into(s, [k], salt) == [None]
    assert s.metrics.errors.labels("corrupt")._value.get() == 1
    assert s.contains_many([k]) == [False]                  # quarantined: the key is free
    s.put(k, kv_block(1), salt=salt).result()                # recomputed, saved again
    assert torch.equal(s.get(k, salt=salt), kv_block(1))


@pytest.mark.unit
@pytest.mark.parametrize("encrypted", [False, True])
def test_put_blob_refuses_what_a_read_of_its_key_would_refuse(make_store, tmp_path, kv_block,
                                                              encrypted):
    """A copy to a new key (a window's re-key, an import) that is not sealed for that key fails
    loudly at the write instead of leaving a blob every read refuses."""
    s = make_store(disk_path=str(tmp_path / "d"), encryption_key=MASTER if encrypted else None)
    a, b = key("a"), key("b", G if encrypted else RANK1)
    s.put(a, kv_block(1), salt=SALT).result()
    with pytest.raises(RefusedBlob) as refusal:
        s.put_blob(b, s.get_blob(a))
    assert refusal.value.reason == ("foreign_key" if encrypted else "foreign_group")
    assert s.contains_many([b]) == [False]


@pytest.mark.parametrize("encrypted", [False, True])
def test_windows_shared_blobs_read_back_under_their_new_keys(place, encrypted):
    """Freeze, clone and thaw re-key a session's blocks: linked (one blob, keys of other block
    hashes) without encryption, re-sealed for each new key with it."""
    s = place.open(encryption_key=MASTER if encrypted else None)
    tokens = converse(s, "salt-a", 3 * BS)
    eng = WindowEngine(s, wait_s=0)
    eng.freeze("t1", "w", session="a", salt="salt-a")
    eng.clone("t1", "w", "w2")
    assert eng.thaw("t1", "w2", session="b", salt="salt-b").blocks == 3
    for rank, keys in enumerate(block_keys(tokens, "salt-b", 3)):
        got = s.get_many(keys, salt="salt-b", contents=contents(tokens, 3))
        assert all(torch.equal(t, block(i, rank)) for i, t in enumerate(got))
        if encrypted:                    # each copy is sealed for its own key
            assert [container.peek(place.read(s, k))["key"] for k in keys] == [k.hex() for k in keys]
        else:                            # the session's blob, shared
            assert place.blob_of(s, keys[0]) == place.blob_of(
                s, block_keys(tokens, "salt-a", 1)[rank][0])
    assert not [m for m in s.metrics.errors.collect()[0].samples
                if m.labels.get("kind", "").startswith("refused") and m.value]


def test_a_thaw_does_not_reseal_a_swapped_block_for_its_new_key(place):
    """A window's keys share its salt: block 0's key pointed at block 1's blob would open, and
    a thaw that trusted it would seal block 1's KV for the new session's block 0."""
    s = place.open(encryption_key=MASTER)
    tokens = converse(s, "salt-a", 2 * BS)
    eng = WindowEngine(s, wait_s=0)
    m = eng.freeze("t1", "w", session="a", salt="salt-a")
    wkeys = block_keys(tokens, m.window_salt, 2)[0]
    place.repoint(wkeys[0], place.blob_of(s, wkeys[1]))
    with pytest.raises(WindowIncomplete):
        eng.thaw("t1", "w", session="b", salt="salt-b")
    assert s.get_many(block_keys(tokens, "salt-b", 2)[0], salt="salt-b") == [None, None]
    assert refused(s, "foreign_key") >= 1


def test_a_block_saved_naming_no_content_still_reads_under_a_windows_key(place, kv_block):
    """Blocks saved before blocks named their content (a window frozen then) keep reading
    under the keys linked to them, bound per key group as they were."""
    s = place.open()
    a, w = key("a"), key("window-a")
    s.put(a, kv_block(1)).result()                       # no content in its header
    s.link_many([(w, a)])
    assert torch.equal(s.get(w, content=content("a")), kv_block(1))
    assert s.get(w) is None                               # a reader of no content: its own only
