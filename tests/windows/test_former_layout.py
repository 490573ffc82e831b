"""A user's windows stored in the former layout (a manifest group and salt of the user's own,
written by hand here: ``window_helpers.to_former_layout``) are reachable: the first listing or
naming of the user's windows moves them into the tenant's group once -- manifest and thaw note
re-keyed, blocks untouched -- whatever process does it first, and a name the user has in the
new layout keeps the former window where it is. Over a real disk store (sealed at rest too)."""

from __future__ import annotations

import logging
import threading

import pytest
from prometheus_client import CollectorRegistry
from window_helpers import BS, converse, listings, to_former_layout

from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.windows.engine import WindowEngine

pytestmark = pytest.mark.unit
USER = "acme/u-" + "a" * 32


@pytest.fixture(params=[None, "22" * 32], ids=["plain", "sealed"])
def any_store(request, tmp_path):
    s = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0,
                            encryption_key=request.param), registry=CollectorRegistry())
    yield s
    s.close()


def former_windows(store: KVStore, names: list[str]) -> dict[str, tuple[bytes, bytes]]:
    """USER's windows ``names`` frozen from session ``s`` ("plan" thawed once, so it has a
    thaw note), then put in the former layout; name -> its former keys."""
    converse(store, "s", 3 * BS)
    eng = WindowEngine(store, wait_s=0)
    for name in names:
        eng.freeze(USER, name, session="a", salt="s", tags=[name])
    eng.thaw(USER, "plan", session="b", salt="salt-b")
    return {name: to_former_layout(store, USER, name) for name in names}


def pinned_blocks(store: KVStore, eng: WindowEngine, name: str) -> int:
    keys = [k for ks in eng.window_keys(eng.get(USER, name)) for k in ks]
    return sum(i is not None and i.pinned for i in store.info_many(keys)["disk"])


def test_a_users_former_windows_are_listed_named_and_moved_once(any_store):
    store = any_store
    former = former_windows(store, ["plan", "notes"])
    eng = WindowEngine(store, wait_s=0)                  # a process after the upgrade
    assert sorted(m.name for m in eng.list(USER)[0]) == ["notes", "plan"]
    assert eng.get(USER, "notes").tags == ["notes"]
    assert eng.status(USER, "plan")["last_thaw"]["session"] == "b"   # its thaw note came too
    keys = [k for pair in former.values() for k in pair]
    assert store.contains_many(keys) == [False] * len(keys)          # the former keys went
    assert pinned_blocks(store, eng, "plan") == 2 * 3               # blocks untouched, pinned
    assert eng.thaw(USER, "plan", session="c", salt="salt-c").restorable_tokens == 3 * BS
    assert len(eng.manifests("acme", whole_tenant=True)) == 2       # the tenant counts them
    again = WindowEngine(store, wait_s=0)                           # idempotent
    assert sorted(m.name for m in again.list(USER)[0]) == ["notes", "plan"]


def test_naming_a_former_window_finds_it(any_store):
    store = any_store
    former_windows(store, ["plan"])
    eng = WindowEngine(store, wait_s=0)
    assert eng.get(USER, "plan").tags == ["plan"]                 # named before any listing
    eng.delete(USER, "plan")
    assert WindowEngine(store, wait_s=0).list(USER) == ([], 0)   # deleted means gone


def test_two_processes_moving_at_once_leave_each_window_once(store):
    former_windows(store, ["plan", "notes", "todo"])
    engines = [WindowEngine(store, wait_s=0) for _ in range(2)]
    start = threading.Barrier(2)
    seen: list[list[str]] = []

    def list_windows(eng: WindowEngine) -> None:
        start.wait(timeout=10)
        seen.append(sorted(m.name for m in eng.list(USER)[0]))

    threads = [threading.Thread(target=list_windows, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [["notes", "plan", "todo"]] * 2
    assert len(engines[0].manifests("acme", whole_tenant=True)) == 3


def test_a_move_cut_short_is_finished_by_the_next_process(store):
    """A window claimed in the tenant's group whose former keys are still there (a process
    stopped between the two) is there once; the former keys go."""
    converse(store, "s", 3 * BS)
    eng = WindowEngine(store, wait_s=0)
    m = eng.freeze(USER, "plan", session="a", salt="s")
    key, note = to_former_layout(store, USER, "plan")
    eng.catalog.claim(m)                                   # as the cut-short move left it
    fresh = WindowEngine(store, wait_s=0)
    assert [w.name for w in fresh.list(USER)[0]] == ["plan"]
    assert store.contains_many([key, note]) == [False, False]


def test_a_name_the_user_has_keeps_the_former_window_where_it_is(store, caplog):
    converse(store, "s", 3 * BS)
    eng = WindowEngine(store, wait_s=0)       # a process that looked before the former came
    other = eng.freeze(USER, "other", session="a", salt="s")
    eng.freeze(USER, "plan", session="a", salt="s")
    key, _ = to_former_layout(store, USER, "plan")
    eng.catalog.move(other, USER, "plan")     # the user's "plan" in the tenant's group
    with caplog.at_level(logging.WARNING, logger="cwm_plugin.windows.catalog"):
        assert WindowEngine(store, wait_s=0).get(USER, "plan").window_salt == \
            other.window_salt
    assert "stays there" in caplog.text
    assert store.contains_many([key]) == [True]


def test_a_rotation_adopts_a_former_names_windows_in_the_former_layout(store):
    former_windows(store, ["plan"])                       # USER: the user's former name
    newest = "acme/u-" + "b" * 32
    eng = WindowEngine(store, wait_s=0)
    assert eng.adopt(newest, [USER]) == 1
    assert [m.name for m in eng.list(newest)[0]] == ["plan"]
    assert eng.list(USER) == ([], 0)


def test_each_tenant_remembers_the_users_it_looked_at_apart(store, monkeypatch):
    """The memo of users whose former layout was looked at is kept per tenant: another
    tenant's lookups never push a tenant's users out (its own do, past ``REMEMBER``)."""
    from cwm_plugin.windows import catalog, model

    monkeypatch.setattr(catalog, "REMEMBER", 2)
    looked = listings(store, monkeypatch, model.former_group(USER))
    eng = WindowEngine(store, wait_s=0)
    eng.list(USER)
    for i in range(3):                       # another tenant's users, past REMEMBER
        eng.list(f"beta/u-{i:032d}")
    eng.list(USER)
    assert len(looked) == 1                  # acme's memo kept USER
    for i in range(2):                       # acme's own users push it out
        eng.list(f"acme/u-{i:032d}")
    eng.list(USER)
    assert len(looked) == 2
