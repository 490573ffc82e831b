"""The activity log in PostgreSQL (``activity.backend: postgres``), so every sidecar replica
appends to and reads one log: the same chains as the files (``log.py``), one per principal,
each entry hashed with the one before it in its own chain, and the same reads.

A chain is a row of ``cwm_activity_chains`` (``tenant``, ``user_name``: empty for the tenant's
own chain) holding its head and length; its entries are rows of ``cwm_activity_entries``
(``tenant``, ``user_name``, ``seq``), each the entry's JSON line as the files keep it, so
:meth:`verify` checks them the way ``Chain.verify`` checks a file. An append takes its chain
row's lock (``FOR UPDATE``), so appends from any replica keep a chain linear; a user's first
entry is admitted under the lock of its tenant's own chain row (two new users never take a
tenant's last place). Reads are scoped in SQL to the chains the reader may read, and every
query filters by tenant first. Nothing rewrites or deletes an entry.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import psycopg

from cwm_plugin.activity.chain import GENESIS, Entry, check
from cwm_plugin.activity.log import MAX_USER_CHAINS, UserChainsFull, Who, split
from cwm_plugin.errors import CWMError
from cwm_plugin.pg_pool import PgPool, Subject, apply_migrations

LOCK_ID = 0x63776D5F616374  # "cwm_act": the advisory lock the log's migrations take
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 1
        """CREATE TABLE cwm_activity_chains (
            tenant text NOT NULL, user_name text NOT NULL, head text NOT NULL,
            entries bigint NOT NULL DEFAULT 0, PRIMARY KEY (tenant, user_name))""",
        """CREATE TABLE cwm_activity_entries (
            tenant text NOT NULL, user_name text NOT NULL, seq bigint NOT NULL,
            time double precision NOT NULL, hash text NOT NULL, line text NOT NULL,
            PRIMARY KEY (tenant, user_name, seq),
            FOREIGN KEY (tenant, user_name) REFERENCES cwm_activity_chains)""",
        "CREATE INDEX cwm_activity_entries_time ON cwm_activity_entries (tenant, time)",
    ),
)


class ActivityUnavailable(CWMError):
    """The activity log's database cannot be reached right now."""

    code = "activity_unavailable"
    retryable = True
    http_status = 503


def migrate(conn: psycopg.Connection) -> int:
    return apply_migrations(conn, "cwm_activity_schema", LOCK_ID, MIGRATIONS, "activity log")


def _principal(tenant: str, user: str) -> str:
    return tenant if not user else f"{tenant}/{user}"


def _scope(who: Who) -> tuple[str, list[Any]]:
    """A WHERE clause (and its parameters) for the chains ``who`` reads."""
    if who is None:
        return "TRUE", []
    if isinstance(who, str):
        tenant, user = split(who)
        return "(tenant = %s AND user_name = %s)", [tenant, user or ""]
    parts, args = [], []
    for tenant, users in sorted(who.items()):
        if users is None:
            parts.append("tenant = %s")
            args.append(tenant)
        else:
            parts.append("(tenant = %s AND user_name = ANY(%s))")
            args += [tenant, ["", *sorted(users)]]
    return ("(" + " OR ".join(parts) + ")") if parts else "FALSE", args


