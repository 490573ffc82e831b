"""The KV connector through a real ``vllm serve`` on CPU: restores are token-identical.

Every test compares greedy output token ids with a run that recomputed the prompt, checks vLLM's
``external_prefix_cache_hits`` to prove the restore happened, and, where it matters, shows that
corrupted KV would have changed the output.
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cwm_plugin.store.tiers.disk.tier import advise_files
from cwm_plugin.testing.procs import wait_until
from cwm_plugin.testing.redis_server import RedisServer
from cwm_plugin.testing.vllm_server import (
    SHUTDOWN_TIMEOUT_S,
    VLLMServer,
    cwm_connector_args,
    start_all,
)

pytestmark = pytest.mark.e2e

HITS = "vllm:external_prefix_cache_hits"
CONFIGS = Path(__file__).parents[2] / "configs"
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # enables /reset_prefix_cache
KV_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # tiny model: layers x KV heads x (K, V) x head dim x fp32
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


def serve(vllm_factory, model: Path, store: dict, *extra: str, env: dict | None = None,
          **connector) -> VLLMServer:
    return vllm_factory(model, extra_args=[*cwm_connector_args(store, **connector), *extra],
                        env=env or {})


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


def shipped_config(name: str, disk_path: Path) -> list[str]:
    """A ``configs/`` file as vLLM's ``--kv-transfer-config``, its disk path moved to a test dir."""
    cfg = json.loads((CONFIGS / name).read_text())
    cfg["kv_connector_extra_config"]["store"]["disk_path"] = str(disk_path)
    return ["--kv-transfer-config", json.dumps(cfg), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]


def test_restore_after_restart_is_token_identical_and_salts_stay_apart(tiny_model, vllm_factory, tmp_path):
    # configs/connector-cpu.json as shipped (memory + disk tiers), only its disk path moved.
    server = vllm_factory(tiny_model, env=DEV_MODE,
                          extra_args=shipped_config("connector-cpu.json", tmp_path / "store"))
    server.start()
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

    # A cold start: nothing of the store in the page cache (the restore reads the device).
    assert advise_files([f for f in (tmp_path / "store").rglob("*") if f.is_file()],
                        "DONTNEED") > 0
    assert complete_ids(server, prompt, "salt-A") == cold_completion
    hits_after_completion = server.metric(HITS)
    assert hits_after_completion >= 512, "the completion prompt was not restored from the store"
    assert chat_ids(server, chat_text, "salt-A") == cold_chat
    hits = server.metric(HITS)
    assert hits > hits_after_completion, "the chat prompt was not restored"
    # The restores came from the disk tier, and vLLM's /metrics says so.
    assert server.metric_where("vllm:prompt_tokens_cached_by_source", source="disk") == hits
    assert server.metric_where("cwm:connector_loaded_bytes", tier="disk") == hits * KV_PER_TOKEN
    assert server.metric_where("cwm:connector_loaded_blocks", tier="disk") == hits // 128
    assert server.metric_where("cwm:store_decode_seconds_count") >= hits // 128
    assert server.metric("cwm:connector_load_errors") == 0
    # where the restores' time went (bench/ttft.py's breakdown)
    assert server.metric("cwm:connector_lookup_seconds") > 0
    for phase in ("lookup", "read", "decompress", "transform", "copy"):
        assert server.metric_where("cwm:connector_load_phase_seconds", phase=phase) > 0, phase

    # Same server: a new prompt is saved to the memory tier; without vLLM's own prefix cache
    # it comes back from there.
    fresh = long_text(11, 500)
    cold_fresh = complete_ids(server, fresh, "salt-A")
    server.reset_prefix_cache()
    assert complete_ids(server, fresh, "salt-A") == cold_fresh
    assert server.metric_where("cwm:connector_loaded_bytes", tier="memory") > 0
    assert server.metric_where("vllm:prompt_tokens_cached_by_source", source="host") >= 256
    assert server.metric_where("cwm:store_bytes", tier="memory") > 0
    assert server.metric("cwm:connector_saved_bytes") > 0
    # Every connector/store series the Grafana dashboard plots is on vLLM's /metrics (error
    # counters appear with their first error).
    exported = {re.sub(r"_(total|bucket|count|sum|created)$", "", n) for n in server.metrics()}
    dashboard = json.loads((CONFIGS / "grafana-dashboard.json").read_text())
    plotted = {re.sub(r"_(total|bucket)$", "", n) for panel in dashboard["panels"]
               for t in panel["targets"] for n in re.findall(r"\bcwm:[a-z_]+", t["expr"])}
    missing = {n for n in plotted if "error" not in n} - exported
    assert plotted and not missing, missing


