"""Row-level security on the memory's tables (schema version 5, ``pg_scope``), on a real
PostgreSQL with the role a deployment's sidecar connects as (no superuser): a piece of work sees
and changes the folders its scope names and nothing else, whatever folder its queries name; a
path that set no scope sees nothing; the superuser is said to bypass it."""

from __future__ import annotations

import logging
from pathlib import Path

import psycopg
import pytest

from cwm_plugin import pg_scope
from cwm_plugin.errors import MemoryUnavailable
from cwm_plugin.memory.models import Turn
from cwm_plugin.memory.postgres.truth import PostgresTruth
from cwm_plugin.testing.postgres_server import admin_url

pytestmark = pytest.mark.postgres
ALICE, BOB = pg_scope.folders(["alice"], ["alice"]), pg_scope.folders(["bob"], ["bob"])


def _turns(*texts: str) -> list[Turn]:
    return [Turn(f"t{i}", "user", t, "2026-11-29T10:00:00Z") for i, t in enumerate(texts)]


@pytest.fixture
def truth(postgres_url: str, tmp_path: Path):
    got = PostgresTruth(postgres_url, tmp_path / "mem")
    with pg_scope.scoped(ALICE):
        got.append_turns("alice", "s1", _turns("alice plays the violin"))
    with pg_scope.scoped(BOB):
        got.append_turns("bob", "s1", _turns("bob keeps bees on the roof"))
    yield got
    got.close()


def test_a_scope_sees_its_folders_rows_and_no_others_whatever_the_query_names(truth) -> None:
    with pg_scope.scoped(ALICE):
        assert [t.content for t in truth.read_turns("alice", "s1")] == ["alice plays the violin"]
        assert truth.read_turns("bob", "s1") == []  # the query names bob's folder: nothing
        assert truth.sessions("bob") == [] and truth.folders() == ["alice"]
        with truth.connection() as conn:  # a query that forgot its folder altogether
            assert conn.execute("SELECT DISTINCT folder FROM cwm_memory_turns").fetchall() == \
                [("alice",)]
            assert conn.execute("SELECT count(*) FROM cwm_memory_changes").fetchone()[0] == 1
    with pg_scope.scoped(pg_scope.EVERYTHING):  # the operator's tools
        assert truth.folders() == ["alice", "bob"]
    # what the superuser sees: both rows are there
    with psycopg.connect(admin_url(truth.db._url)) as conn:
        assert conn.execute("SELECT count(*) FROM cwm_memory_turns").fetchone()[0] == 2


def test_a_scope_cannot_write_into_another_folder(truth) -> None:
    with pg_scope.scoped(ALICE):
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            truth.append_turns("bob", "s2", _turns("planted by alice"))
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            truth.write_summary("bob", "s1", "rewritten by alice", "t0")
        with truth.connection() as conn:  # an update or delete of bob's rows finds none
            assert conn.execute("UPDATE cwm_memory_turns SET content = 'x' "
                                "WHERE folder = 'bob'").rowcount == 0
            assert conn.execute("DELETE FROM cwm_memory_sessions").rowcount == 1  # alice's
    with pg_scope.scoped(BOB):
        assert [t.content for t in truth.read_turns("bob", "s1")] == \
            ["bob keeps bees on the roof"]


def test_a_read_scope_reads_but_does_not_change(truth) -> None:
    """A namespace granted RO (another provider's, ``global``): read, never written."""
    reader = pg_scope.folders(["alice", "bob"], ["alice"])
    with pg_scope.scoped(reader):
        assert [t.content for t in truth.read_turns("bob", "s1")] == \
            ["bob keeps bees on the roof"]
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            truth.append_turns("bob", "s1", _turns("appended by a reader"))


def test_work_with_no_scope_is_refused_and_the_pool_says_so(truth, caplog) -> None:
    """Loudly, not as an empty answer: a replica's own index would read "no sessions" as
    "every session deleted" and throw its index away."""
    with caplog.at_level(logging.ERROR, logger="cwm_plugin.pg_pool"), \
            pytest.raises(MemoryUnavailable, match="no scope set"):
        truth.read_turns("alice", "s1")
    assert "no row-level security scope" in caplog.text
    with pg_scope.scoped(pg_scope.NOTHING):  # a scope of no folder: sees nothing
        assert truth.read_turns("alice", "s1") == [] and truth.folders() == []


def test_a_truncate_moves_every_folders_counter_whatever_the_scope(truth) -> None:
    """The change counters' trigger runs with every folder in scope: a truncate (which row-level
    security does not bind) by a narrow scope still tells every folder's readers to look again."""
    with pg_scope.scoped(pg_scope.EVERYTHING):
        before = truth.folder_signature("alice"), truth.folder_signature("bob")
    with pg_scope.scoped(ALICE), truth.connection() as conn:
        conn.execute("TRUNCATE cwm_memory_sessions CASCADE")
    with pg_scope.scoped(pg_scope.EVERYTHING):
        after = truth.folder_signature("alice"), truth.folder_signature("bob")
        assert truth.folders() == []
    assert after[0] != before[0] and after[1] != before[1]


def test_the_search_index_in_the_database_is_scoped_too(new_service, postgres_url: str
                                                       ) -> None:
    """Candidates from the database (``memory.candidates: database``): a search in bob's
    folder under alice's scope finds nothing of bob's, and adds nothing to bob's space."""
    svc = new_service(postgres_url=postgres_url, candidates="database")
    with pg_scope.scoped(BOB):
        svc.record_turns("bob", "s1", [("user", "my bees live on the roof of the barn")])
        assert [h.text for h in svc.search("bob", "bees roof", k=3)]
    with pg_scope.scoped(ALICE):
        assert svc.search("bob", "bees roof", k=3) == []
    with pg_scope.scoped(pg_scope.EVERYTHING), svc.files.connection() as conn:
        spaces = {r[0].split("/", 1)[1] for r in conn.execute(
            "SELECT DISTINCT space FROM cwm_index_sessions").fetchall()}
    assert spaces == {"bob"}


def test_the_superuser_is_said_to_bypass_it(postgres_server, tmp_path: Path, caplog) -> None:
    url = postgres_server.new_database(superuser=True)
    got = PostgresTruth(url, tmp_path / "mem")
    try:
        with caplog.at_level(logging.WARNING), pg_scope.scoped(ALICE):
            got.folders()
        assert "bypasses row-level security" in caplog.text
    finally:
        got.close()
        postgres_server.drop_database(url)
