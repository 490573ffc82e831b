"""The derived search index in PostgreSQL (``memory/index/pg/``) against the in-process one it
stands in for, on a real PostgreSQL with pgvector: the same BM25 scores document for document
through adds and removes, the same top documents."""

from __future__ import annotations

import random
import time
from pathlib import Path

import psycopg
import pytest

from cwm_plugin import pg_scope
from cwm_plugin.memory.index.bm25 import BM25Corpus
from cwm_plugin.memory.index.pg.bm25 import CHUNKS, LINES, PgBM25, add_docs, remove_docs
from cwm_plugin.memory.models import Turn
from cwm_plugin.memory.postgres.truth import PostgresTruth
from cwm_plugin.testing.postgres_server import admin_url

pytestmark = pytest.mark.postgres


@pytest.fixture(autouse=True)
def _operator_scope():
    """The memory layer's own tests act as the operator: every folder in scope (row-level
    security by scope: ``test_pg_row_security.py``)."""
    with pg_scope.scoped(pg_scope.EVERYTHING):
        yield
WORDS = ("violin", "glacier", "tram", "saffron", "origami", "lighthouse", "cricket", "quartz",
         "mango", "tundra", "kayak", "sonnet", "falcon", "pottery", "harbour", "comet",
         "painting", "painted", "hikes", "hiking", "the", "and", "of")


@pytest.fixture
def truth(postgres_url: str, tmp_path: Path):
    got = PostgresTruth(postgres_url, tmp_path / "mem")
    yield got
    got.close()


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 30)))


def test_bm25_in_the_database_scores_as_the_in_process_corpus(truth) -> None:
    rng = random.Random(7)
    mine, docs = BM25Corpus(), {}
    pg = PgBM25(truth.connection, "sp/f", CHUNKS)
    other = PgBM25(truth.connection, "sp/f", LINES)  # another corpus of the same space
    with truth.connection() as conn:
        for step in range(6):
            batch = {f"d{step}-{i}": _text(rng) for i in range(40)}
            with conn.transaction():
                assert add_docs(conn, "sp/f", CHUNKS, batch.items()) == 40
                assert add_docs(conn, "sp/f", CHUNKS, batch.items()) == 0  # known: kept
                add_docs(conn, "sp/f", LINES, [("x", "violin violin")])
            for d, t in batch.items():
                mine.add(d, t)
            docs.update(batch)
            gone = rng.sample(sorted(docs), 15)
            with conn.transaction():
                assert remove_docs(conn, "sp/f", CHUNKS, [*gone, "never-there"]) == 15
            for d in gone:
                mine.remove(d)
                del docs[d]
    assert len(pg) == len(mine) == len(docs) and len(other) == 1
    for query in ("violin tram", "painted hiking glacier", "comet comet harbour", "the of",
                  "zebra", "mango saffron quartz kayak sonnet"):
        want = mine.scores(query)
        got = pg.scores_of(query, sorted(docs))
        assert {d: s for d, s in got.items() if s} == pytest.approx(want, rel=1e-9)
        top, top_mine = pg.top(query, 10), mine.top(query, 10)
        assert top == pytest.approx(top_mine, rel=1e-9) or (  # a tie at the 10th place
            sorted(top.values())[0] == pytest.approx(sorted(top_mine.values())[0]))
        some = set(rng.sample(sorted(docs), 30))
        also = rng.sample(sorted(docs), 5)
        assert pg.top(query, 5, also=also, allowed=some) == pytest.approx(
            mine.top(query, 5, also=also, allowed=some), rel=1e-9)


