"""Store v2 through a real ``vllm serve``: a damaged index never stops vLLM, a dropped block is
never promised (even under vLLM's default ``kv_load_failure_policy: fail``), the namespace
covers ``--hf-overrides``, and two servers share KV through a real Redis Cluster."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from test_connector import HITS, complete_ids, long_text, serve

from cwm_plugin.testing.procs import wait_until
from cwm_plugin.testing.vllm_server import SHUTDOWN_TIMEOUT_S, kv_transfer_config, start_all

pytestmark = pytest.mark.e2e


def test_a_damaged_index_never_stops_vllm_and_is_rebuilt(tiny_model, vllm_factory, tmp_path):
    store = {"disk_path": str(tmp_path / "store"), "memory_bytes": 0}
    server = serve(vllm_factory, tiny_model, store).start()
    prompt = long_text(30, 700)
    cold = complete_ids(server, prompt, "s")
    server.stop()
    index = tmp_path / "store" / "index.sqlite"
    for suffix in ("-wal", "-shm"):
        (tmp_path / "store" / f"index.sqlite{suffix}").unlink(missing_ok=True)
    raw = bytearray(index.read_bytes())
    raw[100:4096] = os.urandom(3996)         # as a failing disk does: "disk image is malformed"
    index.write_bytes(bytes(raw))
    server.start()                            # vLLM serves ...
    wait_until(lambda: "index rebuilt from" in server.log_path.read_text(errors="replace"),
               timeout=60, what="the index rebuild")
    assert complete_ids(server, prompt, "s") == cold          # ... and restores after rebuild
    assert server.metric(HITS) >= 512
    assert server.metric_where("cwm:store_errors", kind="index_rebuilt") >= 1
    assert list((tmp_path / "store").glob("index.sqlite.damaged-*"))


def test_a_block_the_store_dropped_is_never_promised_under_policy_fail(
        tiny_model, vllm_factory, tmp_path):
    # Memory tier only, room for a few blocks; vLLM's default policy fails a request whose
    # promised KV does not load. Blocks evicted since they were saved must not be promised.
    extra = {"store": {"memory_bytes": 6 * 128 * 4096 + 65536, "zstd_level": 0}}
    cfg = kv_transfer_config("CWMConnector", "cwm_plugin.connector", extra,
                             recompute_on_load_failure=False)
    server = vllm_factory(tiny_model, env={"VLLM_SERVER_DEV_MODE": "1"}, extra_args=[
        "--kv-transfer-config", cfg, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]).start()
    first = long_text(40, 700)
    cold = complete_ids(server, first, "s")
    for i in range(4):                        # push the first prompt's blocks out
        complete_ids(server, long_text(41 + i, 700), "s", max_tokens=1)
    server.reset_prefix_cache()
    assert complete_ids(server, first, "s") == cold           # no failed request
    assert server.metric("cwm:connector_load_errors") == 0
    assert server.metric_where("cwm:store_drops", reason="evicted") > 0
    assert server.metric("cwm:connector_dropped_blocks") > 0
    # vLLM's reset of the external cache reaches the connector: memory tiers emptied
    r = httpx.post(f"{server.base_url}/reset_prefix_cache", params={"reset_external": "true"},
                   timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    hits = server.metric(HITS)
    assert complete_ids(server, first, "s") == cold
    assert server.metric(HITS) == hits and server.metric("cwm:connector_load_errors") == 0


def test_a_different_hf_override_gets_no_external_hits(tiny_model, vllm_factory, tmp_path):
    store = {"disk_path": str(tmp_path / "store")}
    prompt = long_text(50, 700)
    override = json.dumps({"rope_theta": 20000.0})
    plain, changed = start_all(serve(vllm_factory, tiny_model, store),
                               serve(vllm_factory, tiny_model, store, "--hf-overrides", override))
    complete_ids(plain, prompt, "s")
    plain.stop()
    from cwm_plugin.store.tiers.disk.key_index import DiskKeyIndex
    index = DiskKeyIndex(tmp_path / "store" / "index.sqlite")
    assert index.totals()[1] >= 5                            # the blocks are there ...
    index.close()
    complete_ids(changed, prompt, "s")
    assert changed.metric(HITS) == 0                         # ... but not for this engine


@pytest.mark.redis
def test_two_servers_share_kv_through_a_redis_cluster(tiny_model, vllm_factory, tmp_path,
                                                      redis_cluster):
    store = {"redis_url": redis_cluster.url, "redis_cluster": True, "memory_bytes": 0,
             "redis_prefix": "e2e", "redis_write": "through", "redis_max_value_bytes": 65536}
    prompt = long_text(60, 700)
    one, two = start_all(serve(vllm_factory, tiny_model, store),
                         serve(vllm_factory, tiny_model, {**store}))   # nothing local at all
    cold = complete_ids(one, prompt, "shared")
    one.stop()
    assert complete_ids(two, prompt, "shared") == cold
    hits = two.metric(HITS)
    assert hits >= 512
    assert complete_ids(two, prompt, "other-salt") == cold
    assert two.metric(HITS) == hits                           # the other salt hit nothing
