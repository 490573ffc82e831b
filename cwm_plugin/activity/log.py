"""An append-only activity log, so one provider picks up where another left off: one hash
chain per principal (:class:`~cwm_plugin.activity.chain.Chain`).

A principal's entries -- a tenant's, a provider's, and each user's of a tenant
(``tenant/u-...``) apart -- chain only among themselves, under ``chains/<principal>/`` of the
log's root (``activity.jsonl`` and ``activity.md``; the folder is the principal's name
percent-encoded). So whoever reads one principal's entries, with their ``prev`` and ``hash``,
learns nothing of when or how often another principal acts, and each chain verifies on its
own (:meth:`ActivityLog.verify` checks every one, and that each entry sits in its own
principal's chain). Appends to one chain take turns under its lock (a thread lock and a
``flock``, so several processes keep it linear); appends to different chains never wait on
each other. Reads merge the chains a caller may read (``principal``: a name or a test of
one) by time. Nothing here rewrites or deletes an entry.

A log in the single-chain format (one chain for everybody: ``activity.jsonl`` at the root) is
moved when it is opened, under the lock its appenders take: each entry, its time kept, is
appended to its principal's chain (new hashes, since the ``prev`` of each was another
principal's entry); the old files are kept, renamed ``activity.legacy-<first 12 hex of its
head>.jsonl`` / ``.md``, and still verified as one chain, so a head recorded elsewhere before
the move is still checked. A warning says what was
moved (:attr:`ActivityLog.migrated`); a move cut short by a crash is finished on the next open,
without moving an entry twice.
"""

from __future__ import annotations

import fcntl
import heapq
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from itertools import islice, takewhile
from pathlib import Path
from urllib.parse import quote, unquote

from cwm_plugin.activity.chain import GENESIS as GENESIS
from cwm_plugin.activity.chain import MAX_NAME as MAX_NAME
from cwm_plugin.activity.chain import MAX_TEXT as MAX_TEXT
from cwm_plugin.activity.chain import Chain, check
from cwm_plugin.activity.chain import Entry as Entry
from cwm_plugin.errors import InvalidInput

log = logging.getLogger(__name__)
CHAINS = "chains"
LOCK = ".activity.lock"
MOVED = ".migrated"  # in chains/: the hash of the last entry moved from the one-chain log
MAX_FOLDER = 255  # bytes of a file name

Who = str | Callable[[str], bool] | None  # a principal, a test of one, or anyone


def folder_name(principal: str) -> str:
    """The folder of ``principal``'s chain: its name percent-encoded (``/`` too; a leading
    ``.`` as ``%2E``), so any principal is one safe folder and the name reads back."""
    name = quote(principal, safe="")
    return "%2E" + name[1:] if name.startswith(".") else name


def _sees(principal: str, who: Who) -> bool:
    if who is None:
        return True
    return principal == who if isinstance(who, str) else who(principal)


@contextmanager
def _flock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file closes
        yield


class ActivityLog:
    """The chains under ``root`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.chains_dir = self.root / CHAINS
        self._locks: dict[Path, threading.Lock] = {}
        self._guard = threading.Lock()
        self.migrated: str | None = self._migrate()  # what was moved on open (None: nothing)

    def chain(self, principal: str, under: Path | None = None) -> Chain:
        name = folder_name(principal)
        return Chain((under or self.chains_dir) / name, principal, label=f"{CHAINS}/{name}/")

    @contextmanager
    def _locked(self, chain: Chain) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(chain.folder, threading.Lock())
        with lock:
            chain.folder.mkdir(parents=True, exist_ok=True)
            with _flock(chain.folder / LOCK):
                yield

    def append(self, entry: Entry) -> Entry:
        """Chain and append one entry to its principal's chain (both files, fsynced); returns
        it with its time, ``prev`` and hash."""
        check(entry)
        if len(folder_name(entry.principal).encode()) > MAX_FOLDER:
            raise InvalidInput("activity field principal is too long for a chain's folder",
                               hint=f"at most {MAX_FOLDER} bytes percent-encoded")
        chain = self.chain(entry.principal)
        with self._locked(chain):
            return chain.extend([entry])[0]

    def principals(self, who: Who = None) -> list[str]:
        """The principals with a chain (of ``who``'s choosing: a name, a test, None: all)."""
        if not self.chains_dir.is_dir():
            return []
        names = (unquote(p.name) for p in self.chains_dir.iterdir() if p.is_dir())
        return sorted(p for p in names if self.chain(p).folder.is_dir() and _sees(p, who))

    def head(self, principal: str) -> str:
        """The hash of the last complete entry of ``principal``'s chain (``GENESIS``: none)."""
        return self.chain(principal).head()

    def heads(self, who: Who = None) -> dict[str, str]:
        """The head of every chain ``who`` reads."""
        return {p: self.head(p) for p in self.principals(who)}

    def _merged(self, who: Who, newest_first: bool) -> Iterator[Entry]:
        chains = [self.chain(p) for p in self.principals(who)]
        runs: Iterable[Iterable[Entry]] = [c.newest_first() if newest_first else c.entries()
                                           for c in chains]
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
        for p in self.principals():
            problems += self.chain(p).verify()
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
                with self._locked(chain):
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