def test_a_pruned_search_leaves_common_terms_out_and_finds_the_same_best(
        truth, monkeypatch) -> None:
    """MaxScore over the postings: with a query's common terms left out of the scan (their
    document frequencies kept in ``cwm_index_terms``, equal to the postings' through adds and
    removes), the best documents and their scores are the in-process corpus's; where the
    floor it finds is too low to leave them out, every posting is read instead, with the same
    answer."""
    from contextlib import contextmanager

    from cwm_plugin.memory.index.pg import bm25 as pg_bm25

    rng = random.Random(11)
    common = ("hiking", "painting", "pottery", "harbour")  # in most documents
    mine, docs = BM25Corpus(), {}
    with truth.connection() as conn:
        for step in range(4):
            batch = {f"d{step}-{i}": " ".join(
                [*rng.sample(common, 3), *(f"{rng.choice(WORDS[:12])}{rng.randint(0, 12)}"
                                            for _ in range(rng.randint(1, 6)))])
                for i in range(60)}
            with conn.transaction():
                add_docs(conn, "sp/p", CHUNKS, batch.items())
                gone = rng.sample(sorted(docs), min(len(docs), 20))
                remove_docs(conn, "sp/p", CHUNKS, gone)
            for d, t in batch.items():
                mine.add(d, t)
            for d in gone:
                mine.remove(d)
                del docs[d]
            docs.update(batch)
        kept = dict(conn.execute("SELECT term, df FROM cwm_index_terms WHERE space = 'sp/p' "
                                 "AND df > 0").fetchall())
        counted = dict(conn.execute("SELECT term, count(*) FROM cwm_index_postings WHERE "
                                    "space = 'sp/p' GROUP BY term").fetchall())
    assert kept == counted and len(kept) > 10

    ran: list[str] = []

    @contextmanager
    def spying():
        with truth.connection() as conn:
            execute = conn.execute

            def logged(sql, *args, **kw):
                ran.append(str(sql))
                return execute(sql, *args, **kw)
            conn.execute = logged  # type: ignore[method-assign]
            try:
                yield conn
            finally:
                conn.execute = execute  # type: ignore[method-assign]

    monkeypatch.setattr(pg_bm25, "PRUNE_POSTINGS", 0)  # (pruned whatever the corpus's size)
    pg = PgBM25(spying, "sp/p", CHUNKS)
    pruned = 0
    for query in ("hiking painting pottery violin3", "harbour hiking saffron7",
                  "hiking tundra1 kayak2 painting", "hiking pottery", "origami4 harbour",
                  "violin3 violin5 hiking"):
        ran.clear()
        top, want = pg.top(query, 8), mine.top(query, 8)
        assert sorted(top.values()) == pytest.approx(sorted(want.values()), rel=1e-9)
        last = min(want.values())  # (documents tied at the last place may differ)
        assert {d for d, x in top.items() if x > last + 1e-9} == \
            {d for d, x in want.items() if x > last + 1e-9}
        assert all(top[d] == pytest.approx(x, rel=1e-9) for d, x in want.items() if d in top)
        used = [sql for sql in ran if "cand AS MATERIALIZED" in sql]
        whole = [sql for sql in ran if "LIMIT %(n)s" in sql and "cand AS" not in sql]
        assert used or whole
        pruned += bool(used) and not whole
    assert pruned >= 2  # the pruned answer stood, more than once


def test_an_import_and_a_reindex_in_the_database_search_as_one_machine(
        new_service, postgres_url: str, tmp_path: Path) -> None:
    """``cwm memory import`` and ``reindex`` with the index in the database: the imported
    conversations are searchable at once, a reindex (every row dropped, every session indexed
    again) gives the same chunks and the same answers, and both equal the file backend's."""
    from cwm_plugin.memory.service.importer import ImportedConversation, import_sessions
    from cwm_plugin.testing.conversations.dialogues import generate
    from cwm_plugin.testing.conversations.locomo import turn_text

    conv = next(iter(generate(seed=5, conversations=1)))
    convs = [ImportedConversation(f"s{n}", [("user" if i % 2 == 0 else "assistant",
                                             f"{t['speaker']}: {turn_text(t)}")
                                            for i, t in enumerate(turns)],
                                  ts=when.strftime("%Y-%m-%dT%H:%M:%SZ"))
             for n, when, turns in conv.dated_sessions()]
    files = new_service(root=tmp_path / "files")
    pg = new_service(root=tmp_path / "pg", postgres_url=postgres_url, candidates="database")
    got = [import_sessions(svc, "bob", convs, progress=False) for svc in (files, pg)]
    assert got[0].sessions == got[1].sessions and got[0].turns == got[1].turns
    questions = [q["question"] for q in conv.qa[:6]]

    def answers(svc) -> list[list[str]]:
        return [[h.text for h in svc.search("bob", q)] for q in questions]

    want = answers(files)
    assert answers(pg) == want and all(want)
    chunks = pg.index("bob").n_docs
    assert chunks == files.index("bob").n_docs
    assert pg.reindex("bob", progress=False) == chunks
    assert answers(pg) == want


