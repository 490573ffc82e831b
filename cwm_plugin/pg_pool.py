"""A bounded pool of PostgreSQL connections that says what happened when the database goes
away: the memory's truth and index (``memory/postgres``) and the activity log
(``activity/postgres.py``) each hold one.

While the database is down every call raises the owner's error (``Subject.error``: a 503 that
names ``host:port/db``, never the password) at once: a failed connection drops the pool, and a
new one is made only after a direct connection (the probe, at most one every ``RETRY_S``)
succeeds and the owner's schema is brought up to date, so a request never waits on a pool's
reconnection backoff. After a restart of the database the first call on a stale connection
fails and the next makes a new pool. The outage is logged once, and its end. Every connection
is bounded (statement and lock timeouts, TCP keepalives), so a database that stops answering
fails a call in seconds instead of hanging a thread. psycopg is imported only by those who
need this module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn

import psycopg
from psycopg import conninfo
from psycopg_pool import ConnectionPool, PoolTimeout

from cwm_plugin import pg_scope
from cwm_plugin.errors import ConfigError, CWMError

log = logging.getLogger(__name__)
STATEMENT_TIMEOUT_S = 15.0  # one statement, at most
LOCK_TIMEOUT_S = 10.0  # waiting for a row lock (another replica writing the same rows)


def _connection_lost(exc: Exception) -> bool:
    """Whether a psycopg error means the connection (or the server) is gone, not that the
    server refused one statement: a lock or statement timeout (55P03, 57014) or a deadlock
    (40P01) are ``OperationalError`` too, but the database is up and the next call will do."""
    state = getattr(exc, "sqlstate", None)
    return state is None or state.startswith(("08", "57P"))


def describe(url: str) -> str:
    """``host:port/dbname`` of a connection string: never its password or options."""
    try:
        d = conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "(an unparseable postgres_url)"
    return f"{d.get('host', 'localhost')}:{d.get('port', 5432)}/{d.get('dbname', '')}"


@dataclass(frozen=True)
class Subject:
    """Who owns a pool, for its errors and logs."""

    name: str                   # "memory database"
    error: type[CWMError]       # raised while it cannot be reached
    pool_setting: str           # the setting that sizes the pool
    hint: str                   # what to do while it is down
    meanwhile: str              # what the server does meanwhile (for the log)


class PgPool:
    RETRY_S = 1.0

    def __init__(self, url: str, migrate: Callable[[psycopg.Connection], object],
                 subject: Subject, *, pool_size: int = 8, timeout_s: float = 5.0,
                 name: str = "cwm-db", row_security: bool = False) -> None:
        """``row_security``: the owner's tables are under row-level security, and every
        connection handed out gets the current ``pg_scope`` (the memory's)."""
        self.where = describe(url)
        self.subject = subject
        self.timeout_s = timeout_s
        self.pool_size = max(1, pool_size)
        self._url = url
        self._migrate = migrate
        self._name = name
        self._pool: ConnectionPool | None = None
        self._retry_at = 0.0
        self._down_since: float | None = None
        self._closed = False
        self._guard = threading.Lock()
        self.row_security = row_security
        self.space_prefixes: set[str] = set()  # the memory index's (pg_scope.Scope.settings)
        self._unscoped_noted = False
        self._options: dict[str, object] = {
            "connect_timeout": max(1, round(timeout_s)),
            "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
            "keepalives_count": 3, "tcp_user_timeout": int(STATEMENT_TIMEOUT_S * 1000),
            "options": f"-c statement_timeout={int(STATEMENT_TIMEOUT_S * 1000)} "
                       f"-c lock_timeout={int(LOCK_TIMEOUT_S * 1000)} "
                       "-c idle_in_transaction_session_timeout=60000"}

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """A pooled connection (autocommit); an unreachable database (or one lost mid-call)
        raises the subject's error saying where and what to do."""
        pool = self._ready()
        try:
            with pool.connection() as conn:
                if self.row_security:
                    self._scope(conn)
                yield conn
        except PoolTimeout as exc:
            if self._probe():
                raise self.subject.error(
                    f"the {self.subject.name} {self.where} is busy: all {self.pool_size} "
                    f"connections were in use for {self.timeout_s:g} s",
                    hint=f"raise {self.subject.pool_setting}, or the database's capacity"
                ) from exc
            self._lost(pool, exc)
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            if not _connection_lost(exc):
                raise  # the server answered: a lock or statement timeout, a deadlock
            self._lost(pool, exc)

    @contextmanager
    def spare(self, wait_s: float = 0.02) -> Iterator[psycopg.Connection | None]:
        """Another pooled connection if one is free at once (within ``wait_s``), else None:
        for work a caller can also do on the connection it holds (a search's second reader),
        so it never waits on, or starves, a connection another caller needs. Never raises
        for a database that is down: it yields None."""
        pool = self._pool
        conn = None
        if pool is not None:
            try:
                conn = pool.getconn(timeout=wait_s)
            except (PoolTimeout, psycopg.Error):
                conn = None
            if conn is not None and self.row_security:
                try:
                    self._scope(conn)
                except (psycopg.Error, CWMError):
                    pool.putconn(conn)
                    conn = None
        try:
            yield conn
        finally:
            if conn is not None and pool is not None:
                pool.putconn(conn)

    def _scope(self, conn: psycopg.Connection) -> None:
        """Give ``conn`` the row-level security scope of the work at hand (``pg_scope``): one
        round trip, skipped when the connection already holds it."""
        scope = pg_scope.current()
        if scope is None:
            if not self._unscoped_noted:
                self._unscoped_noted = True
                log.error("the %s was asked for with no row-level security scope set "
                          "(pg_scope): refused; this code path is a bug to report",
                          self.subject.name, stack_info=True)
            raise self.subject.error(f"the {self.subject.name} was asked for with no scope "
                                     "set (a bug: the call is refused, never run unscoped)",
                                     hint="report it with the log's stack trace")
        want = scope.settings(self.space_prefixes)
        if getattr(conn, "_cwm_scope", None) != want:
            conn.execute("SELECT set_config('cwm.read', %s, false), set_config('cwm.spaces', "
                         "%s, false), set_config('cwm.write', %s, false)", want)
            conn._cwm_scope = want  # type: ignore[attr-defined]

    def _ready(self) -> ConnectionPool:
        pool = self._pool
        if pool is not None:
            return pool
        if self._closed:
            raise self.subject.error(f"the {self.subject.name} is closed (the server is "
                                     "shutting down)")
        # one caller probes; the others wait for it only while the database was never found
        # down (a first connection), else they are answered at once
        wait = self.timeout_s if self._down_since is None else 0.0
        got = self._guard.acquire(timeout=wait) if wait else self._guard.acquire(blocking=False)
        if not got:
            raise self._unavailable("reconnecting")
        try:
            if self._pool is not None:
                return self._pool
            if time.monotonic() < self._retry_at:
                raise self._unavailable("down")
            try:
                with psycopg.connect(self._url, autocommit=True, **self._options) as conn:
                    self._migrate(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                self._retry_at = time.monotonic() + self.RETRY_S
                self._note_down(exc)
                raise self._unavailable(type(exc).__name__) from exc
            pool = ConnectionPool(self._url, min_size=min(2, self.pool_size),
                                  max_size=self.pool_size, open=False,
                                  timeout=self.timeout_s, name=self._name,
                                  kwargs={"autocommit": True, **self._options})
            pool.open(wait=False)
            if self._down_since is not None:
                log.warning("the %s %s is back after %.1f s", self.subject.name, self.where,
                            time.monotonic() - self._down_since)
                self._down_since = None
            self._pool = pool
            return pool
        finally:
            self._guard.release()

    def _probe(self) -> bool:
        try:
            with psycopg.connect(self._url, **self._options):
                return True
        except (psycopg.OperationalError, psycopg.InterfaceError):
            return False

    def _lost(self, pool: ConnectionPool, exc: Exception) -> NoReturn:
        """A pooled connection failed: the pool goes (its other connections are likely as
        dead: a restarted server). If the database answers a new connection, the next call
        makes a new pool at once (this call alone failed); if not, it is down until a probe
        finds it."""
        up = self._probe()
        with self._guard:
            if self._pool is pool:
                self._pool = None
                threading.Thread(target=pool.close, kwargs={"timeout": 1.0}, daemon=True,
                                 name=f"{self._name}-pool-close").start()
                if up:
                    log.info("the %s %s dropped this replica's connections (%s); "
                             "reconnecting", self.subject.name, self.where, type(exc).__name__)
                else:
                    self._retry_at = time.monotonic() + self.RETRY_S
                    self._note_down(exc)
        raise self._unavailable(type(exc).__name__) from exc

    def _note_down(self, exc: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("the %s %s cannot be reached (%s); %s, and it is tried again every "
                        "%g s", self.subject.name, self.where, type(exc).__name__,
                        self.subject.meanwhile, self.RETRY_S)

    def _unavailable(self, why: str) -> CWMError:
        return self.subject.error(f"the {self.subject.name} {self.where} cannot be reached "
                                  f"({why})", hint=self.subject.hint)

    def close(self) -> None:
        with self._guard:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


def apply_migrations(conn: psycopg.Connection, table: str, lock_id: int,
                     migrations: tuple[tuple[str, ...], ...], what: str) -> int:
    """Bring a schema to ``migrations``' newest version, each migration in its own
    transaction under the advisory lock ``lock_id`` (replicas starting together apply each
    once; the locks a version takes end with it, so a long one does not hold the tables the
    others touch); the versions applied are kept in ``table``. A database newer than this code
    is refused (a downgraded replica must not write rows it does not understand); an
    extension the server lacks is named. Returns the version now."""
    version = 0
    while version < len(migrations):
        with conn.transaction():
            # (a migration rewriting a large table runs as long as it needs: the pool's
            # statement timeout is for a request's queries; a replica starting meanwhile
            # waits for it here)
            conn.execute("SET LOCAL statement_timeout = 0")
            conn.execute("SET LOCAL lock_timeout = 0")
            conn.execute("SELECT set_config('cwm.read', '*', true), "  # (row-level security)
                         "set_config('cwm.spaces', '*', true), set_config('cwm.write', '*', true)")
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_id,))
            conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (version integer PRIMARY KEY, "  # noqa: S608 - a constant
                         "applied timestamptz NOT NULL DEFAULT now())")
            row = conn.execute(f"SELECT coalesce(max(version), 0) FROM {table}").fetchone()  # noqa: S608
            have = int(row[0]) if row else 0
            if have > len(migrations):
                raise ConfigError(
                    f"the {what} database is at schema version {have}, newer than this "
                    f"cwm_plugin knows ({len(migrations)})",
                    hint="upgrade cwm_plugin on this replica to the version the others run")
            version = have + 1
            if version > len(migrations):
                break
            _apply(conn, migrations[version - 1], version, len(migrations), what)
            conn.execute(f"INSERT INTO {table} (version) VALUES (%s)", (version,))  # noqa: S608
    return len(migrations)


def _apply(conn: psycopg.Connection, statements: tuple[str, ...], version: int, newest: int,
           what: str) -> None:
    log.info("the %s database: applying schema version %d of %d", what, version, newest)
    t0 = time.monotonic()
    for statement in statements:
        try:
            conn.execute(statement)  # type: ignore[arg-type]  (constant SQL)
        except psycopg.Error as exc:
            if not statement.startswith("CREATE EXTENSION") and \
                    getattr(exc, "sqlstate", None) != "P0001":  # (a check that raised)
                raise
            raise ConfigError(
                f"the {what} database lacks the extension its schema needs "
                f"({statement}: {exc})",
                hint="install it on the PostgreSQL server (pgvector: the `vector` "
                     "extension), or have the database's owner run that statement"
            ) from exc
    log.info("the %s database: schema version %d applied in %.1f s", what, version,
             time.monotonic() - t0)
