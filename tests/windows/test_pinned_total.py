"""A tenant's pinned total (``cwm_plugin/windows/tenant_state.py``) over a real disk store: kept
as commits and drops happen instead of a scan of the tenant's manifests per commit, equal to
what the store holds after concurrent freezes, clones, imports, deletes and expiries, derived
from the store by a new process, and derived again before it refuses a commit."""

from __future__ import annotations

import contextlib
import io
import threading

import pytest
from window_helpers import BS, NS, converse, listings, serve

from cwm_plugin.errors import NotFound
from cwm_plugin.store.tiers.base import QuotaExceeded
from cwm_plugin.windows import model
from cwm_plugin.windows.engine import WindowEngine
from cwm_plugin.windows.portable import export_window, import_window

pytestmark = pytest.mark.unit


def window_size(store) -> int:
    """The bytes one window of the session ``s`` (3 blocks, 2 ranks) pins."""
    eng = WindowEngine(store, wait_s=0)
    size = eng.freeze("probe", "w", session="a", salt="s").stored_bytes
    eng.delete("probe", "w")
    return size


def stored_total(eng: WindowEngine, tenant: str) -> int:
    return sum(m.stored_bytes for m in eng.manifests(tenant, whole_tenant=True))


def test_commits_keep_the_total_without_scanning_the_tenants_windows(store, monkeypatch):
    converse(store, "s", 3 * BS)
    size = window_size(store)
    eng = WindowEngine(store, wait_s=0, tenant_quota_bytes=10 * size)
    seen = listings(store, monkeypatch, model.tenant_group("acme"))
    for i in range(4):
        eng.freeze("acme", f"w{i}", session="a", salt="s")
    eng.freeze("acme/u-" + "1" * 32, "mine", session="a", salt="s")
    eng.clone("acme", "w1", "w1-copy")
    eng.delete("acme", "w0")
    assert eng.tenant_bytes("acme") == 5 * size
    assert len(seen) == 1                     # derived once, at the first commit
    fresh = WindowEngine(store, wait_s=0)     # a new process derives it from the store
    assert fresh.tenant_bytes("acme") == 5 * size


def test_the_total_stays_exact_under_concurrent_commits_deletes_and_expiry(store,
                                                                        monkeypatch):
    converse(store, "s", 3 * BS)
    serve(store, NS)
    size = window_size(store)
    eng = WindowEngine(store, wait_s=0, tenant_quota_bytes=100 * size)
    eng.freeze("acme", "src", session="a", salt="s")
    buf = io.BytesIO()
    export_window(eng, "acme", "src", buf)
    for i in range(4):
        eng.freeze("acme", f"old{i}", session="a", salt="s", ttl_s=60)
    assert eng.tenant_bytes("acme") == 5 * size
    later = model.time.time() + 120
    monkeypatch.setattr(model.time, "time", lambda: later)   # the "old" ones are past their TTL
    errors: list[BaseException] = []

    def run(job) -> None:
        try:
            job()
        except BaseException as exc:   # noqa: BLE001 -- reported below
            errors.append(exc)

    def worker(k: int) -> None:
        for j in range(3):
            name = f"t{k}-{j}"
            eng.freeze("acme", name, session="a", salt="s")
            eng.clone("acme", name, name + "-c")
            import_window(eng, f"acme/u-{k:032d}", io.BytesIO(buf.getvalue()), name)
            eng.delete("acme", name)
        for i in range(4):   # every thread expires or deletes the same old windows
            with contextlib.suppress(NotFound):
                eng.delete("acme", f"old{i}")
            eng.list("acme")

    threads = [threading.Thread(target=run, args=(lambda k=k: worker(k),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    kept = eng.tenant_bytes("acme")
    assert kept == stored_total(eng, "acme") == (1 + 4 * 3 * 2) * size


def test_a_window_gone_elsewhere_is_counted_out_before_a_refusal(store):
    """Another process deletes a window: the total this process kept would refuse the next
    commit; it is derived again from the store first, and the commit fits."""
    converse(store, "s", 3 * BS)
    size = window_size(store)
    eng = WindowEngine(store, wait_s=0, tenant_quota_bytes=int(2.5 * size))
    eng.freeze("acme", "a", session="a", salt="s")
    eng.freeze("acme", "b", session="a", salt="s")
    WindowEngine(store, wait_s=0).delete("acme", "a")        # another process
    eng.freeze("acme", "c", session="a", salt="s")
    with pytest.raises(QuotaExceeded):
        eng.freeze("acme", "d", session="a", salt="s")
    assert eng.tenant_bytes("acme") == stored_total(eng, "acme") == 2 * size
