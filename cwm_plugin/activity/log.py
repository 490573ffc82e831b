"""An append-only activity log, so one provider picks up where another left off: one hash
chain per principal (:class:`~cwm_plugin.activity.chain.Chain`).

A principal's entries -- a tenant's, a provider's, and each user's of a tenant
(``tenant/u-...``) apart -- chain only among themselves, in ``chains/<tenant>/<user>/`` of the
log's root (``activity.jsonl`` and ``activity.md``; ``<user>`` is ``_self`` for the tenant's
own entries; each name percent-encoded, a leading ``.`` or ``_`` too, so no user's folder is
``_self`` and none is hidden). So whoever reads one principal's entries, with their ``prev``
and ``hash``, learns nothing of when or how often another principal acts, and each chain
verifies on its own (:meth:`ActivityLog.verify` checks every one, and that each entry sits in
its own principal's chain).

What a read touches is what its reader may read (:data:`Who`: a principal, or the tenants it
reads and, in each, which users' chains): only those tenants' folders are looked at, and of a
tenant whose users it reads only that tenant's, so one tenant's many users never slow another
tenant's reads. A tenant has at most ``max_user_chains`` user chains: an entry of a user past
them is refused (:class:`UserChainsFull`, 507) and nothing is written, the user's chain is
never folded into the tenant's (every user of the tenant reads that one). Appends to one
chain take turns under its lock (one of :data:`STRIPES` thread locks picked by the chain's
folder, plus a ``flock`` of the folder, so several processes keep it linear); appends to
different chains wait on each other only when their folders share a stripe, and the locks
held never grow with the number of chains. Reads merge the chains by time. Nothing here
rewrites or deletes an entry.

A log in the single-chain format (one chain for everybody: ``activity.jsonl`` at the root) is
moved when it is opened, under the lock its appenders take: each entry, its time kept, is
appended to its principal's chain (new hashes, since the ``prev`` of each was another
principal's entry; no bound on users: nothing kept is dropped); the old files are kept,
renamed ``activity.legacy-<first 12 hex of its head>.jsonl`` / ``.md``, and still verified as
one chain, so a head recorded elsewhere before the move is still checked. A warning says what
was moved (:attr:`ActivityLog.migrated`); a move cut short by a crash is finished on the next
open, without moving an entry twice.
"""

from __future__ import annotations

import fcntl
import heapq
import logging
import os
import shutil
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from itertools import islice, takewhile
from pathlib import Path
from urllib.parse import quote, unquote

from cwm_plugin.activity.chain import GENESIS as GENESIS
from cwm_plugin.activity.chain import MAX_NAME as MAX_NAME
from cwm_plugin.activity.chain import MAX_TEXT as MAX_TEXT
from cwm_plugin.activity.chain import Chain, check
from cwm_plugin.activity.chain import Entry as Entry
from cwm_plugin.errors import InvalidInput, StorageFull

log = logging.getLogger(__name__)
CHAINS = "chains"
SELF = "_self"  # a tenant's own chain, beside its users'
LOCK = ".activity.lock"
MOVED = ".migrated"  # in chains/: the hash of the last entry moved from the one-chain log
MAX_FOLDER = 255  # bytes of a file name
STRIPES = 64  # thread locks shared by all chains
MAX_USER_CHAINS = 10_000  # of one tenant, by default

Users = frozenset[str] | None  # of a tenant: these users' chains (what follows "/"); None: all
Who = str | Mapping[str, Users] | None  # a principal; tenant -> its users; None: every chain


class UserChainsFull(StorageFull):
    """A tenant holds ``max_user_chains`` user chains: a new user's entry is not written."""

    code = "activity_users_full"
    http_status = 507


def folder_name(name: str) -> str:
    """The folder of a tenant or a user: its name percent-encoded (``/`` too; a leading ``.``
    or ``_`` as ``%2E`` / ``%5F``), so any name is one safe folder, never a hidden one or
    ``_self``, and reads back."""
    encoded = quote(name, safe="")
    return f"%{ord(encoded[0]):02X}{encoded[1:]}" if encoded[:1] in (".", "_") else encoded


