"""Model-based test: random sequences of put/link/delete/pin/get/gc/reopen against a dict."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.tiered import KVStore

pytestmark = pytest.mark.unit

KEYS = [f"key{i}".encode() for i in range(6)]
op = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(KEYS), st.integers(0, 3)),
    st.tuples(st.just("link"), st.sampled_from(KEYS), st.sampled_from(KEYS)),
    st.tuples(st.just("delete"), st.sampled_from(KEYS), st.none()),
    st.tuples(st.just("pin"), st.sampled_from(KEYS), st.booleans()),
    st.tuples(st.just("gc"), st.none(), st.none()),
    st.tuples(st.just("reopen"), st.booleans(), st.none()),
)


def block(seed: int) -> torch.Tensor:
    return torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=25))
def test_store_matches_a_dict(tmp_path_factory, ops):
    root = str(tmp_path_factory.mktemp("model"))

    def open_store(memory: bool) -> KVStore:
        return KVStore(StoreConfig(fingerprint="m", disk_path=root,
                                   memory_bytes=(1 << 20) if memory else 0),
                       registry=CollectorRegistry())

    store = open_store(True)
    model: dict[bytes, tuple[bytes, int]] = {}   # key -> (key it was put under, seed)
    try:
        for name, a, b in ops:
            if name == "put":
                store.put(a, block(b)).result()
                model.setdefault(a, (a, b))      # present keys are skipped
            elif name == "link":
                if b in model:
                    store.link(a, b) if a not in model else None
                    model.setdefault(a, model[b])
            elif name == "delete":
                assert store.delete(a) == (a in model)
                model.pop(a, None)
            elif name == "pin" and a in model:
                store.pin(a) if b else store.unpin(a)
            elif name == "gc":
                store.gc()
            elif name == "reopen":
                store.close()
                store = open_store(bool(a))
            assert store.contains_many(KEYS) == [k in model for k in KEYS]
        got = store.get_many(KEYS)
        for k, t in zip(KEYS, got, strict=True):
            assert (t is None) == (k not in model)
            if t is not None:
                assert torch.equal(t, block(model[k][1]))
        assert store.verify(progress=False).clean
        store.gc()
        assert store.usage()["disk"]["blobs"] == len(set(model.values()))  # one blob a put
    finally:
        store.close()
