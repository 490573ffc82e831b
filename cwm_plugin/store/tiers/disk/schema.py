"""The SQL schema of the disk tier's index (see :mod:`.key_index` for what it guarantees).

Reference counts, pin counts, per-group pinned bytes and the usage totals are kept by triggers
in the transaction that changes the rows they count; ``blobs_evictable`` indexes unpinned
blobs by last access (eviction never reads pinned ones), ``blobs_unreferenced`` the blobs
``gc`` may collect.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

SCHEMA_VERSION = "2"

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