def test_a_large_folder_walks_the_hnsw_graph_and_finds_what_an_exact_scan_finds(
        new_service, postgres_url: str, monkeypatch) -> None:
    """Past ``EXACT_LINES`` a folder's nearest lines come from pgvector's HNSW index (with an
    iterative scan, so another folder's lines in the same table do not crowd this one's out):
    nearly the lines an exact scan finds, nearest first."""
    from cwm_plugin.memory.index.pg import corpus

    rng = random.Random(3)
    pg = new_service(postgres_url=postgres_url, candidates="database")
    for folder in ("big", "other"):
        for s in range(6):
            pg.record_turns(folder, f"s{s}", [("user" if i % 2 == 0 else "assistant",
                                               _text(rng) or "hello") for i in range(40)])
    idx = pg.index("big")
    queries = [pg.embedder.embed([_text(rng)])[0] for _ in range(5)]
    exact = [idx.nearest_lines(q, 20) for q in queries]
    monkeypatch.setattr(corpus, "EXACT_LINES", 0)
    walked = [idx.nearest_lines(q, 20) for q in queries]
    for e, w in zip(exact, walked, strict=True):
        assert len(w) == 20 and len(set(e) & set(w)) >= 18
        assert all(s.startswith("s") for s, _ in w)
    # a search within one session takes that session's chunks, graph walk or not
    assert {h.text for h in pg.search("big", "violin tram", session="s2")} <= \
        {c[0] for c in (idx._chunk(cid) for cid in idx.doc_ids("s2"))}


def test_recency_mmr_and_a_session_filter_rank_as_one_machine(new_service, postgres_url: str,
                                                              tmp_path: Path) -> None:
    """The optional parts of a search (recency decay from the newest chunk, MMR's diversity,
    a search within one session) over the database's index: the file backend's passages."""
    rng = random.Random(11)
    over = {"recency_half_life_days": 30.0, "mmr_lambda": 0.7}
    files = new_service(root=tmp_path / "files", **over)
    pg = new_service(root=tmp_path / "pg", postgres_url=postgres_url, candidates="database",
                     **over)
    from datetime import UTC, datetime, timedelta

    for svc in (files, pg):
        for s in range(5):
            svc.record_turns("carol", f"s{s}", [("user", _text(rng) or "hi") for _ in range(12)],
                             ts=datetime(2024, 1, 1, tzinfo=UTC) + timedelta(days=20 * s))
        rng = random.Random(11)  # the same turns for the other backend
    for q in ("violin tram glacier", "mango saffron", "painting hikes comet"):
        for session in (None, "s3"):
            a = files.search("carol", q, session=session)
            b = pg.search("carol", q, session=session)
            assert [h.text for h in a] == [h.text for h in b] and a
            assert all("recency" in h.reasons for h in b)
            assert [h.score for h in b] == pytest.approx([h.score for h in a], abs=1e-5)


def test_a_migrate_with_the_sidecars_settings_builds_the_index_in_the_database(
        new_service, postgres_url: str, tmp_path: Path, capsys) -> None:
    """``cwm memory migrate --config``: the folders copied are indexed in the database with
    the settings' embedder (a progress bar, then what was indexed), so the first search of
    a replica embeds nothing; the index answers as the files do."""
    import yaml

    from cwm_plugin.cli import main
    from cwm_plugin.memory.index.embeddings import HashingEmbedder

    files = new_service(root=tmp_path / "files", embedder=HashingEmbedder())
    rng = random.Random(5)
    for s in range(3):
        files.record_turns("dora", f"s{s}", [("user", _text(rng) or "hi") for _ in range(8)])
    want = [h.text for h in files.search("dora", "violin tram")]
    files.close()
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump({"memory": {
        "root": str(tmp_path / "files"), "tokenizer": "tiktoken:cl100k_base",
        "embedder": {"kind": "hashing"}}}))
    assert main(["memory", "migrate", "--config", str(config), "--postgres-url",
                 postgres_url]) == 0
    assert "indexed in the database: 1 folder(s)" in capsys.readouterr().out
    with psycopg.connect(admin_url(postgres_url)) as db:
        assert db.execute("SELECT count(*) FROM cwm_index_sessions").fetchone()[0] == 3
    pg = new_service(root=tmp_path / "replica", postgres_url=postgres_url,
                     embedder=HashingEmbedder())
    assert pg.indexes.writer.behind("dora") == []  # nothing left to index
    assert [h.text for h in pg.search("dora", "violin tram")] == want


