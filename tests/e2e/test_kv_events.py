"""Our tiers in vLLM's KV events, through a real ``vllm serve`` with ``--kv-events-config``:
a salted prompt's blocks come out twice, as vLLM's prefix cache holds them (medium ``GPU``)
and as our memory tier does (``CPU``): the same hashes, token ids and salt; a reset of the
connector's cache announces ours removed. Subscribed over ZMQ as a balancer would."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq
from test_connector import DEV_MODE, long_text
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from cwm_plugin.testing.procs import free_port
from cwm_plugin.testing.vllm_server import cwm_connector_args

pytestmark = pytest.mark.e2e


def _collect(sub: zmq.Socket, seconds: float) -> list[object]:
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list[object] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sub.poll(200):
            _, _, payload = sub.recv_multipart()
            events += decoder.decode(payload).events
    return events


def _part_of(event: BlockStored, ids: list[int]) -> bool:
    """Whether the event's blocks are a block-aligned run of the prompt ``ids``."""
    n, size = len(event.token_ids), event.block_size
    return any(ids[k:k + n] == event.token_ids for k in range(0, len(ids) - n + 1, size))


def test_our_memory_tier_is_in_vllms_kv_events(tiny_model, vllm_factory, tmp_path):
    port = free_port()
    events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://127.0.0.1:{port}", "topic": ""}
    server = vllm_factory(tiny_model, env=DEV_MODE, extra_args=[
        *cwm_connector_args({"memory_bytes": 256 << 20, "disk_path": str(tmp_path / "kv")}),
        "--kv-events-config", json.dumps(events_cfg)])
    sub = zmq.Context.instance().socket(zmq.SUB)
    # (vLLM connects to an endpoint with a host named, binds only a wildcard one: the test
    # listens on loopback and vLLM's publisher comes to it)
    sub.bind(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        server.start()
        # a PUB socket drops what it sends before the subscription reached it: a first
        # request's events settle that (a real consumer asks vLLM's replay endpoint instead)
        deadline = time.monotonic() + 60
        while not _collect(sub, 1.0):
            assert time.monotonic() < deadline, "no KV events reached the subscriber"
            server.complete(long_text(5, 300), max_tokens=1)
        ids = server.tokenize(long_text(3, 900))
        server.complete(ids, max_tokens=2, cache_salt="salt-events")
        events = _collect(sub, 8.0)
        stored = [e for e in events if isinstance(e, BlockStored)]
        gpu = [e for e in stored if e.medium in (None, "GPU")]
        ours = [e for e in stored if e.medium == "CPU" and _part_of(e, ids)]  # (not the warm-up's)
        assert gpu and ours, [(type(e).__name__, getattr(e, "medium", None)) for e in events]
        theirs = {h: (e.extra_keys or [None] * len(e.block_hashes))[i]
                  for e in gpu for i, h in enumerate(e.block_hashes)}
        mine = [h for e in ours for h in e.block_hashes]
        assert set(mine) <= set(theirs)  # the same blocks, under vLLM's own hashes
        first = ours[0]
        assert first.parent_block_hash is None and first.extra_keys[0] == ("salt-events",)
        assert theirs[first.block_hashes[0]] == ("salt-events",)
        size = first.block_size
        assert first.token_ids == ids[:len(first.block_hashes) * size]
        server.reset_prefix_cache(external=True)  # the workers drop their memory tiers
        server.complete(long_text(4, 20), max_tokens=1)  # (a step: the drop is reported)
        removed = [e for e in _collect(sub, 6.0) if isinstance(e, BlockRemoved)
                   and e.medium == "CPU"]
        assert {h for e in removed for h in e.block_hashes} >= set(mine)
    finally:
        sub.close(linger=0)
