"""The memory's tables in PostgreSQL, created and upgraded by numbered migrations.

``migrate`` brings a database to :data:`MIGRATIONS`' newest version, each migration in one
transaction under an advisory lock, so replicas starting together apply each exactly once; the
versions applied are kept in ``cwm_schema``. A database newer than this code is refused (a
downgraded replica must not write rows it does not understand). Never edit a migration that has
shipped: add the next one.

Version 1: transcripts as rows of turns (their byte span in the session's record run, so
offsets agree with the file backend's), one row a session (its size and a version that moves
on every append), durable memories (one row each, their order kept) with a per-folder version,
summaries and the background work's cursors. Every table starts with ``folder``: the owner
(tenant, user or project namespace) every query is scoped by.

Version 2: the derived search index in the database (``memory/index/pg/``), so replicas take
their candidates from it instead of each holding the whole index: per ``space`` (the folder
under a fingerprint of the chunking and embedding settings), each session's lines with their
vectors (pgvector; an HNSW index per vector size is made when a size is first written), its
chunks, the BM25 postings of the three keyword corpora (chunks, lines, lines with their
neighbours) with each corpus's document count and length, the speakers, and how far each
session is indexed.

Version 3: each keyword term's document frequency (``cwm_index_terms``), kept with the
postings in the same transactions, so a search reads a term's idf in one row instead of
counting its postings, and can leave out the postings of common terms that cannot lift a
document into the best (``index/pg/bm25.py``); filled from the postings already there. And
a change counter per folder (``cwm_memory_changes``), moved by triggers on every insert, update
or delete of a folder's session rows (an append, or a row an operator deleted or moved by hand;
a truncate moves every folder's), so "did any session of this folder move?" is one row, not a
sum over every session. (Appends to one folder now take turns on its counter row while they
commit: a few milliseconds each.)

Version 4: postings keyed by the document's number (``cwm_index_docs.no``, an identity) instead
of its text id: a search sums and groups a query's postings by an 8-byte integer, and the
postings index is about a third smaller (measured at 100k chunks: a query's BM25 from about
40 to 25 ms); the text id is looked up for the best alone. Existing postings are carried over.

Version 5: row-level security on every table of the memory and its index (``pg_scope``): a row
is visible only when its folder is in the connection's ``cwm.read`` setting (the index's rows:
their space in ``cwm.spaces``), and changed only when its folder is in ``cwm.write`` (the index,
derived from what its reader may read, under ``cwm.spaces``); ``'*'`` is every folder.
FORCE'd, so the tables' owner (the role the sidecar connects as, which ran these migrations) is
bound too; a superuser or a role with BYPASSRLS is not (``migrate`` says so in the log). The
policies' scope is read once a statement (an ``InitPlan``), then compared by plain text equality
row by row. The change counters' trigger runs with every folder in scope (it moves what a
statement changed, a truncate every folder).
"""

from __future__ import annotations

import logging

import psycopg

from cwm_plugin.pg_pool import apply_migrations

log = logging.getLogger(__name__)
# what the change counters' trigger does (versions 3 and 5): a truncate moves every folder's
# counter, a row's insert, delete or update its folder's (an update may move it to another)
_COUNT_CHANGE = """
    IF TG_OP = 'TRUNCATE' THEN
      UPDATE cwm_memory_changes SET n = n + 1;
    ELSE
      IF TG_OP <> 'INSERT' THEN
        INSERT INTO cwm_memory_changes AS c (folder, n) VALUES (OLD.folder, 1)
          ON CONFLICT (folder) DO UPDATE SET n = c.n + 1;
      END IF;
      IF TG_OP = 'INSERT' OR (TG_OP = 'UPDATE' AND NEW.folder <> OLD.folder) THEN
        INSERT INTO cwm_memory_changes AS c (folder, n) VALUES (NEW.folder, 1)
          ON CONFLICT (folder) DO UPDATE SET n = c.n + 1;
      END IF;
    END IF;"""