def test_a_lock_timeout_is_an_error_not_a_database_gone(postgres_url: str, truth) -> None:
    """The server refusing one statement (a lock timeout: an ``OperationalError`` in psycopg)
    fails that call and keeps the pool: only a lost connection makes a database 'down'."""
    truth.session_stats("f")
    pool = truth.db._pool
    with psycopg.connect(admin_url(postgres_url)) as other:
        other.execute("LOCK TABLE cwm_memory_sessions IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(psycopg.errors.LockNotAvailable), truth.connection() as conn, \
                conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '100ms'")
            conn.execute("SELECT * FROM cwm_memory_sessions")
        other.rollback()
    assert truth.db._pool is pool and truth.session_stats("f") == {}


def test_a_check_a_migration_raises_is_a_config_error(postgres_url: str) -> None:
    """(pgvector older than 0.8 is refused this way, naming what to run.)"""
    from cwm_plugin.errors import ConfigError
    from cwm_plugin.pg_pool import apply_migrations

    with psycopg.connect(admin_url(postgres_url), autocommit=True) as conn, \
            pytest.raises(ConfigError, match="too old: upgrade"):
        apply_migrations(conn, "cwm_test_schema", 42, ((
            "DO $$ BEGIN RAISE EXCEPTION 'too old: upgrade'; END $$",),), "test")


def test_a_search_never_waits_for_another_replicas_indexing_and_a_gone_session_goes(
        new_service, postgres_url: str) -> None:
    """While another replica holds a session's index row (indexing it), a search answers at
    once without that session's newest turns, and has them once the row is free; a session
    whose truth is gone leaves the index at the next look."""
    svc = new_service(postgres_url=postgres_url, candidates="database")
    svc.record_turns("erin", "s1", [("user", "My kayak is yellow.")])
    svc.record_turns("erin", "s2", [("user", "The origami crane is blue.")])
    space = svc.indexes.writer.space("erin")
    with psycopg.connect(admin_url(postgres_url)) as other:
        other.execute("SELECT 1 FROM cwm_index_sessions WHERE space = %s AND session = 's1' "
                      "FOR UPDATE", (space,))
        svc.files.append_turns("erin", "s1", [Turn("t-new", "user", "The kayak has a lighthouse "
                                                    "sticker.", "2024-01-01T00:00:00Z")])
        t0 = time.monotonic()
        assert not any("sticker" in h.text for h in svc.search("erin", "kayak sticker"))
        assert time.monotonic() - t0 < 5  # (a wait would be the lock timeout, 10 s)
        other.rollback()
    assert any("sticker" in h.text for h in svc.search("erin", "kayak sticker"))
    with psycopg.connect(admin_url(postgres_url), autocommit=True) as db:
        db.execute("DELETE FROM cwm_memory_sessions WHERE folder = 'erin' AND session = 's2'")
    assert not any("origami" in h.text for h in svc.search("erin", "origami crane"))


@pytest.mark.parametrize("pool_size", [4, 1])
def test_a_read_alongside_sees_the_searchs_snapshot_on_a_second_connection(
        postgres_url: str, tmp_path: Path, pool_size: int) -> None:
    """``Reader.alongside`` (a search's keyword side while its vector side runs) reads on
    another connection in the same snapshot: a row committed meanwhile by another writer is
    not seen by it either. With no connection free (a pool of one, held by the search) the
    read runs on the search's own connection instead, with the same answer."""
    from cwm_plugin.memory.index.pg.corpus import Reader

    truth = PostgresTruth(postgres_url, tmp_path / "mem", pool_size=pool_size)
    try:
        with truth.connection() as conn:
            conn.execute("CREATE TABLE snap_probe (x int)")
            conn.execute("INSERT INTO snap_probe VALUES (1)")
            if pool_size > 1:
                with truth.connection():
                    pass  # (a second connection made: the pool grows on demand)
        reader = Reader(truth.connection, truth.spare_connection)

        def count(conn: psycopg.Connection) -> tuple[int, int]:
            return conn.execute("SELECT count(*) FROM snap_probe").fetchone()[0], \
                conn.info.backend_pid

        with reader.snapshot():
            with reader.connection() as conn:
                seen, mine = count(conn)
            with psycopg.connect(admin_url(postgres_url), autocommit=True) as other:
                other.execute("INSERT INTO snap_probe VALUES (2)")
            got, pid = reader.alongside(count)()
        assert seen == got == 1
        assert (pid != mine) == (pool_size > 1)
        assert reader.alongside(count)()[0] == 2  # (outside a snapshot: read as it is now)
    finally:
        truth.close()


