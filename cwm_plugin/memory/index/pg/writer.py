"""Keeps a folder's index in PostgreSQL up to date with its truth: each session indexed once,
by whichever replica gets to it first, turn by turn as ``ChunkIndex.add_turns`` does.

A session's index row (``cwm_index_sessions``) says how many bytes of its record run are
indexed, how many lines it has and where its open (last) chunk starts. Indexing a session reads
that row and the turns past ``indexed``, makes their lines and vectors with no lock held (the
line before the first comes from the database: the same ``mix`` context a process-local index
gives), then takes the row's lock (``FOR UPDATE``; ``SKIP LOCKED`` when a search catches up, so
it never waits on another replica's indexing) and, if the row is still as it was read, writes
the lines, their two keyword documents (alone; with their neighbours, the last line's again
since it has a new neighbour), re-chunks from the open chunk and moves the row on, in one
transaction: two replicas never index one turn twice, and a replica killed mid-way leaves the
session as it was. A session whose record run shrank or went is dropped (and indexed from its
start). Writes take their locks in one order (the corpora's rows, then the speakers).

Everything is kept per *space*: the folder under a fingerprint of the settings the lines and
vectors depend on (``persist.fingerprint``), so replicas that embed differently (another model,
bfloat16) never mix their vectors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Any

import numpy as np
import psycopg

from cwm_plugin.memory.index import persist
from cwm_plugin.memory.index.chunking import Unit, chunk_units
from cwm_plugin.memory.index.chunks import ChunkIndex
from cwm_plugin.memory.index.pg.bm25 import CHUNKS, CONTEXT, LINES, add_docs, remove_docs
from cwm_plugin.memory.postgres.truth import PostgresTruth, turns_from

log = logging.getLogger(__name__)
HNSW_LOCK = 0x63776D5F686E73  # "cwm_hns": creating a vector size's HNSW index, once


def vector_text(v: np.ndarray) -> str:
    """pgvector's text form of a vector (float32 values round-trip exactly)."""
    return "[" + ",".join(repr(float(x)) for x in v.tolist()) + "]"


def line_key(session: str, row: int) -> str:
    """A line's keyword document id (``selection/lines.py``'s ``doc_id``)."""
    return f"{session}\x1f{row}"


def with_neighbours(units: list[Unit], row: int) -> str:
    """A line's text with the line before and after it (``selection/lines.py``)."""
    return "\n".join(u.text for u in units[max(0, row - 1):row + 2])


def speaker(text: str) -> str:
    return text.split(": ", 1)[0] if ": " in text else ""


