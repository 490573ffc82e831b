"""Context windows through a real ``vllm serve`` (tiny model: token identity is strict).

A 3-turn conversation is frozen, vLLM restarted, the window thawed into a new session and the
conversation continued: the answer equals the same request recomputed cold under a fresh salt,
and vLLM's external hits show the frozen prefix was restored. Clones branch without disturbing
each other, survive their parent, and eviction pressure never takes a window's blocks. A window
frozen on one server thaws on another through a shared Redis.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry
from test_connector import HITS, long_text, serve

from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.testing.vllm_server import start_all
from cwm_plugin.windows.engine import WindowEngine

pytestmark = pytest.mark.e2e
SYSTEM = {"role": "system", "content": "You are a careful assistant."}


def ask(server, messages: list[dict], salt: str, max_tokens: int = 12,
        **cwm: float) -> tuple[str, list[int]]:
    kw = {"kv_transfer_params": {"cwm": cwm}} if cwm else {}
    out = server.chat(messages, max_tokens=max_tokens, return_token_ids=True, cache_salt=salt,
                      **kw)
    choice = out["choices"][0]
    return choice["message"]["content"], choice["token_ids"]


def conversation(server, salt: str) -> tuple[list[dict], dict[int, float]]:
    """Three turns under ``salt``, each telling the connector when it arrived, as the sidecar
    does: the history a client would hold afterwards, and {turn: arrival} for a freeze to
    wait for (a turn's record is written after its reply, when its blocks are saved: a
    freeze the moment the reply is in found no record yet on a slow machine)."""
    msgs, arrivals = [SYSTEM], {}
    for turn in (1, 2, 3):
        msgs.append({"role": "user", "content": long_text(69 + turn, 160)})
        arrivals[turn] = time.time()
        text, _ = ask(server, msgs, salt, turn=turn, at=arrivals[turn])
        msgs.append({"role": "assistant", "content": text})
    return msgs, arrivals


def engine_on(settings: dict) -> WindowEngine:
    return WindowEngine(KVStore(StoreConfig(**{**settings, "memory_bytes": 0}),
                                registry=CollectorRegistry()))


def test_freeze_restart_thaw_clone_and_branches_restore_exactly(tiny_model, vllm_factory,
                                                                tmp_path):
    # a disk budget small enough that the flood below must evict (~430 KB a block)
    store = {"disk_path": str(tmp_path / "store"), "disk_bytes": 24 << 20,
             "pin_quota_bytes": 20 << 20}
    server = serve(vllm_factory, tiny_model, store, env={"VLLM_SERVER_DEV_MODE": "1"}).start()
    history, arrivals = conversation(server, "salt-alice")
    eng = engine_on(store)
    window = eng.freeze("acme", "trip", session="alice", salt="salt-alice",
                        messages=history, coming=arrivals)
    assert window.pinned_tokens >= 3 * 128

    server.restart()
    turn4 = [*history, {"role": "user", "content": "And what should we pack?"}]
    expected = ask(server, turn4, "fresh-salt-1")               # recomputed cold
    assert server.metric(HITS) == 0
    thawed = eng.thaw("acme", "trip", session="bob", salt="salt-bob")
    assert thawed.restorable_tokens == window.pinned_tokens and thawed.messages == history
    assert ask(server, turn4, "salt-bob") == expected           # token-identical ...
    hits = server.metric(HITS)
    assert hits >= 3 * 128 and hits <= window.pinned_tokens     # ... from the frozen prefix

    # Two branches with different continuations; neither disturbs the other.
    eng.clone("acme", "trip", "trip-b")
    eng.thaw("acme", "trip", session="carol", salt="salt-carol")
    eng.thaw("acme", "trip-b", session="dave", salt="salt-dave")
    branch_c = [*history, {"role": "user", "content": "Tell me about the river."}]
    branch_d = [*history, {"role": "user", "content": "Tell me about the mountain."}]
    want_c, want_d = ask(server, branch_c, "fresh-2"), ask(server, branch_d, "fresh-3")
    before = server.metric(HITS)
    assert ask(server, branch_d, "salt-dave") == want_d
    assert ask(server, branch_c, "salt-carol") == want_c
    assert server.metric(HITS) - before >= 2 * 3 * 128

    # The parent goes; its clone still thaws. Eviction pressure never takes pinned blocks.
    eng.delete("acme", "trip")
    for i in range(8):
        ask(server, [SYSTEM, {"role": "user", "content": long_text(90 + i, 600)}],
            f"flood-{i}", max_tokens=1)
    assert server.metric_where("cwm:store_drops", tier="disk", reason="evicted") > 0
    st = eng.status("acme", "trip-b")
    assert st["restorable_tokens"] == window.pinned_tokens and st["parent"] == "trip"
    server.reset_prefix_cache()
    eng.thaw("acme", "trip-b", session="erin", salt="salt-erin")
    before = server.metric(HITS)
    assert ask(server, turn4, "salt-erin") == expected
    assert server.metric(HITS) - before >= 3 * 128
    eng.store.close()


@pytest.mark.redis
def test_a_window_frozen_on_one_server_thaws_on_another_through_redis(
        tiny_model, vllm_factory, tmp_path, redis_server):
    # Redis as shipped: written behind the disk, so at freeze time it may lack blocks the
    # disk has; the freeze waits for them or copies them, and server B gets every block
    shared = {"redis_url": redis_server.url, "redis_write": "behind"}
    a, b = start_all(*(serve(vllm_factory, tiny_model, {**shared, "disk_path": str(tmp_path / n)})
                       for n in "ab"))
    history, arrivals = conversation(a, "salt-a")
    eng_a = engine_on({**shared, "disk_path": str(tmp_path / "a")})
    w = eng_a.freeze("acme", "handover", session="a", salt="salt-a", coming=arrivals)
    tiers = eng_a.status("acme", "handover")["tiers"]
    assert tiers["redis"]["complete"] and tiers["redis"]["blocks"] == w.num_blocks
    eng_a.store.close()
    a.stop()
    eng_b = engine_on(shared)                      # server B's side: Redis only
    assert [m.name for m in eng_b.list("acme")[0]] == ["handover"]
    eng_b.thaw("acme", "handover", session="b", salt="salt-b", model="tiny")
    turn = [*history, {"role": "user", "content": "Where were we?"}]
    expected = ask(b, turn, "fresh")
    before = b.metric(HITS)
    assert ask(b, turn, "salt-b") == expected
    # every block the window holds, and it holds every full block of its tokens (a partial
    # last block is never stored: a bound of 0.9 x len(w.tokens) failed whenever the
    # conversation ended early in a block, 740 tokens with 640 in full blocks)
    assert w.pinned_tokens == 128 * (len(w.tokens) // 128), (w.pinned_tokens, len(w.tokens))
    assert b.metric(HITS) - before == w.pinned_tokens
    eng_b.store.close()


def test_an_exported_window_imported_into_a_fresh_store_restores_exactly(
        tiny_model, vllm_factory, tmp_path):
    from cwm_plugin.windows.portable import BadWindowFile, export_window, import_window

    a, b = start_all(*(serve(vllm_factory, tiny_model, {"disk_path": str(tmp_path / n)})
                       for n in "ab"))                       # b: a store of its own
    history, arrivals = conversation(a, "salt-a")
    eng_a = engine_on({"disk_path": str(tmp_path / "a")})
    w = eng_a.freeze("acme", "trip", session="a", salt="salt-a", messages=history,
                     coming=arrivals)
    path = tmp_path / "trip.cwmw"
    with open(path, "wb") as out:
        export_window(eng_a, "acme", "trip", out)
    eng_a.store.close()
    a.stop()

    eng_b = engine_on({"disk_path": str(tmp_path / "b")})
    flipped = bytearray(path.read_bytes())
    flipped[len(flipped) // 3] ^= 0x40
    (tmp_path / "bad.cwmw").write_bytes(bytes(flipped))
    with pytest.raises(BadWindowFile), open(tmp_path / "bad.cwmw", "rb") as src:
        import_window(eng_b, "acme", src)
    assert eng_b.list("acme")[1] == 0
    with open(path, "rb") as src:
        imported = import_window(eng_b, "acme", src)
    assert imported.tokens == w.tokens and imported.messages == history
    eng_b.thaw("acme", "trip", session="b", salt="salt-b", model="tiny")
    turn = [*history, {"role": "user", "content": "Where were we?"}]
    expected = ask(b, turn, "fresh")
    before = b.metric(HITS)
    assert ask(b, turn, "salt-b") == expected
    # every block the window holds (its full blocks: a partial last block is never stored, so
    # a bound on len(w.tokens) failed whenever the conversation ended early in a block)
    assert w.pinned_tokens >= 0.8 * len(w.tokens)
    assert b.metric(HITS) - before == w.pinned_tokens
    eng_b.store.close()