class PostgresActivityLog:
    """The chains in one PostgreSQL database (see the module docstring); at most
    ``max_user_chains`` user chains a tenant."""

    migrated: str | None = None  # (nothing to move: the files' one-chain format never was here)

    def __init__(self, url: str, *, max_user_chains: int = MAX_USER_CHAINS,
                 pool_size: int = 4, timeout_s: float = 5.0) -> None:
        self.max_user_chains = max_user_chains
        self.db = PgPool(url, migrate, Subject(
            "activity database", ActivityUnavailable, "activity.postgres_pool_size",
            "check that PostgreSQL is up and activity.postgres_url is right",
            "activity entries are not written"), pool_size=pool_size, timeout_s=timeout_s,
            name="cwm-activity")
        self.root = f"postgresql {self.db.where}"  # (what the CLI names)

    def close(self) -> None:
        self.db.close()

    # --- writing ---------------------------------------------------------------------------

    def append(self, entry: Entry) -> Entry:
        """Chain and append one entry to its principal's chain (one transaction); returns it
        with its time, ``prev`` and hash. A new user's chain past its tenant's
        ``max_user_chains``: :class:`UserChainsFull`, nothing written."""
        check(entry)
        tenant, user = split(entry.principal)
        with self.db.connection() as conn, conn.transaction():
            if user is not None and conn.execute(
                    "SELECT 1 FROM cwm_activity_chains WHERE tenant = %s AND user_name = %s",
                    (tenant, user)).fetchone() is None:
                self._admit(conn, tenant, user)
            conn.execute("INSERT INTO cwm_activity_chains (tenant, user_name, head) VALUES "
                         "(%s, %s, %s) ON CONFLICT DO NOTHING", (tenant, user or "", GENESIS))
            head, n = conn.execute(
                "SELECT head, entries FROM cwm_activity_chains WHERE tenant = %s AND "
                "user_name = %s FOR UPDATE", (tenant, user or "")).fetchone()
            entry.prev, entry.time = head, time.time()
            entry.hash = entry.digest()
            conn.execute("INSERT INTO cwm_activity_entries (tenant, user_name, seq, time, "
                         "hash, line) VALUES (%s, %s, %s, %s, %s, %s)",
                         (tenant, user or "", n + 1, entry.time, entry.hash,
                          json.dumps(asdict(entry), sort_keys=True)))
            conn.execute("UPDATE cwm_activity_chains SET head = %s, entries = %s WHERE "
                         "tenant = %s AND user_name = %s",
                         (entry.hash, n + 1, tenant, user or ""))
        return entry

    def _admit(self, conn: psycopg.Connection, tenant: str, user: str) -> None:
        """Make a new user's chain if its tenant is under ``max_user_chains`` (counted under
        the lock of the tenant's own chain row)."""
        conn.execute("INSERT INTO cwm_activity_chains (tenant, user_name, head) VALUES "
                     "(%s, '', %s) ON CONFLICT DO NOTHING", (tenant, GENESIS))
        conn.execute("SELECT 1 FROM cwm_activity_chains WHERE tenant = %s AND user_name = '' "
                     "FOR UPDATE", (tenant,))
        held = conn.execute("SELECT count(*) FROM cwm_activity_chains WHERE tenant = %s AND "
                            "user_name <> '' AND user_name <> %s", (tenant, user)).fetchone()
        if int(held[0]) >= self.max_user_chains:
            raise UserChainsFull(
                f"tenant {tenant} already has {held[0]} users with an activity chain (the "
                "limit, activity.max_user_chains): this user's entry was not written",
                hint="log it as the tenant (no user), or ask the operator to raise "
                     "activity.max_user_chains")

    # --- reading ---------------------------------------------------------------------------

    def _rows(self, sql: str, args: Iterable[Any]) -> list[tuple]:
        with self.db.connection() as conn:
            return conn.execute(sql, list(args)).fetchall()  # type: ignore[arg-type]

    def heads(self, who: Who = None) -> dict[str, str]:
        """The head of every chain ``who`` reads."""
        where, args = _scope(who)
        rows = self._rows(f"SELECT tenant, user_name, head FROM cwm_activity_chains WHERE "  # noqa: S608 - placeholders
                          f"{where} AND entries > 0 ORDER BY tenant, user_name", args)
        return {_principal(t, u): h for t, u, h in rows}

    def principals(self, who: Who = None) -> list[str]:
        """The principals with a chain (of ``who``'s reading; None: all)."""
        return sorted(self.heads(who))

    def head(self, principal: str) -> str:
        """The hash of the last entry of ``principal``'s chain (``GENESIS``: none)."""
        return self.heads(principal).get(principal, GENESIS)

    def _entries(self, who: Who, tail: str, args: list[Any]) -> list[Entry]:
        where, scope = _scope(who)
        rows = self._rows(f"SELECT line FROM cwm_activity_entries WHERE {where} {tail}",  # noqa: S608 - placeholders
                          [*scope, *args])
        return [Entry.from_json(r[0]) for r in rows]

    def entries(self, principal: Who = None) -> list[Entry]:
        """Every entry of the chains ``principal`` reads, oldest first."""
        return self._entries(principal, "ORDER BY time, tenant, user_name, seq", [])

    def quick(self, *, hours: float = 24.0, limit: int = 10,
              principal: Who = None) -> list[Entry]:
        """The last ``limit`` entries of the last ``hours``, oldest first."""
        got = self._entries(principal, "AND time >= %s ORDER BY time DESC, tenant DESC, "
                            "user_name DESC, seq DESC LIMIT %s",
                            [time.time() - hours * 3600, max(0, limit)])
        return got[::-1]

    def page(self, *, offset: int = 0, limit: int = 100,
             principal: Who = None) -> tuple[list[Entry], int]:
        """Entries ``offset`` .. ``offset + limit`` (oldest first) and how many there are."""
        where, scope = _scope(principal)
        total = self._rows(f"SELECT count(*) FROM cwm_activity_entries WHERE {where}", scope)  # noqa: S608
        return self._entries(principal, "ORDER BY time, tenant, user_name, seq OFFSET %s "
                             "LIMIT %s", [max(0, offset), max(0, limit)]), int(total[0][0])

    def verify(self) -> list[str]:
        """What is wrong with any chain (empty: every chain is intact): each entry parses,
        follows the one before it, hashes to its hash, is its chain's principal's, and each
        chain's head and length are its last entry's."""
        problems: list[str] = []
        chains = self._rows("SELECT tenant, user_name, head, entries FROM cwm_activity_chains "
                            "ORDER BY tenant, user_name", [])
        for tenant, user, head, n in chains:
            name, prev, count = f"chain {_principal(tenant, user)}", GENESIS, 0
            rows = self._rows("SELECT seq, hash, line FROM cwm_activity_entries WHERE "
                              "tenant = %s AND user_name = %s ORDER BY seq", [tenant, user])
            for seq, stored, line in rows:
                count += 1
                try:
                    e = Entry.from_json(line)
                except ValueError as exc:
                    problems.append(f"{name} entry {seq} is not an entry: {exc}")
                    continue
                if seq != count or e.prev != prev:
                    problems.append(f"{name} entry {seq} does not follow the entry before "
                                    "(an entry was removed, inserted or reordered)")
                if e.digest() != e.hash or stored != e.hash:
                    problems.append(f"{name} entry {seq} was edited (its hash does not "
                                    "match its content)")
                if e.principal != _principal(tenant, user):
                    problems.append(f"{name} entry {seq} is an entry of another principal "
                                    "(moved in from another chain)")
                prev = e.hash
            if head != prev or n != count:
                problems.append(f"{name} ends at {prev[:12]} after {count} entries, but its "
                                f"head says {head[:12]} after {n} (entries were cut off the end)")
        return problems