class PgIndexWriter:
    """Indexes sessions of the truth's folders into their spaces (see the module docstring).
    ``shape``: a ``ChunkIndex`` with the folder settings, used for its line making and
    embedding only (it holds nothing)."""

    def __init__(self, truth: PostgresTruth, shape: ChunkIndex) -> None:
        self.truth = truth
        self.shape = shape
        digest = hashlib.sha256(json.dumps(persist.fingerprint(shape), sort_keys=True)
                                .encode()).hexdigest()[:16]
        self.prefix = f"{digest}/"
        truth.db.space_prefixes.add(self.prefix)  # its folders' spaces are in their scope
        self.dims = shape.embedder.dims
        self._hnsw = False
        self._guard = threading.Lock()

    def space(self, folder: str) -> str:
        return self.prefix + folder

    # --- catching up -------------------------------------------------------------------------

    def behind(self, folder: str) -> list[str]:
        """The folder's sessions whose truth holds more (or other) bytes than their index,
        and those indexed whose truth is gone."""
        space = self.space(folder)
        with self.truth.connection() as conn:
            rows = conn.execute(
                "SELECT s.session FROM cwm_memory_sessions s LEFT JOIN cwm_index_sessions i "
                "ON i.space = %s AND i.session = s.session WHERE s.folder = %s AND "
                "coalesce(i.indexed, 0) <> s.size UNION SELECT i.session FROM "
                "cwm_index_sessions i LEFT JOIN cwm_memory_sessions s ON s.folder = %s AND "
                "s.session = i.session WHERE i.space = %s AND i.lines > 0 AND s.session IS "
                "NULL ORDER BY 1", (space, folder, folder, space)).fetchall()
        return [r[0] for r in rows]

    def signature(self, folder: str) -> tuple:
        """Moves when any session of the folder's truth moves (its change counter) or its
        index does (the corpora's counts: every index write or drop moves them); two rows
        read by key, however large the folder: a look at the folder with the same signature
        as the last one has nothing to do."""
        with self.truth.connection() as conn:
            return tuple(conn.execute(
                "SELECT (SELECT n FROM cwm_memory_changes WHERE folder = %s), (SELECT "
                "array_agg(array[corpus, n, total] ORDER BY corpus)::text FROM "
                "cwm_index_corpora WHERE space = %s)", (folder, self.space(folder))).fetchone())

    def catch_up(self, folder: str, bar: Any = None, *, wait: bool = False
                 ) -> tuple[int, bool]:
        """Index every session of the folder that is behind (``bar``: a tqdm bar counting
        sessions); returns the chunks made, and whether every session is caught up (a
        session another replica is indexing right now is left to it unless ``wait``)."""
        made, complete = 0, True
        for session in self.behind(folder):
            got = self.index_session(folder, session, wait=wait)
            made += max(0, got)
            complete &= got >= 0
            if bar is not None:
                bar.update(1)
        return made, complete

    def index_session(self, folder: str, session: str, *, wait: bool = True) -> int:
        """Index what the session's truth holds past its index; returns the chunks made, the
        open one's new version included (0: nothing new; -1: another replica is on it).

        The new lines are made and embedded with no lock held; the writes then take the
        session's index row lock and go in only if the row is still as it was read (another
        replica moved it on meanwhile: read and embed again), all in one transaction."""
        space = self.space(folder)
        self._ensure_hnsw()
        for _ in range(3):
            with self.truth.connection() as conn:
                state = conn.execute(
                    "SELECT indexed, lines, open_row, open_chunk FROM cwm_index_sessions "
                    "WHERE space = %s AND session = %s", (space, session)).fetchone()
                state = tuple(state) if state else (0, 0, 0, None)
                indexed, lines, open_row, open_chunk = state
                size = conn.execute("SELECT size FROM cwm_memory_sessions WHERE folder = %s "
                                    "AND session = %s", (folder, session)).fetchone()
                again = size is None or int(size[0]) < indexed  # gone, or written anew
                if again:
                    lines = open_row = indexed = 0
                    open_chunk = None
                turns, end = turns_from(conn, folder, session, indexed)
                if not turns and not again:
                    return 0
                before = self._units(conn, space, session, min(open_row, max(0, lines - 2)),
                                     lines)
            new = self.shape.units(turns)
            vecs = self.shape.embed_units(before[-1] if before else None, new) if new \
                else np.zeros((0, self.dims), dtype=np.float32)
            with self.truth.connection() as conn, conn.transaction():
                conn.execute("SET LOCAL statement_timeout = '300s'")  # a long session's first
                conn.execute("INSERT INTO cwm_index_sessions (space, session) VALUES (%s, %s) "
                             "ON CONFLICT DO NOTHING", (space, session))
                now = conn.execute(
                    "SELECT indexed, lines, open_row, open_chunk FROM cwm_index_sessions "
                    "WHERE space = %s AND session = %s FOR UPDATE" +
                    ("" if wait else " SKIP LOCKED"), (space, session)).fetchone()
                if now is None:
                    return -1  # another replica is indexing it
                if tuple(now) != state:
                    continue  # moved on since it was read
                if again:
                    self._drop(conn, space, session, state[1])
                if not new:
                    return 0
                return self._write(conn, space, session, before, new, vecs, lines, open_row,
                                   open_chunk, end)
        return -1  # moved on under it three times: the next look does it

    # --- writing -------------------------------------------------------------------------------

    def _write(self, conn: psycopg.Connection, space: str, session: str, before: list[Unit],
               new: list[Unit], vecs: np.ndarray, lines: int, open_row: int,
               open_chunk: str | None, end: int) -> int:
        """Write the session's new lines (``before``: its lines from the open chunk's first,
        or its last two, on), re-chunk from the open chunk and move the index row on."""
        conn.execute(  # (arrays, not COPY: refused under row-level security)
            "INSERT INTO cwm_index_lines (space, session, row, text, turn_id, ts, tokens, dims, "
            "vec) SELECT %s, %s, r, t, i, ts, n, %s, v::vector FROM unnest(%s::int[], "
            "%s::text[], %s::text[], %s::text[], %s::int[], %s::text[]) AS u(r, t, i, ts, n, v)",
            (space, session, self.dims, [lines + i for i in range(len(new))],
             [u.text for u in new], [u.turn_id for u in new], [u.ts for u in new],
             [u.tokens for u in new], [vector_text(v) for _, v in zip(new, vecs, strict=True)]))
        first = lines - len(before)  # the row of before[0]
        every = [*before, *new]
        add_docs(conn, space, LINES, [(line_key(session, lines + i), u.text)
                                      for i, u in enumerate(new)])
        if lines:  # the old last line has a next neighbour now
            remove_docs(conn, space, CONTEXT, [line_key(session, lines - 1)])
        add_docs(conn, space, CONTEXT, [
            (line_key(session, row), with_neighbours(every, row - first))
            for row in range(max(0, lines - 1), lines + len(new))])
        if open_chunk is not None:  # drop the open chunk, re-chunk from its first line
            remove_docs(conn, space, CHUNKS, [open_chunk])
            conn.execute("DELETE FROM cwm_index_chunks WHERE space = %s AND chunk_id = %s",
                         (space, open_chunk))
        tail = every[open_row - first:]
        made = chunk_units(session, tail, self.shape.counter, self.shape.chunk_tokens,
                           self.shape.overlap)
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO cwm_index_chunks (space, chunk_id, session, first_row, end_row, "
                "text, turn_ids, tokens, ts) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (space, chunk_id) DO NOTHING",
                [(space, c.chunk_id, session, open_row + b, open_row + e, c.text, c.turn_ids,
                  c.tokens, c.ts) for b, e, c in made])
        add_docs(conn, space, CHUNKS, [(c.chunk_id, c.text) for _, _, c in made])
        # (last, like every write here, in one order: corpora rows, then speakers)
        conn.cursor().executemany(
            "INSERT INTO cwm_index_speakers (space, speaker) VALUES (%s, %s) "
            "ON CONFLICT DO NOTHING", [(space, s) for s in sorted({speaker(u.text)
                                                                   for u in new})])
        last_b, _, last = made[-1]
        conn.execute("UPDATE cwm_index_sessions SET indexed = %s, lines = %s, open_row = %s, "
                     "open_chunk = %s WHERE space = %s AND session = %s",
                     (end, lines + len(new), open_row + last_b, last.chunk_id, space,
                      session))
        return len(made)

    def _units(self, conn: psycopg.Connection, space: str, session: str, first: int,
               end: int) -> list[Unit]:
        rows = conn.execute(
            "SELECT text, turn_id, ts, tokens FROM cwm_index_lines WHERE space = %s AND "
            "session = %s AND row >= %s AND row < %s ORDER BY row",
            (space, session, first, end)).fetchall()
        return [Unit(*r) for r in rows]

    def _drop(self, conn: psycopg.Connection, space: str, session: str, lines: int) -> None:
        """Forget a session's index (its truth went, or shrank)."""
        keys = [line_key(session, r) for r in range(lines)]
        remove_docs(conn, space, LINES, keys)
        remove_docs(conn, space, CONTEXT, keys)
        chunks = [r[0] for r in conn.execute(
            "DELETE FROM cwm_index_chunks WHERE space = %s AND session = %s RETURNING chunk_id",
            (space, session)).fetchall()]
        remove_docs(conn, space, CHUNKS, chunks)
        conn.execute("DELETE FROM cwm_index_lines WHERE space = %s AND session = %s",
                     (space, session))
        conn.execute("UPDATE cwm_index_sessions SET indexed = 0, lines = 0, open_row = 0, "
                     "open_chunk = NULL WHERE space = %s AND session = %s", (space, session))

    def drop_folder(self, folder: str) -> None:
        """Forget the folder's whole index in this space (a rebuild follows: an operator's
        command, with no statement timeout)."""
        with self.truth.connection() as conn, conn.transaction():
            conn.execute("SET LOCAL statement_timeout = 0")
            for table in ("cwm_index_sessions", "cwm_index_lines", "cwm_index_chunks",
                          "cwm_index_docs", "cwm_index_postings", "cwm_index_corpora",
                          "cwm_index_speakers", "cwm_index_terms"):
                conn.execute(f"DELETE FROM {table} WHERE space = %s",  # noqa: S608 - constants
                             (self.space(folder),))

    def _ensure_hnsw(self) -> None:
        """The HNSW index of this vector size (made once, by whichever replica is first)."""
        if self._hnsw:
            return
        with self._guard:
            if self._hnsw:
                return
            d = int(self.dims)
            with self.truth.connection() as conn, conn.transaction():
                if conn.execute("SELECT to_regclass(%s)", (f"cwm_index_lines_hnsw_{d}",)
                                ).fetchone()[0] is not None:
                    self._hnsw = True  # (made already: no lock on the table for it)
                    return
                conn.execute("SET LOCAL statement_timeout = 0")
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (HNSW_LOCK,))
                conn.execute(
                    f"CREATE INDEX IF NOT EXISTS cwm_index_lines_hnsw_{d} ON cwm_index_lines "  # noqa: S608 - an int
                    f"USING hnsw ((vec::vector({d})) vector_ip_ops) WHERE dims = {d}")
            self._hnsw = True

