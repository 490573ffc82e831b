"""The SQL schema of the disk tier's index, its version and its creation (see
:mod:`.key_index` for what it guarantees).

Reference counts, pin counts, per-group pinned bytes and the usage totals are kept by triggers
in the transaction that changes the rows they count; ``blobs_evictable`` indexes unpinned
blobs by last access (eviction never reads pinned ones), ``blobs_unreferenced`` the blobs
``gc`` may collect.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

SCHEMA_VERSION = "2"
LEASED = 2    # keys.pinned of a lease (1: a pin); the triggers count it like a pin
# the bytes of blobs only leases pin (leased keys are few, the blocks promised to requests
# now: found through the index of expiring pins)
LEASE_ONLY_BYTES = (
    "SELECT COALESCE(SUM(b.size), 0) FROM blobs b WHERE b.blob_id IN (SELECT blob_id FROM keys "
    f"WHERE pin_expires IS NOT NULL AND pinned={LEASED}) AND NOT EXISTS (SELECT 1 FROM keys k "
    "WHERE k.blob_id = b.blob_id AND k.pinned = 1)")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blobs (
    blob_id TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    grp BLOB NOT NULL DEFAULT x'',
    last_access REAL NOT NULL,
    created REAL NOT NULL,
    refs INTEGER NOT NULL DEFAULT 0,
    pins INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS blobs_evictable ON blobs(last_access) WHERE pins = 0;
CREATE INDEX IF NOT EXISTS blobs_unreferenced ON blobs(created) WHERE refs = 0;
CREATE TABLE IF NOT EXISTS keys (
    key BLOB PRIMARY KEY,
    blob_id TEXT NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    pin_expires REAL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS keys_by_blob ON keys(blob_id);
CREATE INDEX IF NOT EXISTS keys_pin_expiry ON keys(pin_expires) WHERE pin_expires IS NOT NULL;
CREATE TABLE IF NOT EXISTS group_pins (grp BLOB PRIMARY KEY, bytes INTEGER NOT NULL)
    WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS stats (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    bytes INTEGER NOT NULL DEFAULT 0,
    blobs INTEGER NOT NULL DEFAULT 0
);
INSERT OR IGNORE INTO stats(id, bytes, blobs) VALUES (0, 0, 0);
CREATE TRIGGER IF NOT EXISTS blob_added AFTER INSERT ON blobs BEGIN
    UPDATE stats SET bytes = bytes + NEW.size, blobs = blobs + 1 WHERE id = 0;
END;
CREATE TRIGGER IF NOT EXISTS blob_removed AFTER DELETE ON blobs BEGIN
    UPDATE stats SET bytes = bytes - OLD.size, blobs = blobs - 1 WHERE id = 0;
    UPDATE group_pins SET bytes = bytes - OLD.size WHERE grp = OLD.grp AND OLD.pins > 0;
END;
CREATE TRIGGER IF NOT EXISTS blob_pinned AFTER UPDATE OF pins ON blobs
    WHEN (OLD.pins > 0) != (NEW.pins > 0) BEGIN
    INSERT INTO group_pins(grp, bytes) VALUES (NEW.grp, 0) ON CONFLICT(grp) DO NOTHING;
    UPDATE group_pins SET bytes = bytes + CASE WHEN NEW.pins > 0 THEN NEW.size
        ELSE -NEW.size END WHERE grp = NEW.grp;
END;
CREATE TRIGGER IF NOT EXISTS key_added AFTER INSERT ON keys BEGIN
    UPDATE blobs SET refs = refs + 1, pins = pins + NEW.pinned WHERE blob_id = NEW.blob_id;
END;
CREATE TRIGGER IF NOT EXISTS key_removed AFTER DELETE ON keys BEGIN
    UPDATE blobs SET refs = refs - 1, pins = pins - OLD.pinned WHERE blob_id = OLD.blob_id;
END;
CREATE TRIGGER IF NOT EXISTS key_changed AFTER UPDATE OF blob_id, pinned ON keys BEGIN
    UPDATE blobs SET refs = refs - 1, pins = pins - OLD.pinned WHERE blob_id = OLD.blob_id;
    UPDATE blobs SET refs = refs + 1, pins = pins + NEW.pinned WHERE blob_id = NEW.blob_id;
END;
"""


def statements(script: str) -> Iterator[str]:
    """Split the schema into statements (triggers keep their inner semicolons)."""
    buf = ""
    for line in script.strip().splitlines():
        buf += line + "\n"
        if sqlite3.complete_statement(buf):
            yield buf.strip()
            buf = ""


def schema_version(db: sqlite3.Connection) -> str | None:
    """The index's schema version; None for an empty file."""
    if db.execute("SELECT 1 FROM sqlite_master WHERE name='meta'").fetchone():
        row = db.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
        return row[0] if row else None
    if db.execute("SELECT 1 FROM sqlite_master WHERE name='blobs'").fetchone():
        return "1"
    return None


def create_schema(db: sqlite3.Connection) -> None:
    """Create the schema in an empty file (inside the caller's transaction); a file of another
    schema version raises :class:`sqlite3.DatabaseError`."""
    version = schema_version(db)
    if version == SCHEMA_VERSION:
        return
    if version is not None:
        raise sqlite3.DatabaseError(f"index schema {version}, this version reads "
                                    f"{SCHEMA_VERSION}")
    for stmt in statements(SCHEMA):
        db.execute(stmt)
    db.execute("INSERT OR REPLACE INTO meta(name, value) VALUES('schema', ?)",
               (SCHEMA_VERSION,))
