"""A tenant's windows as one account (``cwm_plugin/windows/tenancy.py``) over a real disk store:
its users' windows count toward its quota, concurrent commits never pass it together, clones
and imports are held to it, an expired window frees its name, pins and bytes, and a user's
windows move from a former name (a secret rotation)."""

from __future__ import annotations

import contextlib
import io
import threading

import pytest
from prometheus_client import CollectorRegistry
from window_helpers import BS, NS, converse, serve

from cwm_plugin.errors import AlreadyExists, NotFound
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
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
    assert size > 0
    return size


def test_users_windows_count_toward_their_tenants_quota(store):
    """A user is a name the client sends: three "users" of one tenant share its quota."""
    converse(store, "s", 3 * BS)
    size = window_size(store)
    eng = WindowEngine(store, wait_s=0, tenant_quota_bytes=int(size * 2.5))
    eng.freeze("acme/u-" + "1" * 32, "w", session="a", salt="s")
    eng.freeze("acme/u-" + "2" * 32, "w", session="a", salt="s")
    with pytest.raises(QuotaExceeded, match="tenant 'acme' \\(its users' included\\)"):
        eng.freeze("acme/u-" + "3" * 32, "w", session="a", salt="s")
    with pytest.raises(QuotaExceeded):
        eng.freeze("acme", "w", session="a", salt="s")
    with pytest.raises(QuotaExceeded):                   # a clone is held to it too
        eng.clone("acme/u-" + "1" * 32, "w", "w2")
    assert eng.tenant_bytes("acme") == 2 * size
    assert [m.name for m in eng.list("acme/u-" + "1" * 32)[0]] == ["w"]
    assert eng.list("acme")[1] == 0                      # the tenant lists its own only
    eng.freeze("beta", "w", session="a", salt="s")       # another tenant is not charged
    eng.delete("acme/u-" + "2" * 32, "w")
    eng.freeze("acme/u-" + "3" * 32, "w", session="a", salt="s")   # freed room is usable


def test_an_import_is_held_to_the_quota_with_the_bytes_it_pins(tmp_path):
    store = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0),
                    registry=CollectorRegistry())
    try:
        converse(store, "s", 3 * BS)
        serve(store, NS)
        size = window_size(store)
        eng = WindowEngine(store, wait_s=0, tenant_quota_bytes=int(size * 1.5))
        eng.freeze("acme", "w", session="a", salt="s")
        buf = io.BytesIO()
        export_window(eng, "acme", "w", buf)
        keys = sum(len(v) for v in store.list_keys(limit=100_000).values())
        with pytest.raises(QuotaExceeded):
            import_window(eng, "acme/u-" + "1" * 32, io.BytesIO(buf.getvalue()), "copy")
        assert sum(len(v) for v in store.list_keys(limit=100_000).values()) == keys
        m = import_window(eng, "beta", io.BytesIO(buf.getvalue()), "copy")
        assert m.stored_bytes == size == eng.tenant_bytes("beta")
    finally:
        store.close()


