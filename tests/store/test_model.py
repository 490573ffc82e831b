"""Model-based test: random sequences of put/link/delete/pin/unpin/gc/flood/reopen against a dict.

The model knows which blob each key points to (the key and seed it was first put under), which
keys are pinned, and that a link re-points an existing key. ``flood`` writes enough other
blocks to push every unprotected blob out of both budgets: afterwards exactly the keys whose
blob some pinned key points to must still be there.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from cwm_plugin.store.blob import codec
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore

pytestmark = pytest.mark.unit

KEYS = [bytes(18) + f"key{i}".encode() for i in range(6)]   # one group: links share blobs
FLOOD = 14
op = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(KEYS), st.integers(0, 3)),
    st.tuples(st.just("link"), st.sampled_from(KEYS), st.sampled_from(KEYS)),
    st.tuples(st.just("delete"), st.sampled_from(KEYS), st.none()),
    st.tuples(st.just("pin"), st.sampled_from(KEYS), st.booleans()),
    st.tuples(st.just("gc"), st.none(), st.none()),
    st.tuples(st.just("flood"), st.none(), st.none()),
    st.tuples(st.just("reopen"), st.booleans(), st.none()),
)


def block(seed: int) -> torch.Tensor:
    return torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def content_of(blob: tuple[bytes, int]) -> bytes:
    """The content identity of a blob of the model (what every key linked to it reads)."""
    return blob[0] + bytes([blob[1]])


BLOB = max(len(codec.encode(block(s), key=b"filler99", fingerprint="m")) for s in range(4))
BUDGET = 10 * BLOB + BLOB // 2     # room for the 6 keys' blobs and a few fillers
# the memory tier holds its blocks uncompressed (memory_compress off), blobs of another size
RAW = max(len(codec.encode(block(s), key=b"filler99", fingerprint="m", level=0))
          for s in range(4))
MEMORY_BUDGET = 10 * RAW + RAW // 2


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=25))
@example(ops=[("put", KEYS[0], 0), ("pin", KEYS[0], True), ("link", KEYS[1], KEYS[0]),
              ("pin", KEYS[1], True), ("pin", KEYS[1], False), ("flood", None, None)])
@example(ops=[("put", KEYS[0], 0), ("put", KEYS[1], 1), ("pin", KEYS[1], True),
              ("link", KEYS[1], KEYS[0]), ("flood", None, None), ("reopen", False, None),
              ("delete", KEYS[0], None), ("gc", None, None)])
def test_store_matches_a_dict(tmp_path_factory, ops):
    root = str(tmp_path_factory.mktemp("model"))

    def open_store(memory: bool) -> KVStore:
        return KVStore(StoreConfig(fingerprint="m", disk_path=root, disk_bytes=BUDGET,
                                   memory_bytes=MEMORY_BUDGET if memory else 0, gc_min_age_s=0),
                       registry=CollectorRegistry())

    store = open_store(True)
    model: dict[bytes, tuple[bytes, int]] = {}   # key -> its blob: (key first put under, seed)
    pinned: set[bytes] = set()
    try:
        for name, a, b in ops:
            if name == "put":
                store.put(a, block(b), content=content_of((a, b))).result()
                model.setdefault(a, (a, b))      # present keys are skipped
            elif name == "link" and b in model:
                store.link(a, b)                 # onto an existing key: re-point
                model[a] = model[b]
            elif name == "link":
                with pytest.raises(Exception, match="cannot link"):
                    store.link(a, b)
            elif name == "delete":
                assert store.delete(a) == (a in model)
                model.pop(a, None)
                pinned.discard(a)
            elif name == "pin" and a in model:
                store.pin(a) if b else store.unpin(a)
                pinned.add(a) if b else pinned.discard(a)
            elif name == "gc":
                store.gc()
            elif name == "flood":
                fillers = [f"filler{i:02d}".encode() for i in range(FLOOD)]
                for i, k in enumerate(fillers):
                    store.put(k, block(i % 4)).result()
                for k in fillers:
                    store.delete(k)
                protected = {model[p] for p in pinned}
                model = {k: v for k, v in model.items() if v in protected}
            elif name == "reopen":
                store.close()
                store = open_store(bool(a))
            assert store.contains_many(KEYS) == [k in model for k in KEYS], (name, a, b)
            on_disk = store.disk.lookup_many(KEYS)                      # disk holds them too
            assert {k for k, b in zip(KEYS, on_disk, strict=True) if b} == set(model)
            assert all(store.pinned(k) for k in pinned)
        got = store.get_many(KEYS, contents=[content_of(model.get(k, (k, 0))) for k in KEYS])
        for k, t in zip(KEYS, got, strict=True):
            assert (t is None) == (k not in model)
            if t is not None:
                assert torch.equal(t, block(model[k][1]))
        assert store.verify(progress=False).clean
        store.gc()
        assert store.usage()["disk"]["blobs"] == len(set(model.values()))  # one blob a put
    finally:
        store.close()