def test_corrupted_kv_changes_output_unless_the_checksum_catches_it(tiny_model, vllm_factory, tmp_path):
    """The blobs are corrupted on disk under a running server (disk tier only, vLLM's own
    cache dropped), so the next request reads them back: one server a config, both started
    side by side."""
    prompt = long_text(3, 700)

    def corrupted(server: VLLMServer, root: Path) -> tuple[list[int], list[int]]:
        cold = complete_ids(server, prompt, "salt-N")
        full_blocks = len(server.tokenize(prompt)) // 128
        wait_until(lambda: server.metric("cwm:connector_saved_blocks") >= full_blocks,
                   timeout=60, what="the prompt's blocks saved to disk")
        assert corrupt_blobs(root) >= full_blocks
        server.reset_prefix_cache()
        return cold, complete_ids(server, prompt, "salt-N")

    # Negative control: raw payload, no checksum; and the same corruption with the checksum on.
    raw, safe = start_all(*(serve(vllm_factory, tiny_model,
                                  {"disk_path": str(tmp_path / name), "zstd_level": 0,
                                   "memory_bytes": 0, "checksum": checksum}, env=DEV_MODE)
                            for name, checksum in (("raw", False), ("safe", True))))
    cold, after_raw = corrupted(raw, tmp_path / "raw")
    assert raw.metric(HITS) > 0, "the corrupted blocks were not loaded"
    assert after_raw != cold, "corrupted KV did not change the output: the test proves nothing"
    raw.stop()
    # With the checksum: detected, recomputed, identical output.
    cold_safe, after_safe = corrupted(safe, tmp_path / "safe")
    assert cold_safe == cold and after_safe == cold
    assert safe.metric("cwm:connector_load_errors") > 0, "the corruption went unnoticed"


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
    # vLLM shut the worker down in order and the connector flushed what was still in flight.
    first_log = (server.log_dir / f"vllm-{server.port}-1.log").read_text(errors="replace")
    assert "cwm connector: store flushed and closed" in first_log
    assert run_all() == cold
    # Every request but the shortest spans several 32-token blocks restored from the store.
    assert server.metric(HITS) >= 32 * sum(len(j[0].split()) // 40 for j in jobs[1:])


@pytest.mark.redis
def test_second_server_restores_through_shared_redis(tiny_model, vllm_factory, tmp_path, redis_server):
    import redis

    prompt = long_text(4, 700)
    one, two = start_all(*(serve(vllm_factory, tiny_model, {"disk_path": str(tmp_path / n),
                                                            "redis_url": redis_server.url})
                           for n in ("one", "two")))
    cold = complete_ids(one, prompt, "shared")
    one.stop()  # the connector flushes its write-behind queue on shutdown
    assert redis.Redis.from_url(redis_server.url).dbsize() > 0
    # Another process with empty local tiers finds the blocks in Redis.
    assert complete_ids(two, prompt, "shared") == cold
    assert two.metric(HITS) >= 512


@pytest.mark.redis
def test_serving_goes_on_when_redis_stops_mid_run_and_saves_resume_when_it_is_back(
        tiny_model, vllm_factory, tmp_path):
    import redis

    (tmp_path / "redis").mkdir()
    redis_server = RedisServer(workdir=tmp_path / "redis").start()
    try:
        client = redis.Redis(port=redis_server.port)
        store = {"disk_path": str(tmp_path / "store"), "redis_url": redis_server.url}
        server = serve(vllm_factory, tiny_model, store, env=DEV_MODE).start()
        before = long_text(20, 600)
        cold_before = complete_ids(server, before, "s")
        wait_until(lambda: client.dbsize() > 0, timeout=30, what="blocks saved to redis")

        redis_server.stop()                                   # Redis goes away mid-run
        server.reset_prefix_cache()
        assert complete_ids(server, before, "s") == cold_before   # restored from local tiers
        assert server.metric(HITS) >= 512
        during = long_text(21, 600)
        cold_during = complete_ids(server, during, "s")        # saved locally, Redis refused
        server.reset_prefix_cache()
        assert complete_ids(server, during, "s") == cold_during
        assert server.metric_where("cwm:store_errors", kind="tier_unavailable") > 0

        redis_server.start()                                  # back, empty (no persistence)
        client = redis.Redis(port=redis_server.port)
        after = [long_text(22 + i, 300) for i in range(30)]

        def saved_after_outage() -> bool:
            complete_ids(server, after.pop(), "s", max_tokens=1)
            return client.dbsize() > 0

        wait_until(saved_after_outage, timeout=90, interval=1.0, what="saves to redis resuming")
        assert server.alive()
    finally:
        redis_server.stop()


def test_serving_goes_on_when_the_store_is_full(tiny_model, vllm_factory, tmp_path):
    # No memory tier and a disk budget smaller than one block: every save is refused.
    store = {"disk_path": str(tmp_path / "full"), "disk_bytes": 4096, "memory_bytes": 0}
    server = serve(vllm_factory, tiny_model, store, env=DEV_MODE).start()
    prompt = long_text(5, 700)
    first = complete_ids(server, prompt, "s")
    server.reset_prefix_cache()
    assert complete_ids(server, prompt, "s") == first         # recomputed, same tokens
    assert complete_ids(server, long_text(6, 500), "s")
    assert server.metric(HITS) == 0
    assert server.metric_where("cwm:store_errors", kind="storage_full") > 0
    assert server.metric_where("cwm:connector_save_errors", reason="failed") > 0
    assert server.metric("cwm:connector_saved_blocks") == 0
