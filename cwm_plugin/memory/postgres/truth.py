"""``PostgresTruth``: the memory's transcripts, durable memories, summaries and cursors in
PostgreSQL, so that every sidecar replica reads and writes one memory.

It keeps the contract of the markdown files (``files/truth.py``): a session is an append-only
run of encoded turn records, each row holding its byte span, so the indexes built from it are
the ones the file backend builds from the same turns (the same chunks, the same scores). An
append is one transaction that bumps the session row (``size``, ``version``), which orders
concurrent appends from any replica; a change to the durable memories holds the folder's row
lock from read to write. Derived data (saved indexes, embedding cache, access counts) stays on
each replica's local ``root``.

A database that cannot be reached raises :class:`~cwm_plugin.errors.MemoryUnavailable` (the
sidecar answers without memory meanwhile); the schema is brought up to date on first use, not
at construction, so a replica starts while its database is down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import psycopg

from cwm_plugin.errors import MemoryUnavailable
from cwm_plugin.memory.files.markdown import encode_turn
from cwm_plugin.memory.files.names import check_memory_name
from cwm_plugin.memory.models import Memory, Turn
from cwm_plugin.memory.postgres.schema import migrate
from cwm_plugin.pg_pool import PgPool, Subject

log = logging.getLogger(__name__)
FACT_FIELDS = ("id", "text", "category", "importance", "access_count", "created", "key",
               "source", "replaced_by", "until")


def turns_from(conn: psycopg.Connection, folder: str, session: str, offset: int
               ) -> tuple[list[Turn], int]:
    """The session's turns from byte ``offset`` on, and the offset after the last of them."""
    rows = conn.execute(
        "SELECT turn_id, role, content, ts, end_at FROM cwm_memory_turns WHERE "
        "folder = %s AND session = %s AND start_at >= %s ORDER BY start_at",
        (folder, session, offset)).fetchall()
    return [Turn(*r[:4]) for r in rows], (int(rows[-1][4]) if rows else offset)