def split(principal: str) -> tuple[str, str | None]:
    """``tenant`` or ``tenant/user`` -> (tenant, user or None)."""
    tenant, slash, user = principal.partition("/")
    if not tenant or (slash and not user):
        raise InvalidInput("activity field principal must be `tenant` or `tenant/user`")
    return tenant, user if slash else None


def _subfolders(path: Path) -> list[str]:
    """The names of ``path``'s folders that hold chains (none: it is not there)."""
    try:
        with os.scandir(path) as found:
            return sorted(e.name for e in found
                          if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return []


@contextmanager
def _flock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file closes
        yield


class ActivityLog:
    """The chains under ``root`` (see the module docstring); at most ``max_user_chains`` user
    chains a tenant."""

    def __init__(self, root: str | os.PathLike[str], *,
                 max_user_chains: int = MAX_USER_CHAINS) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.chains_dir = self.root / CHAINS
        self.max_user_chains = max_user_chains
        self._locks = tuple(threading.Lock() for _ in range(STRIPES))
        self.migrated: str | None = self._migrate()  # what was moved on open (None: nothing)

    def chain(self, principal: str, under: Path | None = None) -> Chain:
        tenant, user = split(principal)
        return self._chain(under or self.chains_dir, folder_name(tenant),
                           SELF if user is None else folder_name(user))

    def _chain(self, base: Path, tenant: str, user: str) -> Chain:
        """The chain in folder ``base/tenant/user`` (folder names)."""
        principal = unquote(tenant) + ("" if user == SELF else "/" + unquote(user))
        return Chain(base / tenant / user, principal, label=f"{CHAINS}/{tenant}/{user}/")

    @contextmanager
    def _locked(self, folder: Path) -> Iterator[None]:
        """``folder``'s lock: its stripe's thread lock, then a ``flock`` in it."""
        with self._locks[zlib.crc32(os.fsencode(folder)) % STRIPES]:
            folder.mkdir(parents=True, exist_ok=True)
            with _flock(folder / LOCK):
                yield

    def append(self, entry: Entry) -> Entry:
        """Chain and append one entry to its principal's chain (both files, fsynced); returns
        it with its time, ``prev`` and hash. A new user's chain past its tenant's
        ``max_user_chains``: :class:`UserChainsFull`, nothing written."""
        check(entry)
        tenant, user = split(entry.principal)
        if any(len(folder_name(n).encode()) > MAX_FOLDER for n in (tenant, user or "")):
            raise InvalidInput("activity field principal is too long for a chain's folder",
                               hint=f"at most {MAX_FOLDER} bytes percent-encoded a part")
        chain = self.chain(entry.principal)
        if user is not None and not chain.folder.is_dir():
            self._admit(tenant, chain.folder)
        with self._locked(chain.folder):
            return chain.extend([entry])[0]

    def _admit(self, tenant: str, folder: Path) -> None:
        """Make a new user chain's folder if its tenant is under ``max_user_chains`` (counted
        and made under the tenant folder's lock: two new users never take one last place)."""
        with self._locked(folder.parent):
            if folder.is_dir():
                return
            held = len([n for n in _subfolders(folder.parent) if n != SELF])
            if held >= self.max_user_chains:
                raise UserChainsFull(
                    f"tenant {tenant} already has {held} users with an activity chain (the "
                    "limit, activity.max_user_chains): this user's entry was not written",
                    hint="log it as the tenant (no user), or ask the operator to raise "
                         "activity.max_user_chains")
            folder.mkdir()

    def _chains(self, who: Who) -> list[Chain]:
        """The chains ``who`` reads that exist, looking only in the folders it may read."""
        if isinstance(who, str):
            chain = self.chain(who)
            return [chain] if chain.folder.is_dir() else []
        tenants: list[tuple[str, Users]] = \
            [(name, None) for name in _subfolders(self.chains_dir)] if who is None else \
            sorted((folder_name(tenant), users) for tenant, users in who.items())
        found = []
        for base, users in tenants:
            names = _subfolders(self.chains_dir / base) if users is None else \
                [SELF, *sorted(folder_name(u) for u in users)]
            found += [c for c in (self._chain(self.chains_dir, base, n) for n in names)
                      if c.folder.is_dir()]
        return found

    def principals(self, who: Who = None) -> list[str]:
        """The principals with a chain (of ``who``'s reading; None: all)."""
        return sorted(c.principal for c in self._chains(who) if c.principal is not None)

    def head(self, principal: str) -> str:
        """The hash of the last complete entry of ``principal``'s chain (``GENESIS``: none)."""
        return self.chain(principal).head()

    def heads(self, who: Who = None) -> dict[str, str]:
        """The head of every chain ``who`` reads."""
        return {c.principal: c.head() for c in self._chains(who) if c.principal is not None}

    def _merged(self, who: Who, newest_first: bool) -> Iterator[Entry]:
        runs: Iterable[Iterable[Entry]] = [c.newest_first() if newest_first else c.entries()
                                           for c in self._chains(who)]
        return heapq.merge(*runs, key=lambda e: e.time, reverse=newest_first)

    def entries(self, principal: Who = None) -> list[Entry]:
        """Every readable entry of the chains ``principal`` reads, oldest first."""
        return list(self._merged(principal, newest_first=False))

    def quick(self, *, hours: float = 24.0, limit: int = 10,
              principal: Who = None) -> list[Entry]:
        """The last ``limit`` entries of the last ``hours`` (of the chains ``principal``
        reads), oldest first: where to pick up. Reads each chain from its end only as far as
        needed."""
        since = time.time() - hours * 3600
        recent = takewhile(lambda e: e.time >= since, self._merged(principal, newest_first=True))
        return list(islice(recent, limit))[::-1]

    def page(self, *, offset: int = 0, limit: int = 100,
             principal: Who = None) -> tuple[list[Entry], int]:
        """Entries ``offset`` .. ``offset + limit`` (oldest first) and how many there are."""
        every = self.entries(principal)
        return every[offset:offset + limit], len(every)

    def verify(self) -> list[str]:
        """What is wrong with any chain (empty: every chain and its markdown are intact), the
        single-chain files a move kept included."""
        problems: list[str] = []
        for path in sorted(self.root.glob("activity.legacy-*.jsonl")):
            problems += Chain(self.root, None, stem=path.stem).verify()
        for chain in self._chains(None):
            problems += chain.verify()
        return problems

    def _migrate(self) -> str | None:
        """Move a one-chain log at the root into per-principal chains (module docstring)."""
        old = Chain(self.root, None)
        if not old.jsonl.exists():
            return None
        with _flock(self.root / LOCK):  # the lock the one-chain log's appenders took
            if not old.jsonl.exists():
                return None
            problems, entries = old.verify(), old.entries()
            fresh = not self.chains_dir.exists()
            target = self.root / ".chains-moving" if fresh else self.chains_dir
            if fresh:  # build every chain aside, then put them in place at once
                shutil.rmtree(target, ignore_errors=True)
            marker = self.chains_dir / MOVED
            moved = marker.read_text().strip() if marker.exists() else None
            hashes = [e.hash for e in entries]
            start = hashes.index(moved) + 1 if moved in hashes else 0
            by: dict[str, list[Entry]] = {}
            for e in entries[start:]:
                by.setdefault(e.principal, []).append(e)
            for principal, mine in by.items():
                chain = self.chain(principal, target)
                with self._locked(chain.folder):
                    chain.extend(mine, keep_time=True)
            target.mkdir(exist_ok=True)
            if hashes:  # as the old file has them (extend re-chains the entries)
                (target / (MOVED + ".tmp")).write_text(hashes[-1])
                os.replace(target / (MOVED + ".tmp"), target / MOVED)
            if fresh:
                os.replace(target, self.chains_dir)
            head = old.head()
            for path in (old.jsonl, old.md):
                if path.exists():
                    os.replace(path, self.root / f"activity.legacy-{head[:12]}{path.suffix}")
        kept = f"activity.legacy-{head[:12]}.jsonl"
        state = "intact" if not problems else \
            f"{len(problems)} problem(s), the first: {problems[0]}"
        message = (f"activity log at {self.root}: its one chain for every principal is now "
                   f"one chain per principal: moved {len(entries) - start} entries into "
                   f"{len(by)} chains under {CHAINS}/ (times kept, hashes new); the old chain "
                   f"({state}; head {head}) is kept as {kept} and checked by "
                   "`cwm activity verify`")
        log.warning("%s", message)
        return message
