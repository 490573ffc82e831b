"""Durable catalog of the local disk tier in SQLite: key -> blob, blob sizes, refcounts, pins.

The file lives at ``<disk_path>/index.sqlite`` in WAL mode, so several processes can open it at
once: vLLM's scheduler process answers ``contains_many`` from it while the worker process
writes. A row in ``blobs`` means the blob's file is complete on disk (the file is renamed into
place *before* the row is committed, and the row is deleted *before* the file is unlinked), so
a reader that finds a key here always finds its file. A blob's reference count is the number of
``keys`` rows that point to it; it is never stored separately, so it cannot drift.

Pins belong to keys (table ``pins``): a blob is protected from eviction while any pinned key
points to it, so unpinning one clone's key never unprotects the window it was cloned from. A
pin may be recorded before its key's mapping lands (write-behind); it protects from then on.
``stats`` keeps the total bytes and blobs, maintained by triggers in the same transactions as
the rows, so usage is one row read in every process. ``created`` lets ``gc`` leave young
unreferenced blobs alone (a writer between adding a blob and mapping its key).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (
    blob_id TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,      -- format 1 per-blob pins, migrated to pins
    last_access REAL NOT NULL,
    created REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS keys (
    key BLOB PRIMARY KEY,
    blob_id TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS keys_by_blob ON keys(blob_id);
CREATE INDEX IF NOT EXISTS blobs_by_access ON blobs(last_access);
CREATE TABLE IF NOT EXISTS pins (key BLOB PRIMARY KEY);
CREATE TABLE IF NOT EXISTS stats (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    bytes INTEGER NOT NULL,
    blobs INTEGER NOT NULL
);
"""
TRIGGERS = """
CREATE TRIGGER IF NOT EXISTS blobs_added AFTER INSERT ON blobs BEGIN
    UPDATE stats SET bytes = bytes + NEW.size, blobs = blobs + 1 WHERE id = 0;
END;
CREATE TRIGGER IF NOT EXISTS blobs_removed AFTER DELETE ON blobs BEGIN
    UPDATE stats SET bytes = bytes - OLD.size, blobs = blobs - 1 WHERE id = 0;
END;
"""
CHUNK = 500   # SQLite host-parameter batches
_PROTECTED = "SELECT k.blob_id FROM keys k JOIN pins p ON p.key = k.key"


def _chunks(items: Sequence, n: int = CHUNK) -> Iterator[Sequence]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