def test_concurrent_commits_of_one_tenant_never_pass_its_quota_together(store, monkeypatch):
    """The check and the pin are one step under the tenant's lock: four freezes whose checks
    would all pass on their own leave exactly as many windows as the quota holds."""
    converse(store, "s", 3 * BS)
    size = window_size(store)
    eng = WindowEngine(store, wait_s=0, tenant_quota_bytes=int(size * 2.5))
    arrived = threading.Barrier(4)
    real = store.pin_many

    def pin_many(keys, **kw):  # every freeze reaches its pin before any pins, if it can
        if len(keys) > 1:
            with contextlib.suppress(threading.BrokenBarrierError):
                arrived.wait(timeout=2)
        return real(keys, **kw)

    monkeypatch.setattr(store, "pin_many", pin_many)
    outcomes: list[str] = []

    def freeze(i: int) -> None:
        try:
            eng.freeze(f"acme/u-{i:032d}", "w", session="a", salt="s")
            outcomes.append("frozen")
        except QuotaExceeded:
            outcomes.append("refused")

    threads = [threading.Thread(target=freeze, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["frozen", "frozen", "refused", "refused"]
    assert eng.tenant_bytes("acme") == 2 * size


def test_an_expired_window_frees_its_name_pins_and_bytes(store, monkeypatch):
    converse(store, "s", 3 * BS)
    size = window_size(store)
    eng = WindowEngine(store, wait_s=0, tenant_quota_bytes=size)
    old = eng.freeze("acme", "w", session="a", salt="s", ttl_s=60)
    eng.freeze("beta", "other", session="a", salt="s", ttl_s=60)
    keys = [k for ks in eng.window_keys(old) for k in ks]
    later = model.time.time() + 120
    monkeypatch.setattr(model.time, "time", lambda: later)   # past its TTL
    with pytest.raises(NotFound):
        eng.get("acme", "w")
    assert eng.list("acme") == ([], 0)
    m = eng.freeze("acme", "w", session="a", salt="s")     # the name and the bytes are free
    assert m.window_salt != old.window_salt and eng.get("acme", "w").expires is None
    assert store.contains_many(keys) == [False] * len(keys)   # its blocks went with it
    eng.patch("acme", "w", new_name="other-name")
    eng.freeze("beta", "w", session="a", salt="s")
    eng.patch("beta", "w", new_name="other")               # beta's expired "other" too
    assert [w.name for w in eng.list("beta")[0]] == ["other"]


def test_a_users_windows_move_from_a_former_name(store):
    converse(store, "s", 3 * BS)
    eng = WindowEngine(store, wait_s=0)
    old, new = "acme/u-" + "a" * 32, "acme/u-" + "b" * 32
    eng.freeze(old, "plan", session="a", salt="s", tags=["t"])
    eng.freeze(old, "clash", session="a", salt="s")
    eng.freeze(new, "clash", session="a", salt="s")
    eng.freeze("acme/u-" + "c" * 32, "other", session="a", salt="s")
    assert eng.adopt(new, [old, "beta/u-" + "a" * 32]) == 1
    assert sorted(m.name for m in eng.list(new)[0]) == ["clash", "plan"]
    assert eng.get(new, "plan").tags == ["t"]
    assert [m.name for m in eng.list(old)[0]] == ["clash"]   # a name the user has stays
    r = eng.thaw(new, "plan", session="b", salt="salt-b")
    assert r.restorable_tokens == 3 * BS
    assert eng.adopt(new, [old]) == 0
    with pytest.raises(AlreadyExists):
        eng.patch(new, "plan", new_name="clash")


def default_engine(store_settings: dict, principals: int) -> WindowEngine:
    """The engine as the sidecar and ``cwm window --store`` open it, with the windows'
    default settings (the tenant quota ``auto``)."""
    from cwm_plugin.windows.opening import open_engine
    from cwm_plugin.windows.settings import WindowsSettings

    return open_engine(WindowsSettings(store=store_settings, wait_s=0), principals)


def fill(eng: WindowEngine, tenant: str, sessions: int) -> int:
    """Freeze one window of each of the tenant's ``sessions`` (distinct blocks each: what the
    store's pin quota counts) until its quota refuses one; how many were frozen."""
    for i in range(sessions):
        salt = f"{tenant}-{i}"
        converse(eng.store, salt, 3 * BS, seed=i + (100 if tenant == "b" else 0))
        try:
            eng.freeze(tenant, f"w{i}", session=salt, salt=salt)
        except QuotaExceeded as exc:
            assert "tenant's quota" in str(exc), exc
            return i
    return sessions


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_by_default_a_tenant_pins_only_its_share_of_the_stores_pin_quota(tier, tmp_path,
                                                                         request):
    """Two tenants, the windows' default settings: the first cannot pin past its half of the
    pin quota (on disk half of disk_bytes; in Redis redis_pin_quota_bytes), so the second
    still pins its own."""
    probe = KVStore(StoreConfig(disk_path=str(tmp_path / "probe"), memory_bytes=0),
                    registry=CollectorRegistry())
    try:
        converse(probe, "s", 3 * BS)
        size = window_size(probe)
    finally:
        probe.close()
    pool = 5 * size                                   # two windows and a half each
    if tier == "disk":
        settings = {"disk_path": str(tmp_path / "kv"), "disk_bytes": 2 * pool}
    else:
        server = request.getfixturevalue("redis_server")
        settings = {"redis_url": server.url, "redis_pin_quota_bytes": pool}
    eng = default_engine(settings, principals=2)
    try:
        assert eng.store.pin_quota() == pool and eng.tenancy.quota_bytes == pool // 2
        assert fill(eng, "a", 5) == 2                 # 3 of 5: past its share, refused
        assert fill(eng, "b", 2) == 2                 # the other's share is still there
        assert eng.tenant_bytes("a") == eng.tenant_bytes("b") == 2 * size
    finally:
        eng.store.close()


def test_explicit_tenant_quotas_are_taken_as_they_are_and_null_is_none(tmp_path, caplog):
    """A number is each tenant's quota (a warning when they add up past the pin quota); null
    is no tenant quota."""
    from cwm_plugin.windows.opening import open_engine
    from cwm_plugin.windows.settings import WindowsSettings

    store = {"disk_path": str(tmp_path / "kv"), "disk_bytes": 1_000_000}   # pins: 500,000
    for quota, principals, want, warned in [(250_000, 2, 250_000, False),
                                            (250_000, 3, 250_000, True), (None, 3, None, False),
                                            ("auto", 4, 125_000, False)]:
        caplog.clear()
        eng = open_engine(WindowsSettings(store=store, tenant_quota_bytes=quota), principals)
        eng.store.close()
        assert eng.tenancy.quota_bytes == want
        assert ("over the store's pin quota of 500,000" in caplog.text) == warned
