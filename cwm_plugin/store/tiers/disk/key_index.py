"""The disk tier's key index in SQLite: keys -> blobs, reference counts, pins, usage.

``<disk_path>/index.sqlite`` in WAL mode, shared by every process of a server (vLLM's
scheduler looks keys up while its workers write). Invariants, kept inside SQLite:

* A ``blobs`` row means the blob's file is complete (renamed into place *before* the row is
  committed; the row deleted *before* the file is unlinked).
* ``blobs.refs`` and ``blobs.pins`` (keys, and pinned unexpired keys, pointing to the blob;
  a lease, ``keys.pinned = 2``, counts twice there, and only the pin quota tells them apart),
  ``group_pins`` (pinned blob bytes per key group) and ``stats`` are maintained by triggers in
  the same transaction as the rows they count, so they cannot drift, and eviction reads the
  partial index ``blobs(last_access) WHERE pins = 0``: its cost does not grow with pins.
* Every batch operation is one ``BEGIN IMMEDIATE`` transaction: a process killed in the middle
  leaves the old state or the new one.

Lookups read through connections of their own and never wait for a writer, which waits for
SQLite's write lock (another process's) with a deadline on every call (:mod:`.db`). A
file that is not a database or fails its integrity check raises :class:`IndexDamaged`; the
disk tier then moves it aside and rebuilds from the blob files.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from cwm_plugin.errors import CWMError
from cwm_plugin.store.tiers.disk.db import IndexDB, is_damage_error, is_lock_error
from cwm_plugin.store.tiers.disk.schema import (
    LEASE_ONLY_BYTES,
    LEASED,
    SCHEMA_VERSION,
    create_schema,
    schema_version,
)

Unlink = Callable[[Sequence[str]], None] | None
CHUNK = 500   # SQLite host-parameter batches
KeyRow = tuple[bytes, str, bool, float | None, int | None, bool]


class IndexDamaged(CWMError):
    """The index file is not a usable SQLite database (damaged disk, foreign file)."""

    code = "index_damaged"


def _row(key: bytes, blob_id: str, pinned: int, expires: float | None, size: int | None
         ) -> KeyRow:
    """A key's row as :class:`~cwm_plugin.store.tiers.base.KeyInfo`'s fields."""
    return bytes(key), blob_id, bool(pinned), expires, size, pinned == LEASED


def _chunks(items: Sequence, n: int = CHUNK) -> Iterator[Sequence]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def _qs(n: int) -> str:
    return ",".join("?" * n)


class DiskKeyIndex:
    """Thread-safe and multi-process-safe (WAL; connections and deadlines: :mod:`.db`)."""

    def __init__(self, path: str | Path, *, timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self.timeout_s = timeout_s
        try:
            self.db = IndexDB(self.path, timeout_s=timeout_s)
            try:
                self._init_schema()
            except BaseException:
                self.db.close()
                raise
        except sqlite3.DatabaseError as exc:
            if not is_damage_error(exc):  # a full disk, an I/O error, a lock held too long: the
                raise              # index is fine, the disk is not (the tier is unavailable)
            raise IndexDamaged(f"store index {self.path} is unusable: {exc}",
                               hint="it is moved aside and rebuilt from the blob files") from exc

    def _init_schema(self) -> None:
        """Create the schema in a write transaction, only if it is not there yet: every
        ``cwm store`` run opens the index, and a write lock taken by a process that runs
        at idle priority (:func:`cwm_plugin.store.cli.yield_to_serving`) would be held for as
        long as serving keeps the cores busy, stalling the server's own writes."""
        try:
            with self.db.reader() as db:
                if schema_version(db) == SCHEMA_VERSION:
                    return
        except sqlite3.OperationalError as exc:
            if not is_lock_error(exc):    # (locked: another process creates it; the write waits)
                raise
        self.db.tx(create_schema)

    # --- keys ---------------------------------------------------------------------------------

    def lookup_many(self, keys: Sequence[bytes]) -> dict[bytes, str]:
        out: dict[bytes, str] = {}
        for part in _chunks([bytes(k) for k in keys]):
            for key, blob in self.db.read(
                    f"SELECT key, blob_id FROM keys WHERE key IN ({_qs(len(part))})", part):
                out[bytes(key)] = blob
        return out

    def add_blob(self, blob_id: str, size: int, key: bytes, *,
                 ensure: Callable[[], None] | None = None, replace: bool = False,
                 unlink: Unlink = None) -> bool:
        """Record a complete blob file and map ``key`` to it in one transaction. A key that
        points to another recorded blob keeps it (first writer wins): False then; with
        ``replace`` it is re-pointed (the old blob freed as in :meth:`link_many`). ``ensure``
        runs inside the transaction before the row is written (the disk tier checks there
        that the file is in place)."""
        now = time.time()
        key = bytes(key)

        def tx(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT blob_id FROM keys WHERE key=?", (key,)).fetchone()
            if not replace and row is not None and row[0] != blob_id and db.execute(
                    "SELECT 1 FROM blobs WHERE blob_id=?", row).fetchone():
                return False
            if ensure is not None:
                ensure()
            db.execute("INSERT OR IGNORE INTO blobs(blob_id, size, grp, last_access, created) "
                       "VALUES(?, ?, ?, ?, ?)", (blob_id, size, key[:18], now, now))
            db.execute("UPDATE blobs SET last_access=? WHERE blob_id=?", (now, blob_id))
            if row is None:
                db.execute("INSERT INTO keys(key, blob_id) VALUES(?, ?)", (key, blob_id))
            elif row[0] != blob_id:
                db.execute("UPDATE keys SET blob_id=? WHERE key=?", (blob_id, key))
                self._free_unreferenced(db, {row[0]}, unlink)
            return True
        return self.db.tx(tx)

    def link_many(self, links: Sequence[tuple[bytes, str]], *, unlink: Unlink = None
                  ) -> list[bytes]:
        """Point keys at recorded blobs (one transaction); returns the keys linked. Blobs left
        without references lose their rows and ``unlink(blob_ids)`` runs inside the
        transaction."""
        def tx(db: sqlite3.Connection) -> list[bytes]:
            done: list[bytes] = []
            old: set[str] = set()
            for key, blob_id in links:
                key = bytes(key)
                if db.execute("SELECT 1 FROM blobs WHERE blob_id=?", (blob_id,)).fetchone() \
                        is None:
                    continue
                row = db.execute("SELECT blob_id FROM keys WHERE key=?", (key,)).fetchone()
                if row is None:
                    db.execute("INSERT INTO keys(key, blob_id) VALUES(?, ?)", (key, blob_id))
                elif row[0] != blob_id:
                    db.execute("UPDATE keys SET blob_id=? WHERE key=?", (blob_id, key))
                    old.add(row[0])
                done.append(key)
            self._free_unreferenced(db, old, unlink)
            return done
        return self.db.tx(tx)

    def delete_many(self, keys: Sequence[bytes], *, unlink: Unlink = None) -> list[bytes]:
        """Drop keys (and pins); returns the keys that were there. Blobs left without
        references are removed as in :meth:`link_many`."""
        def tx(db: sqlite3.Connection) -> list[bytes]:
            found: list[bytes] = []
            blobs: set[str] = set()
            for part in _chunks([bytes(k) for k in keys]):
                rows = db.execute(f"SELECT key, blob_id FROM keys WHERE key IN "
                                  f"({_qs(len(part))})", part).fetchall()
                found += [bytes(k) for k, _ in rows]
                blobs |= {b for _, b in rows}
                db.execute(f"DELETE FROM keys WHERE key IN ({_qs(len(part))})", part)
            self._free_unreferenced(db, blobs, unlink)
            return found
        return self.db.tx(tx)

    @staticmethod
    def _free_unreferenced(db: sqlite3.Connection, blob_ids: set[str], unlink: Unlink) -> None:
        freed: list[str] = []
        for part in _chunks(sorted(blob_ids)):
            freed += [b for (b,) in db.execute(
                f"SELECT blob_id FROM blobs WHERE refs <= 0 AND blob_id IN ({_qs(len(part))})",
                part)]
        for part in _chunks(freed):
            db.execute(f"DELETE FROM blobs WHERE blob_id IN ({_qs(len(part))})", part)
        if freed and unlink is not None:
            unlink(freed)

    # --- pins ---------------------------------------------------------------------------------

    def pin_many(self, keys: Sequence[bytes], *, ttl_s: float | None = None,
                 quota_bytes: int | None = None) -> list[bytes]:
        """Pin present keys (a leased one becomes pinned); with ``quota_bytes``, roll back and
        raise if a group's pinned bytes (leases not counted) would exceed it. Returns the keys
        pinned."""
        from cwm_plugin.store.tiers.base import QuotaExceeded

        expires = None if ttl_s is None else time.time() + ttl_s

        def tx(db: sqlite3.Connection) -> list[bytes]:
            self._expire(db)
            done: list[bytes] = []
            for part in _chunks([bytes(k) for k in keys]):
                q = _qs(len(part))
                done += [bytes(k) for (k,) in db.execute(
                    f"SELECT key FROM keys WHERE key IN ({q})", part)]
                db.execute(f"UPDATE keys SET pinned=1, pin_expires=? WHERE key IN ({q})",
                           (expires, *part))
            if quota_bytes is not None:
                for g in {k[:18] for k in done}:
                    held = self._pinned_bytes(db, g)
                    if held > quota_bytes:
                        raise QuotaExceeded(
                            f"pinning {len(done)} keys would hold {held:,} pinned bytes on "
                            f"disk for one model and rank, over the quota of {quota_bytes:,}",
                            hint="delete or unpin windows, or raise pin_quota_bytes")
            return done
        return self.db.tx(tx)

    @staticmethod
    def _pinned_bytes(db: sqlite3.Connection, grp: bytes) -> int:
        """A group's pinned blob bytes, less those only leases pin."""
        (total,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM group_pins WHERE grp=?",
                              (grp,)).fetchone()
        (leased,) = db.execute(LEASE_ONLY_BYTES + " AND b.grp=?", (grp,)).fetchone()
        return int(total) - int(leased)

    def lease_many(self, keys: Sequence[bytes], *, ttl_s: float) -> list[bytes]:
        """Lease present keys that no pin protects (or a lease shorter than this one) until
        ``ttl_s`` from now, and push a pin expiring sooner out to then; one transaction.
        Returns the keys leased."""
        def tx(db: sqlite3.Connection) -> list[bytes]:
            self._expire(db)
            until = time.time() + ttl_s
            done: list[bytes] = []
            for part in _chunks([bytes(k) for k in keys]):
                q = _qs(len(part))
                free = f"key IN ({q}) AND (pinned=0 OR (pinned={LEASED} AND pin_expires < ?))"
                done += [bytes(k) for (k,) in db.execute(
                    f"SELECT key FROM keys WHERE {free}", (*part, until))]
                db.execute(f"UPDATE keys SET pinned={LEASED}, pin_expires=? WHERE {free}",
                           (until, *part, until))
                db.execute(f"UPDATE keys SET pin_expires=? WHERE key IN ({q}) AND pinned=1 "
                           "AND pin_expires < ?", (until, *part, until))
            return done
        return self.db.tx(tx)

    def unpin_many(self, keys: Sequence[bytes]) -> list[bytes]:
        def tx(db: sqlite3.Connection) -> list[bytes]:
            done: list[bytes] = []
            for part in _chunks([bytes(k) for k in keys]):
                q = _qs(len(part))
                done += [bytes(k) for (k,) in db.execute(
                    f"SELECT key FROM keys WHERE pinned>0 AND key IN ({q})", part)]
                db.execute(f"UPDATE keys SET pinned=0, pin_expires=NULL WHERE key IN ({q})",
                           part)
            return done
        return self.db.tx(tx)

    @staticmethod
    def _expire(db: sqlite3.Connection) -> None:
        db.execute("UPDATE keys SET pinned=0, pin_expires=NULL WHERE pin_expires IS NOT NULL "
                   "AND pin_expires <= ?", (time.time(),))

    def expire_pins(self) -> None:
        if self.db.read("SELECT 1 FROM keys WHERE pin_expires IS NOT NULL AND pin_expires <= ? "
                      "LIMIT 1", (time.time(),)):
            self.db.tx(self._expire)

    def info_many(self, keys: Sequence[bytes]) -> list[KeyRow]:
        out = []
        for part in _chunks([bytes(k) for k in keys]):
            out += [_row(*r) for r in self.db.read(
                "SELECT k.key, k.blob_id, k.pinned, k.pin_expires, b.size FROM keys k LEFT JOIN "
                f"blobs b ON b.blob_id = k.blob_id WHERE k.key IN ({_qs(len(part))})", part)]
        return out

    def list_keys(self, prefix: bytes, after: bytes | None, limit: int) -> list[KeyRow]:
        lo = max(prefix, after + b"\0") if after is not None else prefix
        sql = ("SELECT k.key, k.blob_id, k.pinned, k.pin_expires, b.size FROM keys k LEFT JOIN "
               "blobs b ON b.blob_id = k.blob_id WHERE k.key >= ?")
        args: list = [lo]
        if prefix:
            sql += " AND substr(k.key, 1, ?) = ?"
            args += [len(prefix), prefix]
        rows = self.db.read(sql + " ORDER BY k.key LIMIT ?", (*args, limit))
        return [_row(*r) for r in rows]

    # --- blobs --------------------------------------------------------------------------------

    def has_blob(self, blob_id: str) -> bool:
        return bool(self.db.read("SELECT 1 FROM blobs WHERE blob_id=?", (blob_id,)))

    def remove_blobs(self, blob_ids: Sequence[str], *, unlink: Unlink = None,
                     unpinned_only: bool = False) -> list[bytes]:
        """Drop blob rows and every key pointing to them, ``unlink(blob_ids)`` inside the
        transaction; returns the keys dropped. ``unpinned_only`` (eviction): only the blobs
        no key pins *now*, checked inside the transaction (a pin committed by another process
        since the victims were chosen keeps its blob). Nothing to drop takes no write lock."""
        if not blob_ids:
            return []

        def tx(db: sqlite3.Connection) -> list[bytes]:
            dropped: list[bytes] = []
            ids = list(blob_ids)
            if unpinned_only:
                ids = [b for part in _chunks(ids) for (b,) in db.execute(
                    f"SELECT blob_id FROM blobs WHERE pins = 0 AND blob_id IN "
                    f"({_qs(len(part))})", part)]
            for part in _chunks(ids):
                q = _qs(len(part))
                dropped += [bytes(k) for (k,) in db.execute(
                    f"SELECT key FROM keys WHERE blob_id IN ({q})", part)]
                db.execute(f"DELETE FROM keys WHERE blob_id IN ({q})", part)
                db.execute(f"DELETE FROM blobs WHERE blob_id IN ({q})", part)
            if unlink is not None:
                unlink(ids)
            return dropped
        return self.db.tx(tx)

    def touch(self, blob_ids: Sequence[str], *, timeout_s: float | None = None) -> None:
        """Mark blobs used now (LRU); "database is locked" past ``timeout_s``."""
        if not blob_ids:
            return
        now = time.time()

        def tx(db: sqlite3.Connection) -> None:
            for part in _chunks(list(blob_ids)):
                db.execute(f"UPDATE blobs SET last_access=? WHERE blob_id IN ({_qs(len(part))})",
                           (now, *part))
        self.db.tx(tx, timeout_s)

    def refcount(self, blob_id: str) -> int:
        rows = self.db.read("SELECT refs FROM blobs WHERE blob_id=?", (blob_id,))
        return int(rows[0][0]) if rows else 0

    def totals(self) -> tuple[int, int]:
        """(bytes, blobs) of every recorded blob (one row, kept by triggers)."""
        size, count = self.db.read("SELECT bytes, blobs FROM stats WHERE id=0")[0]
        return int(size), int(count)

    def counts(self) -> tuple[int, int]:
        """(keys, pinned blob bytes: those only leases pin not counted)."""
        (keys,) = self.db.read("SELECT COUNT(*) FROM keys")[0]
        (pinned,) = self.db.read("SELECT COALESCE(SUM(bytes), 0) FROM group_pins")[0]
        (leased,) = self.db.read(LEASE_ONLY_BYTES)[0]
        return int(keys), int(pinned) - int(leased)

    def eviction_candidates(self, need: int) -> list[tuple[str, int]]:
        """Least recently used unpinned blobs whose sizes add up to at least ``need``."""
        out: list[tuple[str, int]] = []
        got = 0
        with self.db.reader() as db:
            cur = db.execute("SELECT blob_id, size FROM blobs WHERE pins = 0 "
                             "ORDER BY last_access")
            for blob_id, size in cur:
                if got >= need:
                    break
                out.append((blob_id, int(size)))
                got += int(size)
            cur.close()
        return out

    def unreferenced(self, min_age_s: float = 0.0) -> list[str]:
        return [b for (b,) in self.db.read("SELECT blob_id FROM blobs WHERE refs <= 0 AND "
                                         "created <= ?", (time.time() - min_age_s,))]

    def all_blobs(self) -> list[str]:
        return [b for (b,) in self.db.read("SELECT blob_id FROM blobs")]

    def dangling_keys(self) -> list[bytes]:
        return [bytes(k) for (k,) in self.db.read(
            "SELECT key FROM keys WHERE blob_id NOT IN (SELECT blob_id FROM blobs)")]

    def insert_rebuilt(self, rows: Sequence[tuple[str, int, bytes, float]]) -> None:
        """Rebuild from blob files: (blob id, size, key, mtime); a key already mapped (a
        save since the rebuild began) keeps its blob."""
        def tx(db: sqlite3.Connection) -> None:
            for blob_id, size, key, mtime in rows:
                db.execute("INSERT OR IGNORE INTO blobs(blob_id, size, grp, last_access, "
                           "created) VALUES(?, ?, ?, ?, ?)", (blob_id, size, key[:18], mtime,
                                                              mtime))
                db.execute("INSERT OR IGNORE INTO keys(key, blob_id) VALUES(?, ?)",
                           (key, blob_id))
        self.db.tx(tx)

    def check(self) -> None:
        """Raise :class:`IndexDamaged` if SQLite's quick check finds damage."""
        try:
            res = self.db.read("PRAGMA quick_check")
        except sqlite3.DatabaseError as exc:
            raise IndexDamaged(f"store index {self.path} is damaged: {exc}") from exc
        if res != [("ok",)]:
            raise IndexDamaged(f"store index {self.path} is damaged: {res[:3]}")

    def close(self) -> None:
        self.db.close()