LOCK_ID = 0x63776D5F6D656D  # "cwm_mem": the advisory lock migrations take

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 1
        """CREATE TABLE cwm_memory_sessions (
            folder text NOT NULL, session text NOT NULL,
            size bigint NOT NULL DEFAULT 0, version bigint NOT NULL DEFAULT 0,
            PRIMARY KEY (folder, session))""",
        """CREATE TABLE cwm_memory_turns (
            folder text NOT NULL, session text NOT NULL,
            start_at bigint NOT NULL, end_at bigint NOT NULL,
            turn_id text NOT NULL, role text NOT NULL, ts text NOT NULL, content text NOT NULL,
            PRIMARY KEY (folder, session, start_at),
            FOREIGN KEY (folder, session) REFERENCES cwm_memory_sessions ON DELETE CASCADE)""",
        """CREATE TABLE cwm_memory_folders (
            folder text PRIMARY KEY, facts_version bigint NOT NULL DEFAULT 0)""",
        """CREATE TABLE cwm_memory_facts (
            folder text NOT NULL REFERENCES cwm_memory_folders ON DELETE CASCADE,
            position integer NOT NULL, id text NOT NULL, text text NOT NULL,
            category text NOT NULL, importance double precision NOT NULL,
            access_count integer NOT NULL, created text NOT NULL, key text NOT NULL,
            source text NOT NULL, replaced_by text NOT NULL, until text NOT NULL,
            PRIMARY KEY (folder, id))""",
        """CREATE TABLE cwm_memory_summaries (
            folder text NOT NULL, session text NOT NULL, text text NOT NULL,
            upto_turn text NOT NULL, updated timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (folder, session))""",
        """CREATE TABLE cwm_memory_cursors (
            folder text NOT NULL, session text NOT NULL, name text NOT NULL,
            turn_id text NOT NULL, PRIMARY KEY (folder, session, name))""",
    ),
    (  # 2
        "CREATE EXTENSION IF NOT EXISTS vector",
        # iterative index scans (a folder's nearest lines in a table of many folders): 0.8
        """DO $$ BEGIN
            IF (SELECT string_to_array(extversion, '.')::int[] FROM pg_extension
                WHERE extname = 'vector') < ARRAY[0, 8] THEN
              RAISE EXCEPTION 'pgvector is older than 0.8: run ALTER EXTENSION vector UPDATE';
            END IF; END $$""",
        """CREATE TABLE cwm_index_sessions (
            space text NOT NULL, session text NOT NULL,
            indexed bigint NOT NULL DEFAULT 0, lines integer NOT NULL DEFAULT 0,
            open_row integer NOT NULL DEFAULT 0, open_chunk text,
            PRIMARY KEY (space, session))""",
        """CREATE TABLE cwm_index_lines (
            space text NOT NULL, session text NOT NULL, row integer NOT NULL,
            text text NOT NULL, turn_id text NOT NULL, ts text NOT NULL, tokens integer NOT NULL,
            dims integer NOT NULL, vec vector NOT NULL,
            PRIMARY KEY (space, session, row))""",
        """CREATE TABLE cwm_index_chunks (
            space text NOT NULL, chunk_id text NOT NULL, session text NOT NULL,
            seq bigserial, first_row integer NOT NULL, end_row integer NOT NULL,
            text text NOT NULL, turn_ids text[] NOT NULL, tokens integer NOT NULL,
            ts text NOT NULL, PRIMARY KEY (space, chunk_id))""",
        "CREATE INDEX cwm_index_chunks_rows ON cwm_index_chunks (space, session, first_row)",
        "CREATE INDEX cwm_index_chunks_ts ON cwm_index_chunks (space, ts)",
        """CREATE TABLE cwm_index_docs (
            space text NOT NULL, corpus smallint NOT NULL, doc text NOT NULL,
            terms text[] NOT NULL, PRIMARY KEY (space, corpus, doc))""",
        """CREATE TABLE cwm_index_postings (
            space text NOT NULL, corpus smallint NOT NULL, term text NOT NULL,
            doc text NOT NULL, tf integer NOT NULL, len integer NOT NULL,
            PRIMARY KEY (space, corpus, term, doc) INCLUDE (tf, len))""",
        """CREATE TABLE cwm_index_corpora (
            space text NOT NULL, corpus smallint NOT NULL, n bigint NOT NULL DEFAULT 0,
            total bigint NOT NULL DEFAULT 0, PRIMARY KEY (space, corpus))""",
        """CREATE TABLE cwm_index_speakers (
            space text NOT NULL, speaker text NOT NULL, PRIMARY KEY (space, speaker))""",
    ),
    (  # 3
        """CREATE TABLE cwm_index_terms (
            space text NOT NULL, corpus smallint NOT NULL, term text NOT NULL,
            df bigint NOT NULL, PRIMARY KEY (space, corpus, term))""",
        """INSERT INTO cwm_index_terms (space, corpus, term, df)
            SELECT space, corpus, term, count(*) FROM cwm_index_postings
            GROUP BY space, corpus, term""",
        """CREATE TABLE cwm_memory_changes (
            folder text PRIMARY KEY, n bigint NOT NULL DEFAULT 0)""",
        """INSERT INTO cwm_memory_changes (folder, n)
            SELECT folder, sum(version) FROM cwm_memory_sessions GROUP BY folder""",
        "CREATE FUNCTION cwm_memory_changed() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN {_COUNT_CHANGE} RETURN NULL; END $$",
        """CREATE TRIGGER cwm_memory_sessions_changed
            AFTER INSERT OR UPDATE OR DELETE ON cwm_memory_sessions
            FOR EACH ROW EXECUTE FUNCTION cwm_memory_changed()""",
        """CREATE TRIGGER cwm_memory_sessions_truncated
            AFTER TRUNCATE ON cwm_memory_sessions
            FOR EACH STATEMENT EXECUTE FUNCTION cwm_memory_changed()""",
    ),
    (  # 4
        "ALTER TABLE cwm_index_docs ADD COLUMN no bigint GENERATED BY DEFAULT AS IDENTITY",
        "CREATE UNIQUE INDEX cwm_index_docs_no ON cwm_index_docs (no)",
        """CREATE TABLE cwm_index_postings_by_no (
            space text NOT NULL, corpus smallint NOT NULL, term text NOT NULL,
            no bigint NOT NULL, tf integer NOT NULL, len integer NOT NULL)""",
        """INSERT INTO cwm_index_postings_by_no (space, corpus, term, no, tf, len)
            SELECT p.space, p.corpus, p.term, d.no, p.tf, p.len FROM cwm_index_postings p
            JOIN cwm_index_docs d USING (space, corpus, doc)
            ORDER BY p.space, p.corpus, p.term, d.no""",
        "DROP TABLE cwm_index_postings",
        "ALTER TABLE cwm_index_postings_by_no RENAME TO cwm_index_postings",
        """ALTER TABLE cwm_index_postings ADD CONSTRAINT cwm_index_postings_pkey
            PRIMARY KEY (space, corpus, term, no) INCLUDE (tf, len)""",
    ),
)


