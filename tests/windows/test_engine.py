"""The window engine over a real store, with blocks and a context record laid out exactly as the
connector leaves them (vLLM's own hashing, per-worker keys); the vLLM end-to-end tests are in
test_windows_e2e.py."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import CollectorRegistry
from window_helpers import BS, NS, WORKERS, block, converse, session_blocks

from cwm_plugin.connector import records
from cwm_plugin.errors import AlreadyExists, InvalidInput, NotFound
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.store.tiers.base import QuotaExceeded
from cwm_plugin.windows import hashing
from cwm_plugin.windows.engine import ModelMismatch, WindowEngine, WindowIncomplete

pytestmark = pytest.mark.unit



def test_freeze_thaw_into_a_new_session_restores_every_rank(store):
    tokens = converse(store, "salt-a", 5 * BS + 3)
    eng = WindowEngine(store)
    m = eng.freeze("t1", "plan", session="a", salt="salt-a", tags=["x"],
                   messages=[{"role": "user", "content": "hi"}])
    assert m.num_blocks == 5 and m.public()["tokens"] == 5 * BS + 3
    assert "salt" not in str(m.public()) and "tokens" in m.public()
    r = eng.thaw("t1", "plan", session="b", salt="salt-b")
    assert r.restorable_tokens == 5 * BS and r.messages == [{"role": "user", "content": "hi"}]
    for rank, got in enumerate(session_blocks(store, tokens, "salt-b", 5)):
        assert all(torch.equal(t, block(i, rank)) for i, t in enumerate(got))
    # no tensor copy: the blocks, a's record, the manifest, b's record and the thaw note
    assert store.usage()["disk"]["blobs"] == 10 + 4
    assert eng.status("t1", "plan")["last_thaw"]["session"] == "b"
    # the thawed session has its record: it can be frozen again at once, with the same tokens
    again = eng.freeze("t1", "plan-again", session="b", salt="salt-b", wait_s=0)
    assert again.tokens == tokens and again.num_blocks == 5


def test_move_session_rekeys_a_sessions_latest_context_to_another_salt(tmp_path):
    """After a secret rotation (the sidecar's salt_move.py): the same blobs under the new salt's
    keys and a record for it (so a freeze finds it); memory and disk tiers; nothing to move is
    0."""
    s = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=1 << 20),
                registry=CollectorRegistry())
    try:
        tokens = converse(s, "old-salt", 4 * BS + 5)
        eng = WindowEngine(s, wait_s=0)
        blobs = s.usage()["disk"]["blobs"]
        assert eng.move_session("old-salt", "new-salt") == 4
        for rank, got in enumerate(session_blocks(s, tokens, "new-salt", 4)):
            assert all(torch.equal(t, block(i, rank)) for i, t in enumerate(got))
        assert s.usage()["disk"]["blobs"] == blobs + 1      # no tensor copy: + the record
        assert eng.move_session("old-salt", "new-salt") == 0  # the new salt has its record
        assert eng.move_session("no-such-salt", "other") == 0
    finally:
        s.close()
    disk = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0),
                   registry=CollectorRegistry())
    try:  # on disk for the next process: its record and blocks freeze as a session's
        m = WindowEngine(disk, wait_s=0).freeze("t1", "w", session="x", salt="new-salt")
        assert m.num_blocks == 4 and m.tokens == tokens
    finally:
        disk.close()


def test_a_window_in_memory_and_on_disk_thaws_whole(tmp_path):
    """Blocks a faster tier holds too are still on the durable one: all restorable."""
    s = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=1 << 20),
                registry=CollectorRegistry())
    try:
        converse(s, "s", 3 * BS)
        eng = WindowEngine(s, wait_s=0)
        eng.freeze("t1", "w", session="a", salt="s")
        assert set(s.where_many([k for ks in eng.window_keys(eng.get("t1", "w"))
                                 for k in ks])) == {"memory"}
        assert eng.status("t1", "w")["restorable_blocks"] == 3
        assert eng.thaw("t1", "w", session="b", salt="salt-b").restorable_tokens == 3 * BS
        assert eng.clone("t1", "w", "w2").num_blocks == 3
    finally:
        s.close()


def test_a_window_survives_its_session_being_evicted_and_clones_survive_the_parent(store):
    tokens = converse(store, "s", 3 * BS)
    eng = WindowEngine(store)
    eng.freeze("t1", "w", session="a", salt="s")
    eng.clone("t1", "w", "w2")
    eng.clone("t1", "w", "w3")
    for ks in [[bytes.fromhex(d) + r.to_bytes(2, "big") + h for h in hashing.chain(
            tokens, salt="s", block_size=BS, hash_block_size=BS, hash_algo="sha256",
            lora=None, num_blocks=3)] for d, r in WORKERS]:
        store.delete_many(ks)                              # the session's cache went
    eng.delete("t1", "w")                                  # and the parent
    assert eng.status("t1", "w2")["restorable_tokens"] == 3 * BS
    eng.thaw("t1", "w2", session="c", salt="salt-c")
    assert all(t is not None for ts in session_blocks(store, tokens, "salt-c", 3) for t in ts)
    st = eng.status("t1", "w3")
    assert st["parent"] == "w" and st["tiers"]["disk"]["pinned"] == 6
    assert st["compression_ratio"] and st["raw_bytes"] == 6 * 2 * 2 * 1 * 8 * BS * 4
    eng.delete("t1", "w2")
    eng.delete("t1", "w3")
    # session c's keys still use them (+ the records of sessions s and c)
    assert store.usage()["disk"]["blobs"] == 6 + 2
    store.delete_many([k.key for ks in store.list_keys().values() for k in ks])
    assert store.usage()["disk"]["blobs"] == 0              # last reference gone: freed


def test_errors_are_clear_and_tenants_never_see_each_other(store):
    converse(store, "s", 2 * BS)
    eng = WindowEngine(store, wait_s=0)
    eng.freeze("t1", "w", session="a", salt="s")
    with pytest.raises(AlreadyExists):
        eng.freeze("t1", "w", session="a", salt="s")
    with pytest.raises(InvalidInput, match="invalid window name"):
        eng.freeze("t1", "../etc/passwd", session="a", salt="s")
    with pytest.raises(NotFound, match="no saved context"):
        eng.freeze("t1", "w9", session="zz", salt="unknown-salt")
    for op in (lambda: eng.thaw("t2", "w", session="x", salt="y"),
               lambda: eng.clone("t2", "w", "mine"), lambda: eng.delete("t2", "w"),
               lambda: eng.status("t2", "w")):
        with pytest.raises(NotFound, match="no window named 'w'"):
            op()
    assert eng.list("t2") == ([], 0) and [m.name for m in eng.list("t1")[0]] == ["w"]
    with pytest.raises(ModelMismatch, match="frozen on model 'tiny'"):
        eng.thaw("t1", "w", session="b", salt="b", model="other-model")


def test_missing_blocks_refuse_freeze_and_say_what_is_restorable(store):
    tokens = converse(store, "s", 4 * BS)
    hs = hashing.chain(tokens, salt="s", block_size=BS, hash_block_size=BS,
                       hash_algo="sha256", lora=None, num_blocks=4)
    store.delete_many([bytes.fromhex(WORKERS[1][0]) + (1).to_bytes(2, "big") + hs[2]])
    with pytest.raises(WindowIncomplete, match="2 of 4 blocks .* 32 of 64 tokens are restorable"):
        WindowEngine(store, wait_s=0.3).freeze("t1", "w", session="a", salt="s")
    assert WindowEngine(store).list("t1")[1] == 0 and store.usage()["disk"]["keys"] == 7 + 1


def test_the_pin_quota_refuses_and_leaves_nothing_behind(tmp_path):
    store = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0,
                                pin_quota_bytes=1000), registry=CollectorRegistry())
    try:
        converse(store, "s", 3 * BS)
        keys_before = store.usage()["disk"]["keys"]
        with pytest.raises(QuotaExceeded, match="quota"):
            WindowEngine(store).freeze("t1", "w", session="a", salt="s")
        assert store.usage()["disk"]["keys"] == keys_before
        assert WindowEngine(store).list("t1")[1] == 0
    finally:
        store.close()


def test_a_block_evicted_between_re_key_and_pin_refuses_the_freeze(store, monkeypatch):
    """The pin step reports what it pinned: a window claimed with a hole would thaw only a
    prefix. It is refused, leaving nothing behind, and a retry succeeds."""
    converse(store, "s", 3 * BS)
    keys_before = store.usage()["disk"]["keys"]
    real = store.pin_many

    def evicting(keys, **kw):  # (another process's eviction got to one key first)
        store.delete_many([keys[-1]])
        return real(keys, **kw)

    monkeypatch.setattr(store, "pin_many", evicting)
    with pytest.raises(WindowIncomplete, match="1 blocks were evicted while being pinned"):
        WindowEngine(store).freeze("t1", "w", session="a", salt="s")
    assert store.usage()["disk"]["keys"] == keys_before
    assert WindowEngine(store).list("t1")[1] == 0
    monkeypatch.undo()
    assert WindowEngine(store).freeze("t1", "w", session="a", salt="s").num_blocks == 3


def test_an_eviction_never_takes_a_blob_pinned_after_it_was_chosen(tmp_path):
    """Eviction chooses its victims, then removes them: a pin committed in between (the
    sidecar freezing a window is another process) keeps its blob and keys."""
    from cwm_plugin.store.tiers.disk.tier import DiskTier

    d = DiskTier(tmp_path, budget=1 << 20)
    for i in range(3):
        d.put(f"{i:040x}", b"x" * 100, bytes([i]) * 8)
    victims = [b for b, _ in d.index.eviction_candidates(300)]
    assert len(victims) == 3
    d.pin_many([bytes([1]) * 8])
    dropped = d.index.remove_blobs(victims, unlink=d._unlink, unpinned_only=True)
    assert sorted(dropped) == [bytes([0]) * 8, bytes([2]) * 8]
    assert d.lookup_many([bytes([1]) * 8]) == [f"{1:040x}"] and d.get(f"{1:040x}") == b"x" * 100
    d.close()


def test_two_freezes_of_one_name_at_once_one_wins(store):
    converse(store, "s", 2 * BS)
    results: list[object] = []

    def freeze() -> None:
        try:
            results.append(WindowEngine(store).freeze("t1", "same", session="a", salt="s"))
        except AlreadyExists as exc:
            results.append(exc)
    threads = [threading.Thread(target=freeze) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(isinstance(r, AlreadyExists) for r in results) == 3
    assert WindowEngine(store).status("t1", "same")["tiers"]["disk"]["pinned"] == 4
    assert store.usage()["disk"]["keys"] == 4 + 4 + 1 + 1   # session, window, record, manifest


def test_hashing_elsewhere_is_caught_before_any_key_is_made(store, monkeypatch):
    converse(store, "s", 2 * BS)
    monkeypatch.setattr(hashing, "chain", lambda *a, **k: [bytes(32), bytes(32)])
    with pytest.raises(hashing.HashingMismatch, match="PYTHONHASHSEED"):
        WindowEngine(store).freeze("t1", "w", session="a", salt="s")


def test_list_filters_sorts_and_pages(store):
    converse(store, "s", 2 * BS)
    eng = WindowEngine(store)
    for i, tag in enumerate(["a", "b", "a"]):
        eng.freeze("t1", f"w{i}", session="a", salt="s", tags=[tag], description=f"plan {i}")
    page, total = eng.list("t1", tag="a", sort="name", descending=False)
    assert [m.name for m in page] == ["w0", "w2"] and total == 2
    assert [m.name for m in eng.list("t1", text="PLAN 1")[0]] == ["w1"]
    assert [m.name for m in eng.list("t1", sort="name", limit=1, offset=1)[0]] == ["w1"]


def test_eviction_pressure_never_takes_a_windows_blocks_or_manifest(tmp_path):
    store = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0,
                                disk_bytes=60_000, pin_quota_bytes=30_000),
                    registry=CollectorRegistry())
    try:
        tokens = converse(store, "s", 3 * BS)
        eng = WindowEngine(store)
        eng.freeze("t1", "w", session="a", salt="s")
        for i in range(40):                                  # other sessions' blocks
            store.put(b"F" * 18 + i.to_bytes(4, "big"),
                      torch.randn(2, 1, BS, 16, generator=torch.Generator().manual_seed(i))
                      ).result()
        assert store.metrics.evictions.labels("disk")._value.get() > 0
        assert eng.status("t1", "w")["restorable_tokens"] == 3 * BS
        eng.thaw("t1", "w", session="b", salt="b")
        assert all(t is not None for ts in session_blocks(store, tokens, "b", 3) for t in ts)
    finally:
        store.close()


def test_a_window_that_lost_blocks_thaws_only_its_intact_prefix(store):
    tokens = converse(store, "s", 4 * BS)
    eng = WindowEngine(store)
    m = eng.freeze("t1", "w", session="a", salt="s")
    lost = bytes.fromhex(m.workers[1][0]) + (1).to_bytes(2, "big") + \
        bytes.fromhex(m.window_hashes[2])
    store.unpin_many([lost])
    store.delete_many([lost])                       # as a failing disk or an operator would
    st = eng.status("t1", "w")
    assert st["restorable_tokens"] == 2 * BS and st["restorable_blocks"] == 2
    r = eng.thaw("t1", "w", session="b", salt="b")
    assert r.restorable_tokens == 2 * BS and r.blocks == 2
    got = session_blocks(store, tokens, "b", 4)
    assert [t is not None for t in got[0]] == [True, True, False, False]   # never past a gap
    with pytest.raises(WindowIncomplete, match="2 of its 4 blocks"):
        eng.clone("t1", "w", "w2")


def test_a_thaw_for_another_engine_names_what_differs(store):
    converse(store, "s", 2 * BS)
    eng = WindowEngine(store)
    eng.freeze("t1", "w", session="a", salt="s")
    served = {**NS, "hf_overrides": '{"rope_theta": 20000}'}
    store.put(records.served_key("tiny"), records.json_tensor({"namespace": served}),
              replace=True).result()
    with pytest.raises(ModelMismatch, match="hf_overrides"):
        eng.thaw("t1", "w", session="b", salt="b", model="tiny")
    store.put(records.served_key("tiny"), records.json_tensor({"namespace": NS}),
              replace=True).result()
    assert eng.thaw("t1", "w", session="b", salt="b", model="tiny").blocks == 2


def test_with_encryption_at_rest_windows_reseal_for_each_salt(tmp_path):
    store = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0,
                                encryption_key="22" * 32), registry=CollectorRegistry())
    try:
        tokens = converse(store, "salt-a", 3 * BS)
        eng = WindowEngine(store)
        eng.freeze("t1", "w", session="a", salt="salt-a")
        eng.clone("t1", "w", "w2")
        eng.thaw("t1", "w2", session="b", salt="salt-b")
        hs = hashing.chain(tokens, salt="salt-b", block_size=BS, hash_block_size=BS,
                           hash_algo="sha256", lora=None, num_blocks=3)
        for d, rank in WORKERS:
            keys = [bytes.fromhex(d) + rank.to_bytes(2, "big") + h for h in hs]
            got = store.get_many(keys, salt="salt-b")          # opens under b's salt only
            assert all(torch.equal(t, block(i, rank)) for i, t in enumerate(got))
            assert store.get_many(keys, salt="salt-a") == [None] * 3
        eng.delete("t1", "w")
        assert eng.status("t1", "w2")["restorable_tokens"] == 3 * BS
    finally:
        store.close()
