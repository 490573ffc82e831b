"""The disk index's SQLite connections: one writer, a pool of readers, a deadline on each call.

In WAL mode a reader never waits for a writer, so lookups must not queue behind one either:
reads take a connection of their own from a pool and never the writer's lock. A writer waits
for SQLite's write lock (held by another process, or this one's other writer) holding only
the writer lock, which only other writes take.

Every call has a deadline, after which "database is locked" is raised (the store counts the
failure and serves without the tier: a miss): reads ``read_timeout_s`` (short: a WAL reader is
only ever held up by a recovery or journal change in another connection), writes
``timeout_s``, and a caller may pass a shorter one (best-effort writes on the read path, such
as LRU touches, which are kept for later instead). "Locked" returned by SQLite without
waiting is retried with backoff until the deadline.
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
READ_TIMEOUT_S = 0.25


def is_lock_error(exc: sqlite3.OperationalError) -> bool:
    """Whether SQLite failed because another connection holds the lock (locked, busy)."""
    msg = str(exc).lower()
    return "locked" in msg or "busy" in msg


def is_damage_error(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite says the file itself is bad (corrupt, not a database; or the schema
    check, which has no code): only then is the index moved aside and rebuilt. A full disk or
    an I/O error is not: the index is sound, the disk is not (the tier is unavailable)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is None or code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


class IndexDB:
    """Thread-safe and multi-process-safe access to one SQLite file in WAL mode."""

    def __init__(self, path: str | Path, *, timeout_s: float = 30.0,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.path = Path(path)
        self.timeout_s = timeout_s
        self.read_timeout_s = read_timeout_s
        self._wlock = threading.RLock()
        self._readers: list[sqlite3.Connection] = []
        self._rlock = threading.Lock()
        self._closed = False
        self._db = self.retry(self._connect_writer, time.monotonic() + timeout_s)

    def _connect(self, timeout_s: float) -> sqlite3.Connection:
        return sqlite3.connect(str(self.path), timeout=timeout_s, isolation_level=None,
                               check_same_thread=False)

    def _connect_writer(self) -> sqlite3.Connection:
        db = self._connect(self.timeout_s)
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
        except BaseException:
            db.close()
            raise
        return db

    def _connect_reader(self) -> sqlite3.Connection:
        db = self._connect(self.read_timeout_s)
        db.execute("PRAGMA query_only=1")
        return db

    @staticmethod
    def retry(fn: Callable[[], T], deadline: float) -> T:
        """Run ``fn``, retrying "database is locked" until ``deadline`` (monotonic)."""
        delay = 0.002
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as exc:
                if not is_lock_error(exc) or time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 0.05)

    # --- writes -------------------------------------------------------------------------------

    @contextmanager
    def _write(self, deadline: float) -> Iterator[sqlite3.Connection]:
        if not self._wlock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise sqlite3.OperationalError("database is locked (by this process's writer)")
        try:
            db = self._db
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            db.execute(f"PRAGMA busy_timeout={wait_ms}")
            self.retry(lambda: db.execute("BEGIN IMMEDIATE"), deadline)
            try:
                yield db
                db.execute(f"PRAGMA busy_timeout={int(self.timeout_s * 1000)}")
                self.retry(lambda: db.execute("COMMIT"),
                           max(deadline, time.monotonic() + self.timeout_s))
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
        finally:
            self._wlock.release()

    def tx(self, fn: Callable[[sqlite3.Connection], T], timeout_s: float | None = None) -> T:
        """One write transaction (``BEGIN IMMEDIATE``), retried whole if SQLite reports the
        database locked, until ``timeout_s`` (default: the index's)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

        def once() -> T:
            with self._write(deadline) as db:
                return fn(db)
        return self.retry(once, deadline)

    # --- reads --------------------------------------------------------------------------------

    @contextmanager
    def reader(self) -> Iterator[sqlite3.Connection]:
        """A read-only connection of the pool, for this thread until the block ends."""
        with self._rlock:
            db = self._readers.pop() if self._readers else None
        if db is None:
            db = self.retry(self._connect_reader, time.monotonic() + self.read_timeout_s)
        try:
            yield db
        finally:
            with self._rlock:
                keep = not self._closed
                if keep:
                    self._readers.append(db)
            if not keep:
                db.close()

    def read(self, sql: str, args: Sequence = ()) -> list[tuple]:
        with self.reader() as db:
            return self.retry(lambda: db.execute(sql, tuple(args)).fetchall(),
                              time.monotonic() + self.read_timeout_s)

    def close(self) -> None:
        with self._rlock:
            self._closed = True
            readers, self._readers = self._readers, []
        for db in readers:
            db.close()
        with self._wlock:
            self._db.close()
