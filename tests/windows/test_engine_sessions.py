"""Windows are the conversation, complete on every durable tier, bounded: the engine over a
real disk store and a real redis-server, with records laid out as the connector and the
sidecar leave them."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry
from window_helpers import BS, converse, session_blocks

from cwm_plugin.connector import records
from cwm_plugin.errors import AlreadyExists, InvalidInput, NotFound
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.store.tiers.base import QuotaExceeded
from cwm_plugin.windows.conversation import ConversationRecord, ConversationRecords
from cwm_plugin.windows.engine import WindowEngine, WindowIncomplete
from cwm_plugin.windows.model import manifest_key
from cwm_plugin.windows.rekey import BlockKeys

pytestmark = pytest.mark.unit
PROMPT = {"pinned": {"key": "k:0:full", "memory_block": "the user lives in Chur", "tokens": 6}}



def turn(store: KVStore, salt: str, n: int, tokens: int, keep: int = 8) -> list[int]:
    """Client turn ``n``: the connector's records and the sidecar's conversation record."""
    ids = converse(store, salt, tokens, turn=n, keep=keep, seed=0)
    msgs = [{"role": "user", "content": f"q{i}"} for i in range(n)]
    ConversationRecords(store, keep).write(salt, ConversationRecord(
        n, [*msgs, {"role": "assistant", "content": f"a{n}"}], PROMPT, "tiny")).result()
    return ids


def test_freeze_takes_the_latest_client_turn_or_an_earlier_one_with_its_conversation(store):
    eng = WindowEngine(store, wait_s=0, keep_turns=4)
    t2 = turn(store, "s", 2, 3 * BS, keep=4)
    t3 = turn(store, "s", 3, 4 * BS + 5, keep=4)
    latest = eng.freeze("acme", "now", session="a", salt="s")
    assert latest.turn == 3 and latest.tokens == t3 and latest.num_blocks == 4
    assert latest.messages[-1] == {"role": "assistant", "content": "a3"}
    assert latest.prompt == PROMPT and latest.public()["memory_merged"]
    earlier = eng.freeze("acme", "then", session="a", salt="s", turn=2)
    assert earlier.turn == 2 and earlier.tokens == t2
    assert len(earlier.messages) == 3
    with pytest.raises(NotFound, match="turn 9 of session 'a' is not kept"):
        eng.freeze("acme", "x", session="a", salt="s", turn=9)
    # thaw writes the target session's records: its next turn restores, and it can be frozen
    # again at once with the same tokens, conversation and prompt state
    r = eng.thaw("acme", "now", session="b", salt="t")
    assert r.prompt == PROMPT and r.turn == 3 and r.public()["blocks_found"] == 4
    again = eng.freeze("acme", "again", session="b", salt="t")
    assert again.tokens == t3 and again.turn == 3 and again.prompt == PROMPT
    assert again.messages == latest.messages
    assert all(b is not None for bs in session_blocks(store, t3, "t", 4) for b in bs)


def test_clear_session_erases_its_kv_and_records_but_not_its_windows(store):
    eng = WindowEngine(store, wait_s=0)
    ids = turn(store, "s", 1, 3 * BS)
    eng.freeze("acme", "keep", session="a", salt="s")
    assert eng.clear_session("s") > 0
    assert all(b is None for bs in session_blocks(store, ids, "s", 3) for b in bs)
    assert store.get(records.context_record_key("s"), salt="s") is None
    assert ConversationRecords(store).read("s", 1) is None
    with pytest.raises(NotFound):
        eng.freeze("acme", "gone", session="a", salt="s")
    eng.thaw("acme", "keep", session="b", salt="t")  # the window kept its blocks
    assert all(b is not None for bs in session_blocks(store, ids, "t", 3) for b in bs)


def test_ttl_patch_and_a_delete_racing_a_thaw(store):
    eng = WindowEngine(store, wait_s=0)
    turn(store, "s", 1, 2 * BS)
    m = eng.freeze("acme", "brief", session="a", salt="s", ttl_s=0.5, tags=["x"])
    assert m.expires and eng.list("acme")[1] == 1
    time.sleep(0.6)
    assert eng.list("acme")[1] == 0
    with pytest.raises(NotFound):
        eng.get("acme", "brief")
    eng.freeze("acme", "plan", session="a", salt="s", tags=["x"])
    eng.clone("acme", "plan", "plan-b")
    renamed = eng.patch("acme", "plan", new_name="trip", tags=["y", "z"], description="d")
    assert renamed.name == "trip" and renamed.tags == ["y", "z"]
    assert [w.name for w in eng.list("acme", tags=["y", "z"])[0]] == ["trip"]
    assert eng.status("acme", "plan-b")["lineage"] == ["trip"]     # the child follows
    with pytest.raises(NotFound):
        eng.get("acme", "plan")
    with pytest.raises(AlreadyExists):
        eng.patch("acme", "trip", new_name="plan-b")
    with pytest.raises(InvalidInput, match="cannot sort by"):
        eng.list("acme", sort="size_desc")
    assert eng.list("acme", sort="total_size_bytes")[1] == 2     # the tool's name for size
    # a thaw that read the manifest before a delete never brings it back
    m = eng.get("acme", "trip")
    eng.delete("acme", "trip")
    eng.catalog.note_thaw(m, {"session": "late"})
    store.flush()
    assert store.get(manifest_key("acme", "trip"), salt="cwm-window-manifest\0acme") is None
    with pytest.raises(NotFound):
        eng.catalog.rewrite(m)                   # a late rewrite is taken back, not left unpinned
    assert store.get(manifest_key("acme", "trip"), salt="cwm-window-manifest\0acme") is None


def test_one_tenants_windows_never_make_anothers_freeze_fail(store):
    turn(store, "s", 1, 3 * BS)
    size = WindowEngine(store).tenancy.stored_bytes(
        BlockKeys.keys(*_workers_and_hashes(store, "s")))
    eng = WindowEngine(store, wait_s=0, tenant_quota_bytes=int(size * 2.5))
    eng.freeze("acme", "w1", session="a", salt="s")
    eng.freeze("acme", "w2", session="a", salt="s")
    with pytest.raises(QuotaExceeded, match="tenant 'acme'"):
        eng.freeze("acme", "w3", session="a", salt="s")
    assert eng.list("acme")[1] == 2
    eng.freeze("beta", "w1", session="a", salt="s")       # another tenant is not charged
    eng.delete("acme", "w1")
    eng.freeze("acme", "w3", session="a", salt="s")       # freed room is usable again


def _workers_and_hashes(store: KVStore, salt: str) -> tuple[list, list[bytes]]:
    rec = records.ContextRecord.from_tensor(store.get(records.context_record_key(salt), salt=salt))
    return rec.workers, rec.hashes()


@pytest.mark.redis
def test_behind_mode_freeze_completes_every_durable_tier_or_says_what_is_missing(
        tmp_path, redis_server):
    cfg = {"disk_path": str(tmp_path / "kv"), "memory_bytes": 0,
           "redis_url": redis_server.url, "redis_write": "behind"}
    vllm_side = KVStore(StoreConfig(**cfg), registry=CollectorRegistry())
    # what vLLM's behind queue left: the blocks on disk, Redis without them (queue full, or
    # not written yet)
    ids = turn(vllm_side, "s", 1, 4 * BS)
    vllm_side.flush()
    workers, hashes = _workers_and_hashes(vllm_side, "s")
    keys = BlockKeys.keys(workers, hashes)
    vllm_side.redis.delete_many([k for ks in keys for k in ks])
    vllm_side.close()
    sidecar_side = KVStore(StoreConfig(**cfg), registry=CollectorRegistry())
    eng = WindowEngine(sidecar_side, wait_s=5, settle_s=0.2)
    m = eng.freeze("acme", "w", session="a", salt="s")
    st = eng.status("acme", "w")
    assert st["tiers"]["disk"]["complete"] and st["tiers"]["redis"]["complete"]
    assert st["tiers"]["redis"]["pinned"] == 2 * m.num_blocks and st["warnings"] == []
    # another server sharing only the Redis thaws all of it
    redis_only = KVStore(StoreConfig(memory_bytes=0, redis_url=redis_server.url),
                         registry=CollectorRegistry())
    r = WindowEngine(redis_only).thaw("acme", "w", session="b", salt="t")
    assert r.restorable_tokens == 4 * BS
    assert all(b is not None for bs in session_blocks(redis_only, ids, "t", 4) for b in bs)
    redis_only.close()
    # a durable tier that cannot take them: refused, naming what each tier holds
    redis_server.stop()
    with pytest.raises(WindowIncomplete, match=r"not on every durable tier \(disk holds 4, "
                                               r"redis holds 0\)"):
        WindowEngine(sidecar_side, wait_s=0.5, settle_s=0).freeze("acme", "w2", session="a",
                                                                  salt="s")
    sidecar_side.close()


def test_auto_checkpoints_keep_the_newest_per_session(store, monkeypatch):
    from cwm_plugin.windows import auto as auto_mod
    from cwm_plugin.windows.auto import AutoFreeze

    turn(store, "s", 1, 2 * BS)
    turn(store, "t", 1, 2 * BS)
    eng = WindowEngine(store, wait_s=0)
    af = AutoFreeze(eng, cooldown_s=0, keep=2)
    stamps = iter(f"2026112600000{i}" for i in range(9))
    monkeypatch.setattr(auto_mod.time, "strftime", lambda fmt: next(stamps))
    made = [af.freeze_now("acme", "a", "s", "test")]
    eng.clone("acme", made[0], "kept-by-the-user")      # a clone keeps the tag and session
    made += [af.freeze_now("acme", "a", "s", "test") for _ in range(3)]
    other = af.freeze_now("acme", "b", "t", "test")
    left = {w.name for w in eng.list("acme", tag="auto", limit=100)[0]}
    # the newest two of a, b's own and the user's clone untouched
    assert left == {made[2], made[3], other, "kept-by-the-user"}