class PostgresTruth:
    """One memory in one PostgreSQL database; ``root``: this replica's derived data.

    While the database is down every call raises ``MemoryUnavailable`` at once (``pg_pool``:
    a failed connection drops the pool, a probe a second finds the database again, the outage
    is logged once, and its end)."""

    def __init__(self, url: str, root: Path, *, pool_size: int = 8,
                 timeout_s: float = 5.0) -> None:
        self.root = Path(root)
        self.db = PgPool(url, migrate, Subject(
            "memory database", MemoryUnavailable, "memory.postgres_pool_size",
            "check that PostgreSQL is up and memory.postgres_url is right; turns are "
            "answered without memory until it is back", "turns are answered without memory"),
            pool_size=pool_size, timeout_s=timeout_s, name="cwm-memory", row_security=True)
        self.where = self.db.where

    def _conn(self) -> AbstractContextManager[psycopg.Connection]:
        return self.db.connection()

    def connection(self) -> AbstractContextManager[psycopg.Connection]:
        """A pooled connection (autocommit) for the derived index's tables
        (``memory/index/pg/``), failing as the truth's own calls do when the database is gone."""
        return self.db.connection()

    def spare_connection(self) -> AbstractContextManager[psycopg.Connection | None]:
        """Another pooled connection if one is free at once, else None (``PgPool.spare``)."""
        return self.db.spare()

    def close(self) -> None:
        self.db.close()

    # --- transcripts -------------------------------------------------------------------------

    def folders(self) -> list[str]:
        with self._conn() as conn:
            rows = conn.execute("SELECT folder FROM cwm_memory_sessions UNION "
                                "SELECT folder FROM cwm_memory_folders ORDER BY 1").fetchall()
        return [r[0] for r in rows]

    def sessions(self, folder: str) -> list[str]:
        return sorted(self.session_stats(folder))

    def append_turns(self, folder: str, session: str, turns: list[Turn]) -> tuple[int, int]:
        """Append the records in one transaction; their ``(start, end)`` byte offsets."""
        _names(folder, session)
        turns = [Turn(t.turn_id, t.role, _text(t.content), t.ts) for t in turns]
        sizes = [len(encode_turn(t)) for t in turns]
        with self._conn() as conn, conn.transaction():
            row = conn.execute(
                "INSERT INTO cwm_memory_sessions AS s (folder, session, size, version) "
                "VALUES (%s, %s, %s, 1) ON CONFLICT (folder, session) DO UPDATE SET "
                "size = s.size + excluded.size, version = s.version + 1 RETURNING s.size",
                (folder, session, sum(sizes))).fetchone()
            end = int(row[0])
            at = start = end - sum(sizes)
            spans = []
            for t, n in zip(turns, sizes, strict=True):
                spans.append((folder, session, at, at + n, t.turn_id, t.role, t.ts, t.content))
                at += n
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO cwm_memory_turns (folder, session, start_at, end_at, turn_id, "
                    "role, ts, content) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)", spans)
        return start, end

    def read_turns(self, folder: str, session: str) -> list[Turn]:
        return self.read_turns_from(folder, session, 0)[0]

    def read_turns_from(self, folder: str, session: str, offset: int
                        ) -> tuple[list[Turn], int]:
        """The turns from byte ``offset`` on, and the offset after the last of them."""
        _names(folder, session)
        with self._conn() as conn:
            return turns_from(conn, folder, session, offset)

    def session_stats(self, folder: str) -> dict[str, tuple[int, int]]:
        check_memory_name("folder", folder)
        with self._conn() as conn:
            rows = conn.execute("SELECT session, size, version FROM cwm_memory_sessions "
                                "WHERE folder = %s", (folder,)).fetchall()
        return {r[0]: (int(r[1]), int(r[2])) for r in rows}

    def folder_signature(self, folder: str) -> int:
        """The folder's change counter (``cwm_memory_changes``): a trigger moves it with every
        insert, update or delete of one of its session rows (each append moves its session's
        row), so it moves with any session of the folder; one row, however many sessions."""
        check_memory_name("folder", folder)
        with self._conn() as conn:
            row = conn.execute("SELECT n FROM cwm_memory_changes WHERE folder = %s",
                               (folder,)).fetchone()
        return int(row[0]) if row else 0

    def session_stat(self, folder: str, session: str) -> tuple[int, int] | None:
        _names(folder, session)
        with self._conn() as conn:
            row = conn.execute("SELECT size, version FROM cwm_memory_sessions WHERE "
                               "folder = %s AND session = %s", (folder, session)).fetchone()
        return (int(row[0]), int(row[1])) if row else None

    def session_data(self, folder: str, session: str) -> tuple[bytes, int] | None:
        """The session's record run and its version, read in one statement (one snapshot)."""
        _names(folder, session)
        with self._conn() as conn:
            rows = conn.execute(
                "SELECT s.version, t.turn_id, t.role, t.content, t.ts FROM cwm_memory_sessions "
                "s LEFT JOIN cwm_memory_turns t USING (folder, session) WHERE s.folder = %s "
                "AND s.session = %s ORDER BY t.start_at", (folder, session)).fetchall()
        if not rows:
            return None
        data = b"".join(encode_turn(Turn(*r[1:])) for r in rows if r[1] is not None)
        return data, int(rows[0][0])

    # --- durable memories ----------------------------------------------------------------------

    def read_memories(self, folder: str, *, history: bool = False) -> list[Memory]:
        mems = self.scan_memories(folder)[0]
        return mems if history else [m for m in mems if m.active]

    def scan_memories(self, folder: str) -> tuple[list[Memory], list[tuple[int, str]]]:
        """``(every memory, [])``: rows are typed, there is no unparseable line here."""
        check_memory_name("folder", folder)
        with self._conn() as conn:
            return _facts(conn, folder), []

    def update_memories(self, folder: str, fn: Callable[[list[Memory]], list[Memory]]
                        ) -> list[Memory]:
        """Read, change and write back the folder's memories holding its row lock, so two
        replicas merging facts into one folder take turns (the memories in force first, then
        the replaced ones, as the file keeps them)."""
        check_memory_name("folder", folder)
        with self._conn() as conn, conn.transaction():
            conn.execute("INSERT INTO cwm_memory_folders (folder) VALUES (%s) "
                         "ON CONFLICT DO NOTHING", (folder,))
            conn.execute("SELECT 1 FROM cwm_memory_folders WHERE folder = %s FOR UPDATE",
                         (folder,))
            mems = fn(_facts(conn, folder))
            ordered = [m for m in mems if m.active] + [m for m in mems if not m.active]
            conn.execute("DELETE FROM cwm_memory_facts WHERE folder = %s", (folder,))
            with conn.cursor() as cur:
                cur.executemany(
                    f"INSERT INTO cwm_memory_facts (folder, position, {', '.join(FACT_FIELDS)}) "
                    f"VALUES (%s, %s{', %s' * len(FACT_FIELDS)})",
                    [(folder, i, *(_text(v) if isinstance(v, str) else v
                                   for v in (getattr(m, f) for f in FACT_FIELDS)))
                     for i, m in enumerate(ordered)])
            conn.execute("UPDATE cwm_memory_folders SET facts_version = facts_version + 1 "
                         "WHERE folder = %s", (folder,))
        return mems

    def memories_signature(self, folder: str) -> tuple[int, int] | None:
        check_memory_name("folder", folder)
        with self._conn() as conn:
            row = conn.execute("SELECT facts_version FROM cwm_memory_folders WHERE folder = %s",
                               (folder,)).fetchone()
        return (0, int(row[0])) if row else None

    # --- summaries and cursors -----------------------------------------------------------------

    def read_summary(self, folder: str, session: str) -> tuple[str, str] | None:
        row = self._one("SELECT text, upto_turn FROM cwm_memory_summaries WHERE folder = %s "
                        "AND session = %s", folder, session)
        return (row[0], row[1]) if row else None

    def write_summary(self, folder: str, session: str, text: str, upto_turn: str) -> None:
        self._one("INSERT INTO cwm_memory_summaries (folder, session, text, upto_turn) VALUES "
                  "(%s, %s, %s, %s) ON CONFLICT (folder, session) DO UPDATE SET text = "
                  "excluded.text, upto_turn = excluded.upto_turn, updated = now() RETURNING 1",
                  folder, session, _text(text.strip()), upto_turn)

    def read_cursor(self, folder: str, session: str, name: str) -> str:
        row = self._one("SELECT turn_id FROM cwm_memory_cursors WHERE folder = %s AND "
                        "session = %s AND name = %s", folder, session, name)
        return row[0] if row else ""

    def write_cursor(self, folder: str, session: str, name: str, turn_id: str) -> None:
        self._one("INSERT INTO cwm_memory_cursors (folder, session, name, turn_id) VALUES "
                  "(%s, %s, %s, %s) ON CONFLICT (folder, session, name) DO UPDATE SET "
                  "turn_id = excluded.turn_id RETURNING 1", folder, session, name, turn_id)

    def _one(self, sql: str, folder: str, session: str, *more: object) -> tuple | None:
        """One statement on one session's row (its names checked first); its row or None."""
        _names(folder, session)
        with self._conn() as conn:
            return conn.execute(sql, (folder, session, *more)).fetchone()  # type: ignore[arg-type]


def _text(value: str) -> str:
    """PostgreSQL's text holds no NUL character: one in a turn or a fact (JSON allows it) is
    kept as U+FFFD, not refused."""
    return value.replace("\x00", "\ufffd") if "\x00" in value else value


def _names(folder: str, session: str) -> None:
    check_memory_name("folder", folder)
    check_memory_name("session", session)


def _facts(conn: psycopg.Connection, folder: str) -> list[Memory]:
    rows = conn.execute(f"SELECT {', '.join(FACT_FIELDS)} FROM cwm_memory_facts WHERE "
                        "folder = %s ORDER BY position", (folder,)).fetchall()
    return [Memory(**dict(zip(FACT_FIELDS, r, strict=True))) for r in rows]