class BlobIndex:
    """Thread-safe (one connection behind a lock) and multi-process-safe (WAL, busy timeout)."""

    def __init__(self, path: str | Path, *, timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), timeout=timeout_s, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        with self._write() as db:
            for stmt in SCHEMA.strip().split(";"):
                if stmt.strip():
                    db.execute(stmt)
            self._migrate(db)

    @staticmethod
    def _migrate(db: sqlite3.Connection) -> None:
        """Bring an index made by an older version up to date (inside the opening transaction)."""
        cols = {row[1] for row in db.execute("PRAGMA table_info(blobs)")}
        if "created" not in cols:          # older rows count as old enough to collect
            db.execute("ALTER TABLE blobs ADD COLUMN created REAL NOT NULL DEFAULT 0")
        # per-blob pins of format 1 become pins of every key of the blob
        db.execute("INSERT OR IGNORE INTO pins(key) SELECT key FROM keys WHERE blob_id IN "
                   "(SELECT blob_id FROM blobs WHERE pinned=1)")
        db.execute("UPDATE blobs SET pinned=0 WHERE pinned=1")
        if db.execute("SELECT 1 FROM stats WHERE id=0").fetchone() is None:
            db.execute("INSERT INTO stats(id, bytes, blobs) SELECT 0, COALESCE(SUM(size), 0), "
                       "COUNT(*) FROM blobs")
        for stmt in TRIGGERS.strip().split("END;"):
            if stmt.strip():
                db.execute(stmt + "END;")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, args: Iterable = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # --- keys ---------------------------------------------------------------------------------

    def lookup_many(self, keys: Sequence[bytes]) -> dict[bytes, str]:
        out: dict[bytes, str] = {}
        for part in _chunks(list(keys)):
            q = ",".join("?" * len(part))
            for key, blob in self._read(f"SELECT key, blob_id FROM keys WHERE key IN ({q})", part):
                out[bytes(key)] = blob
        return out

    def lookup(self, key: bytes) -> str | None:
        return self.lookup_many([key]).get(key)

    def map_key(self, key: bytes, blob_id: str) -> bool:
        """Point a new ``key`` at a blob that is in the index; False if the blob is not
        (evicted). A key that already points somewhere keeps its blob (first writer wins)."""
        with self._write() as db:
            if db.execute("SELECT 1 FROM blobs WHERE blob_id=?", (blob_id,)).fetchone() is None:
                return False
            db.execute("INSERT OR IGNORE INTO keys(key, blob_id) VALUES(?, ?)", (key, blob_id))
            return True

    def repoint(self, key: bytes, blob_id: str) -> tuple[bool, str | None, int]:
        """Point ``key`` at ``blob_id`` whether or not it points elsewhere (a link onto an
        existing key). Returns (done, the blob it pointed to before if another one,
        references left to that one); done is False if ``blob_id`` is not in the index."""
        with self._write() as db:
            if db.execute("SELECT 1 FROM blobs WHERE blob_id=?", (blob_id,)).fetchone() is None:
                return False, None, 0
            row = db.execute("SELECT blob_id FROM keys WHERE key=?", (key,)).fetchone()
            if row is not None and row[0] == blob_id:
                return True, None, 0
            db.execute("INSERT OR REPLACE INTO keys(key, blob_id) VALUES(?, ?)", (key, blob_id))
            if row is None:
                return True, None, 0
            (left,) = db.execute("SELECT COUNT(*) FROM keys WHERE blob_id=?", row).fetchone()
            return True, row[0], int(left)

    def unmap_key(self, key: bytes) -> tuple[str | None, int]:
        """Remove ``key`` and its pin; returns (its blob id, references left to that blob)."""
        with self._write() as db:
            db.execute("DELETE FROM pins WHERE key=?", (key,))
            row = db.execute("SELECT blob_id FROM keys WHERE key=?", (key,)).fetchone()
            if row is None:
                return None, 0
            db.execute("DELETE FROM keys WHERE key=?", (key,))
            (left,) = db.execute("SELECT COUNT(*) FROM keys WHERE blob_id=?", row).fetchone()
            return row[0], int(left)

    def keys_of(self, blob_id: str) -> list[bytes]:
        return [bytes(k) for (k,) in self._read("SELECT key FROM keys WHERE blob_id=?", (blob_id,))]

    def refcount(self, blob_id: str) -> int:
        return int(self._read("SELECT COUNT(*) FROM keys WHERE blob_id=?", (blob_id,))[0][0])

    # --- pins (per key) -----------------------------------------------------------------------

    def pin_key(self, key: bytes, pinned: bool = True) -> None:
        with self._write() as db:
            if pinned:
                db.execute("INSERT OR IGNORE INTO pins(key) VALUES(?)", (key,))
            else:
                db.execute("DELETE FROM pins WHERE key=?", (key,))

    def is_key_pinned(self, key: bytes) -> bool:
        return bool(self._read("SELECT 1 FROM pins WHERE key=?", (key,)))

    def is_pinned(self, blob_id: str) -> bool:
        """True while any pinned key points to the blob."""
        return bool(self._read(f"SELECT 1 FROM ({_PROTECTED}) WHERE blob_id=? LIMIT 1",
                               (blob_id,)))

    # --- blobs --------------------------------------------------------------------------------

    def add_blob(self, blob_id: str, size: int, *, key: bytes | None = None) -> None:
        """Record a complete blob file and, in the same transaction, map ``key`` to it (so no
        ``gc`` ever sees the new blob unreferenced)."""
        now = time.time()
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO blobs(blob_id, size, last_access, created) "
                       "VALUES(?, ?, ?, ?)", (blob_id, size, now, now))
            if key is not None:
                db.execute("INSERT OR IGNORE INTO keys(key, blob_id) VALUES(?, ?)",
                           (key, blob_id))

    def has_blob(self, blob_id: str) -> bool:
        return bool(self._read("SELECT 1 FROM blobs WHERE blob_id=?", (blob_id,)))

    def remove_blobs(self, blob_ids: Sequence[str]) -> list[bytes]:
        """Drop blob rows and every key pointing to them; returns the keys dropped."""
        dropped: list[bytes] = []
        with self._write() as db:
            for part in _chunks(list(blob_ids)):
                q = ",".join("?" * len(part))
                dropped += [bytes(k) for (k,) in db.execute(
                    f"SELECT key FROM keys WHERE blob_id IN ({q})", part).fetchall()]
                db.execute(f"DELETE FROM keys WHERE blob_id IN ({q})", part)
                db.execute(f"DELETE FROM blobs WHERE blob_id IN ({q})", part)
        return dropped

    def touch(self, blob_ids: Sequence[str]) -> None:
        if not blob_ids:
            return
        now = time.time()
        with self._write() as db:
            for part in _chunks(list(blob_ids)):
                q = ",".join("?" * len(part))
                db.execute(f"UPDATE blobs SET last_access=? WHERE blob_id IN ({q})", (now, *part))

    def totals(self) -> tuple[int, int]:
        """(bytes, blobs) of every indexed blob (one row, kept by triggers)."""
        size, count = self._read("SELECT bytes, blobs FROM stats WHERE id=0")[0]
        return int(size), int(count)

    def eviction_candidates(self, need: int) -> list[tuple[str, int]]:
        """Least recently used unprotected blobs whose sizes add up to at least ``need``."""
        out: list[tuple[str, int]] = []
        got = 0
        with self._lock:
            cur = self._db.execute(
                f"SELECT blob_id, size FROM blobs WHERE blob_id NOT IN ({_PROTECTED}) "
                "ORDER BY last_access")
            for blob_id, size in cur:
                if got >= need:
                    break
                out.append((blob_id, int(size)))
                got += int(size)
        return out

    def unreferenced(self, min_age_s: float = 0.0) -> list[tuple[str, int]]:
        """Blobs no key points to that were added more than ``min_age_s`` seconds ago."""
        return [(b, int(s)) for b, s in self._read(
            "SELECT blob_id, size FROM blobs WHERE created <= ? AND NOT EXISTS "
            "(SELECT 1 FROM keys WHERE keys.blob_id = blobs.blob_id)",
            (time.time() - min_age_s,))]

    def all_blobs(self) -> list[tuple[str, int]]:
        return [(b, int(s)) for b, s in self._read("SELECT blob_id, size FROM blobs")]

    def dangling_keys(self) -> list[bytes]:
        """Keys whose blob row is missing (should never happen; ``gc`` removes them)."""
        return [bytes(k) for (k,) in self._read(
            "SELECT key FROM keys WHERE blob_id NOT IN (SELECT blob_id FROM blobs)")]

    def drop_keys(self, keys: Sequence[bytes]) -> None:
        with self._write() as db:
            for part in _chunks(list(keys)):
                db.execute(f"DELETE FROM keys WHERE key IN ({','.join('?' * len(part))})", part)

    def close(self) -> None:
        with self._lock:
            self._db.close()
