"""The KV connector through a real ``vllm serve`` on CPU: restores are token-identical.

Every test compares greedy output token ids with a run that recomputed the prompt, checks vLLM's
``external_prefix_cache_hits`` to prove the restore happened, and, where it matters, shows that
corrupted KV would have changed the output.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cwm_plugin.testing.vllm_server import VLLMServer, cwm_connector_args

pytestmark = pytest.mark.e2e

HITS = "vllm:external_prefix_cache_hits"
WORDS = ["memory", "context", "window", "token", "cache", "block", "restore", "save", "model", "vector", "salt", "tenant", "session", "question", "answer", "river", "mountain", "coffee", "garden", "letter", "window"]


def long_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def complete_ids(server: VLLMServer, prompt: str, salt: str | None, max_tokens: int = 24) -> list[int]:
    kw = {"cache_salt": salt} if salt else {}
    out = server.complete(prompt, max_tokens=max_tokens, return_token_ids=True, **kw)
    return out["choices"][0]["token_ids"]


def chat_ids(server: VLLMServer, text: str, salt: str | None, max_tokens: int = 24) -> list[int]:
    kw = {"cache_salt": salt} if salt else {}
    out = server.chat([{"role": "system", "content": "You are a careful assistant."},
                       {"role": "user", "content": text}],
                      max_tokens=max_tokens, return_token_ids=True, **kw)
    return out["choices"][0]["token_ids"]


def serve(vllm_factory, model: Path, store: dict, *extra: str, **connector) -> VLLMServer:
    return vllm_factory(model, extra_args=[*cwm_connector_args(store, **connector), *extra])


def corrupt_blobs(root: Path) -> int:
    """Overwrite the second half of every stored blob file with noise (headers stay intact)."""
    rng = random.Random(7)
    n = 0
    for f in root.rglob("*"):
        if f.is_file() and f.suffix not in {".db", ".sqlite", ".wal", ".shm", ".lock", ".json"} \
                and "-wal" not in f.name and "-shm" not in f.name and f.stat().st_size > 4096:
            data = bytearray(f.read_bytes())
            half = len(data) // 2
            data[half:] = bytes(rng.randrange(256) for _ in range(len(data) - half))
            f.write_bytes(bytes(data))
            n += 1
    return n


def test_restore_after_restart_is_token_identical_and_salts_stay_apart(tiny_model, vllm_factory, tmp_path):
    store = {"disk_path": str(tmp_path / "store")}
    server = serve(vllm_factory, tiny_model, store).start()
    prompt = long_text(1, 700)
    chat_text = long_text(2, 600)
    cold_completion = complete_ids(server, prompt, "salt-A")
    cold_chat = chat_ids(server, chat_text, "salt-A")
    assert server.metric(HITS) == 0

    server.restart()
    assert server.metric(HITS) == 0
    # Salt B (same text) must not hit salt A's blocks, nor may a request without a salt.
    assert complete_ids(server, prompt, "salt-B") == cold_completion
    assert complete_ids(server, prompt, None) == cold_completion
    assert server.metric(HITS) == 0, "another salt or no salt hit salt A's stored blocks"

    assert complete_ids(server, prompt, "salt-A") == cold_completion
    hits_after_completion = server.metric(HITS)
    assert hits_after_completion >= 512, "the completion prompt was not restored from the store"
    assert chat_ids(server, chat_text, "salt-A") == cold_chat
    assert server.metric(HITS) > hits_after_completion, "the chat prompt was not restored"
    m = server.metrics()
    assert m.get("cwm:connector_loaded_blocks_total", 0) > 0
    assert m.get("cwm:connector_load_errors_total", 0) == 0


def test_corrupted_kv_changes_output_unless_the_checksum_catches_it(tiny_model, vllm_factory, tmp_path):
    prompt = long_text(3, 700)
    # Negative control: raw payload, no checksum -> the corrupted KV is loaded and used.
    raw = {"disk_path": str(tmp_path / "raw"), "zstd_level": 0, "checksum": False,
           "memory_bytes": 0}
    server = serve(vllm_factory, tiny_model, raw).start()
    cold = complete_ids(server, prompt, "salt-N")
    server.stop()
    assert corrupt_blobs(tmp_path / "raw") > 0
    server.start()
    corrupted = complete_ids(server, prompt, "salt-N")
    assert server.metric(HITS) > 0, "the corrupted blocks were not loaded"
    assert corrupted != cold, "corrupted KV did not change the output: the test proves nothing"
    server.stop()

    # Same corruption with the checksum on: detected, recomputed, identical output.
    safe = {"disk_path": str(tmp_path / "safe"), "zstd_level": 0, "checksum": True,
            "memory_bytes": 0}
    server = serve(vllm_factory, tiny_model, safe).start()
    assert complete_ids(server, prompt, "salt-N") == cold
    server.stop()
    assert corrupt_blobs(tmp_path / "safe") > 0
    server.start()
    assert complete_ids(server, prompt, "salt-N") == cold
    assert server.metric("cwm:connector_load_errors") > 0, "the corruption went unnoticed"


def test_chunked_prefill_and_concurrent_salted_requests_restore_identically(
        tiny_model, vllm_factory, tmp_path):
    store = {"disk_path": str(tmp_path / "store")}
    server = serve(vllm_factory, tiny_model, store, "--block-size", "32",
                   "--max-num-batched-tokens", "256").start()
    jobs = [(long_text(10 + i, 150 + 170 * i), f"tenant-{i}") for i in range(5)]

    def run_all() -> list[list[int]]:
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            return list(pool.map(lambda j: complete_ids(server, j[0], j[1]), jobs))

    cold = run_all()
    server.restart()
    assert run_all() == cold
    # Every request but the shortest spans several 32-token blocks restored from the store.
    assert server.metric(HITS) >= 32 * sum(len(j[0].split()) // 40 for j in jobs[1:])


@pytest.mark.redis
def test_second_server_restores_through_shared_redis(tiny_model, vllm_factory, tmp_path, redis_server):
    import redis

    prompt = long_text(4, 700)
    one = serve(vllm_factory, tiny_model, {"disk_path": str(tmp_path / "one"),
                                           "redis_url": redis_server.url}).start()
    cold = complete_ids(one, prompt, "shared")
    one.stop()  # the connector flushes its write-behind queue on shutdown
    assert redis.Redis.from_url(redis_server.url).dbsize() > 0
    # Another process with empty local tiers finds the blocks in Redis.
    two = serve(vllm_factory, tiny_model, {"disk_path": str(tmp_path / "two"),
                                           "redis_url": redis_server.url}).start()
    assert complete_ids(two, prompt, "shared") == cold
    assert two.metric(HITS) >= 512


@pytest.mark.redis
def test_serving_goes_on_when_redis_is_down_or_the_store_is_full(
        tiny_model, vllm_factory, tmp_path, redis_server):
    prompt = long_text(5, 700)
    url = redis_server.url
    redis_server.stop()  # Redis is down before vLLM even starts
    tiny_store = {"disk_path": str(tmp_path / "full"), "disk_bytes": 4096, "memory_bytes": 4096,
                  "redis_url": url}
    server = serve(vllm_factory, tiny_model, tiny_store).start()
    first = complete_ids(server, prompt, "s")
    second = complete_ids(server, prompt, "s")
    other = complete_ids(server, long_text(6, 500), "s")
    assert first == second and other
    server.restart()
    assert complete_ids(server, prompt, "s") == first
