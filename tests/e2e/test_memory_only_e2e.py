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
# ... as a blob: a store of a memory tier alone keeps blocks uncompressed (zstd level 0, the
# memory tier's own format since memory_compress went off by default), plus a header of ~500 B
STORED = BLOCK + 1024
ROUNDS = 12


def test_under_eviction_churn_every_promised_block_loads(tiny_model, vllm_factory):
    """Each round the session of two rounds before returns and a new session (3 blocks) is
    saved meanwhile: the memory tier holds ~3.3 sessions, so the returning session's blocks
    are all there at its lookup, promised from what the workers reported, and the new
    session's saves evict the coldest blocks while they load. (With room for ~2.3 sessions
    and the new session sent first, whether anything was left to promise was a race: a
    slower machine promised nothing at all.)"""
    store = {"memory_bytes": 10 * STORED, "disk_path": None, "redis_url": None}
    # vLLM's own prefix cache off: every returning prompt is looked up in the connector
    server = vllm_factory(tiny_model, extra_args=[
        *cwm_connector_args(store), "--no-enable-prefix-caching"]).start()
    sessions = [(long_text(100 + i, 210), f"tenant-{i}") for i in range(ROUNDS)]  # ~420 tokens
    cold: dict[int, list[int]] = {}

    def send(i: int) -> tuple[int, list[int]]:
        return i, complete_ids(server, *sessions[i], max_tokens=8)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for r in range(ROUNDS):
            jobs = [pool.submit(send, r - 2)] if r >= 2 else []
            if jobs:
                time.sleep(0.02)            # the return's lookup first, then the new session
            jobs.append(pool.submit(send, r))
            for job in jobs:
                i, ids = job.result()
                assert cold.setdefault(i, ids) == ids, f"session {i} came back different"
    # each return hits all 3 blocks here (3,840 tokens); at least a block a return on average
    hits = server.metric(HITS)
    print(f"\nexternal prefix-cache hits over {ROUNDS - 2} returns: {hits:.0f} tokens")
    assert hits >= 128 * (ROUNDS - 2), f"too little was promised to prove much ({hits:.0f})"
    assert server.metric_where("cwm:store_evictions", tier="memory") > 0, "no churn"
    assert server.metric("cwm:connector_load_errors") == 0
    assert server.metric("cwm:connector_load_failures_recomputed") == 0
    log = server.log_text()
    assert log.count("no context records are kept") == 1
    assert "could not save" not in log