def test_an_index_written_before_migrations_3_and_4_is_carried_over(
        postgres_url: str, tmp_path: Path) -> None:
    """A database whose index was written at schema version 2 (postings by text id, no
    document frequencies, no change counters) is brought to the newest version with its rows:
    the postings carried over to document numbers, the frequencies and counters filled, and
    BM25 scores as the in-process corpus over the same documents."""
    from collections import Counter

    from cwm_plugin.memory.index.bm25 import bm25_tokens
    from cwm_plugin.memory.postgres.schema import LOCK_ID, MIGRATIONS, migrate
    from cwm_plugin.pg_pool import apply_migrations

    rng = random.Random(5)
    docs = {f"d{i}": _text(rng) or "violin" for i in range(80)}
    mine = BM25Corpus()
    for d, t in docs.items():
        mine.add(d, t)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        assert apply_migrations(conn, "cwm_schema", LOCK_ID, MIGRATIONS[:2], "memory") == 2
        total = 0
        for d, t in docs.items():  # as version 2's writer wrote them
            freqs = Counter(bm25_tokens(t) or ["_"])
            total += sum(freqs.values())
            conn.execute("INSERT INTO cwm_index_docs (space, corpus, doc, terms) VALUES "
                         "('sp/old', 0, %s, %s)", (d, sorted(freqs)))
            for term, tf in freqs.items():
                conn.execute("INSERT INTO cwm_index_postings (space, corpus, term, doc, tf, len) "
                             "VALUES ('sp/old', 0, %s, %s, %s, %s)",
                             (term, d, tf, sum(freqs.values())))
        conn.execute("INSERT INTO cwm_index_corpora (space, corpus, n, total) VALUES "
                     "('sp/old', 0, %s, %s)", (len(docs), total))
        conn.execute("INSERT INTO cwm_memory_sessions (folder, session, size, version) VALUES "
                     "('old', 's1', 10, 3)")
        assert migrate(conn) == len(MIGRATIONS)
        conn.execute("SELECT set_config('cwm.read', '*', false), "  # (row-level security)
                     "set_config('cwm.spaces', '*', false)")
        counted = dict(conn.execute("SELECT term, count(*) FROM cwm_index_postings WHERE "
                                    "space = 'sp/old' GROUP BY term").fetchall())
        kept = dict(conn.execute("SELECT term, df FROM cwm_index_terms WHERE "
                                 "space = 'sp/old'").fetchall())
        assert kept == counted and sum(counted.values()) > len(docs)
    truth = PostgresTruth(postgres_url, tmp_path / "mem")
    try:
        assert truth.folder_signature("old") == 3
        pg = PgBM25(truth.connection, "sp/old", CHUNKS)
        for query in ("violin tram", "painted hiking glacier", "comet comet harbour"):
            got = pg.scores_of(query, sorted(docs))
            assert {d: s for d, s in got.items() if s} == pytest.approx(mine.scores(query),
                                                                        rel=1e-9)
            assert sorted(pg.top(query, 5).values()) == pytest.approx(
                sorted(mine.top(query, 5).values()), rel=1e-9)
        with truth.connection() as conn:  # and it is written as any other, from here on
            assert add_docs(conn, "sp/old", CHUNKS, [("new", "violin quartz")]) == 1
            assert remove_docs(conn, "sp/old", CHUNKS, ["d0", "new"]) == 2
            conn.execute("TRUNCATE cwm_memory_sessions CASCADE")  # (every folder moves)
        assert truth.folder_signature("old") not in (3, 0)
    finally:
        truth.close()