def _policies(column: str, table: str, *, read: str, write: str) -> tuple[str, ...]:
    """Row-level security on ``table`` by ``column`` (version 5, see the module docstring)."""
    def sees(setting: str) -> str:
        return f"((SELECT cwm_scope_all('{setting}')) OR " \
               f"{column} = ANY ((SELECT cwm_scope('{setting}'))::text[]))"
    return (f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY",
            f"ALTER TABLE {table} FORCE ROW LEVEL SECURITY",
            f"CREATE POLICY cwm_read ON {table} FOR SELECT USING {sees(read)}",
            f"CREATE POLICY cwm_write ON {table} FOR ALL USING {sees(write)} "
            f"WITH CHECK {sees(write)}")


TRUTH_TABLES = ("cwm_memory_sessions", "cwm_memory_turns", "cwm_memory_folders",
                "cwm_memory_facts", "cwm_memory_summaries", "cwm_memory_cursors",
                "cwm_memory_changes")
INDEX_TABLES = ("cwm_index_sessions", "cwm_index_lines", "cwm_index_chunks", "cwm_index_docs",
                "cwm_index_postings", "cwm_index_corpora", "cwm_index_speakers",
                "cwm_index_terms")
MIGRATIONS += ((  # 5
    """CREATE FUNCTION cwm_scope(setting text) RETURNS text[] LANGUAGE sql STABLE
        PARALLEL SAFE AS $$ SELECT string_to_array(current_setting(setting, true), ',') $$""",
    """CREATE FUNCTION cwm_scope_all(setting text) RETURNS boolean LANGUAGE sql STABLE
        PARALLEL SAFE AS $$ SELECT coalesce(current_setting(setting, true) = '*', false) $$""",
    # the change counters' trigger moves every folder a statement changed (a truncate moves
    # all, and a truncate or cascade ignores row-level security), whatever the scope: it
    # widens the scope for its own statements and puts it back (a role that is no superuser
    # may not pin a custom setting on a function with ALTER FUNCTION ... SET)
    "CREATE OR REPLACE FUNCTION cwm_memory_changed() RETURNS trigger LANGUAGE plpgsql AS $$ "
    "DECLARE was_read text := current_setting('cwm.read', true); "
    "        was_write text := current_setting('cwm.write', true); "
    "BEGIN PERFORM set_config('cwm.read', '*', true), set_config('cwm.write', '*', true); "
    f"{_COUNT_CHANGE} "
    "PERFORM set_config('cwm.read', coalesce(was_read, ''), true), "
    "        set_config('cwm.write', coalesce(was_write, ''), true); "
    "RETURN NULL; END $$",
    *(s for t in TRUTH_TABLES for s in _policies("folder", t, read="cwm.read",
                                                 write="cwm.write")),
    *(s for t in INDEX_TABLES for s in _policies("space", t, read="cwm.spaces",
                                                 write="cwm.spaces")),
),)


def migrate(conn: psycopg.Connection) -> int:
    """Apply the migrations the database lacks; returns its version now. Says in the log when
    the role connected bypasses row-level security (a superuser, or BYPASSRLS)."""
    version = apply_migrations(conn, "cwm_schema", LOCK_ID, MIGRATIONS, "memory")
    row = conn.execute("SELECT current_user, rolsuper OR rolbypassrls FROM pg_roles "
                       "WHERE rolname = current_user").fetchone()
    if row is not None and row[1]:
        log.warning("the memory database's role %s bypasses row-level security (a superuser "
                    "or BYPASSRLS): every query is still scoped by folder in the code, but the "
                    "database does not check it; connect as a role without either "
                    "(docs/replicas.md)", row[0])
    return version
