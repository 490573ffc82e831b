"""A store of memory only, through a real ``vllm serve`` on CPU: under eviction churn in a tiny
memory tier every promised block loads (no load error, nothing recomputed), restores are
token-identical, and no context record is attempted (nobody could read one): said once at
start, not per request."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_connector import HITS, complete_ids, long_text

from cwm_plugin.testing.vllm_server import cwm_connector_args

pytestmark = pytest.mark.e2e

BLOCK = 128 * 4 * 2 * 2 * 64 * 4     # tiny model, fp32: a 128-token block, raw
STORED = int(0.8 * BLOCK)            # ... as a blob (its random-weight KV compresses ~1.25x)
ROUNDS = 12


def test_under_eviction_churn_every_promised_block_loads(tiny_model, vllm_factory):
    """Each round a new session (3 blocks) is saved while the session of two rounds before
    returns: its blocks are the memory tier's coldest (it holds ~2.3 sessions), promised from
    what the workers reported, and the new session's saves push them out meanwhile."""
    store = {"memory_bytes": 7 * STORED, "disk_path": None, "redis_url": None}
    # vLLM's own prefix cache off: every returning prompt is looked up in the connector
    server = vllm_factory(tiny_model, extra_args=[
        *cwm_connector_args(store), "--no-enable-prefix-caching"]).start()
    sessions = [(long_text(100 + i, 210), f"tenant-{i}") for i in range(ROUNDS)]  # ~420 tokens
    cold: dict[int, list[int]] = {}

    def send(i: int) -> tuple[int, list[int]]:
        return i, complete_ids(server, *sessions[i], max_tokens=8)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for r in range(ROUNDS):
            jobs = [pool.submit(send, r)]
            if r >= 2:
                time.sleep(0.02)            # the new session's prefill first, then the return
                jobs.append(pool.submit(send, r - 2))
            for job in jobs:
                i, ids = job.result()
                assert cold.setdefault(i, ids) == ids, f"session {i} came back different"
    assert server.metric(HITS) >= 128, "nothing was promised: the churn test proved nothing"
    assert server.metric_where("cwm:store_evictions", tier="memory") > 0, "no churn"
    assert server.metric("cwm:connector_load_errors") == 0
    assert server.metric("cwm:connector_load_failures_recomputed") == 0
    log = server.log_text()
    assert log.count("no context records are kept") == 1
    assert "could not save" not in log
