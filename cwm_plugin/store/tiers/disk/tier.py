"""Local disk tier: one file a blob in sharded folders, its key index in SQLite, a byte budget.

A blob is written to ``tmp/`` under a unique name, fsynced and renamed to
``blobs/<ab>/<cd>/<blob_id>``; then one index transaction records it and maps its key, after
checking (inside the transaction) that the file is still there, and a removal unlinks files
inside the transaction that deletes their rows. Index transactions serialise every process
of the store, so a blob removed by one process while another re-adds it never leaves a row
without its file; a writer killed at any point leaves at most a temp or unindexed file
(``gc`` removes both). Over budget, the least recently used blobs that no pinned key protects
go first, and their keys are reported dropped; a write that still does not fit (or hits
ENOSPC) is refused with :class:`StorageFull`.

A damaged index never stops the store: it is moved aside (``index.sqlite.damaged-<time>``)
and rebuilt from the blob files' headers, which name the key each blob was saved under, in a
background thread (links and pins made since are lost and logged; blocks not yet re-indexed
are misses meanwhile). A directory that cannot be created or written raises
:class:`TierUnavailable`, so the store serves without this tier.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cwm_plugin.errors import CorruptBlob, StorageFull, TierUnavailable
from cwm_plugin.store.tiers.base import KeyInfo, Tier, TierUsage
from cwm_plugin.store.tiers.disk.db import is_lock_error
from cwm_plugin.store.tiers.disk.files import advise_files, file_lock, fsync_dir, key_of_file
from cwm_plugin.store.tiers.disk.key_index import DiskKeyIndex, IndexDamaged

if TYPE_CHECKING:
    from cwm_plugin.store.config import StoreConfig
    from cwm_plugin.store.read_buffers import ReadBuffers

log = logging.getLogger(__name__)
TOUCH_EVERY_S = 1.0        # LRU touches are batched: one transaction a second at most
TOUCH_BATCH = 512
TOUCH_WAIT_S = 0.02        # a read never waits longer for the write lock to touch


def open_tier(config: StoreConfig) -> DiskTier | None:
    """The disk tier of ``config`` (None: no ``disk_path``); :class:`TierUnavailable` when its
    folder cannot be used."""
    return DiskTier(config.disk_path, config.disk_bytes) if config.disk_path else None


class DiskTier(Tier):
    name = "disk"
    durable = True
    # files read a few at a time, so decoding starts after the first few, not after a
    # quarter of the load (the kernel reads them all ahead anyway: ``prefetch``)
    read_batch = 2

    def __init__(self, root: str | Path, budget: int, *, fsync: bool = True,
                 rebuild_in_background: bool = True) -> None:
        super().__init__()
        self.root = Path(root)
        self.budget = budget
        self.blob_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        self.quarantine_dir = self.root / "quarantine"
        self._fsync = fsync
        self._lock = threading.Lock()          # serialises budget accounting and eviction
        self._touch_lock = threading.Lock()    # the touches not written yet (never held long)
        self._touched: set[str] = set()
        self._touched_at = time.monotonic()
        self.evictions = 0
        self.recovered: str | None = None       # why the index was rebuilt at open, if it was
        self.rebuild_thread: threading.Thread | None = None
        try:
            for d in (self.blob_dir, self.tmp_dir, self.quarantine_dir):
                d.mkdir(parents=True, exist_ok=True)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable", str(self.root))
            self.index = self._open_index(rebuild_in_background)
        except (OSError, sqlite3.Error, IndexDamaged) as exc:  # (a full disk at open, say)
            reason = getattr(exc, "strerror", None) or exc
            raise TierUnavailable(f"disk tier at {self.root} cannot be used: {reason}",
                                  hint="check that disk_path exists, is writable by the "
                                       "server and has room; serving goes on without the "
                                       "disk tier") from exc

    # --- the index, and recovering it -----------------------------------------------------------

    def _open_index(self, background: bool) -> DiskKeyIndex:
        path = self.root / "index.sqlite"
        with file_lock(self.root / "index.lock"):
            try:
                index = DiskKeyIndex(path)
                index.check()
                return index
            except IndexDamaged as exc:
                with contextlib.suppress(Exception):
                    index.close()         # type: ignore[possibly-undefined]
                moved = path.with_name(f"index.sqlite.damaged-{int(time.time())}")
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.replace(f"{path}{suffix}", f"{moved}{suffix}")
                self.recovered = str(exc)
                log.error("disk tier: %s; moved it to %s and rebuilding it from the blob files "
                          "(links and pins made since the blobs were saved are lost)", exc,
                          moved.name)
                index = DiskKeyIndex(path)
        if background:
            self.rebuild_thread = threading.Thread(target=self._rebuild, args=(index,),
                                                   name="cwm-index-rebuild", daemon=True)
            self.rebuild_thread.start()
        else:
            self._rebuild(index)
        return index

    def _rebuild(self, index: DiskKeyIndex) -> None:
        t0 = time.monotonic()
        rows: list[tuple[str, int, bytes, float]] = []
        n = bad = 0
        for path in self.blob_dir.glob("*/*/*"):
            try:
                key = key_of_file(path)
                st = path.stat()
            except (OSError, CorruptBlob) as exc:
                bad += 1
                with contextlib.suppress(OSError):
                    os.replace(path, self.quarantine_dir / f"{path.name}.{int(time.time())}")
                log.warning("disk tier rebuild: %s is unreadable (%s); quarantined", path.name,
                            exc)
                continue
            rows.append((path.name, st.st_size, key, st.st_mtime))
            n += 1
            if len(rows) >= 500:
                index.insert_rebuilt(rows)
                rows = []
                if n % 5000 == 0:
                    log.info("disk tier rebuild: %d blobs indexed", n)
        if rows:
            index.insert_rebuilt(rows)
        log.warning("disk tier: index rebuilt from %d blob files in %.1fs (%d unreadable)", n,
                    time.monotonic() - t0, bad)

    def path(self, blob_id: str) -> Path:
        if len(blob_id) < 8 or not all(c in "0123456789abcdef" for c in blob_id):
            raise ValueError(f"not a blob id: {blob_id!r}")
        return self.blob_dir / blob_id[:2] / blob_id[2:4] / blob_id

    # --- blobs --------------------------------------------------------------------------------

    def get_many(self, blob_ids: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for b in blob_ids:
            try:
                with open(self.path(b), "rb") as f:
                    out.append(f.read())
            except FileNotFoundError:
                out.append(None)
        self._touch([b for b, d in zip(blob_ids, out, strict=True) if d is not None])
        return out

    def read_lent(self, blob_ids: Sequence[str], buffers: ReadBuffers
                  ) -> list[bytes | memoryview | None]:
        """Each blob file read into a buffer ``buffers`` lends (reused: no fresh pages to
        fault in, see :mod:`cwm_plugin.store.read_buffers`)."""
        out: list[bytes | memoryview | None] = []
        for b in blob_ids:
            try:
                with open(self.path(b), "rb", buffering=0) as f:
                    view = buffers.take(os.fstat(f.fileno()).st_size)
                    n = 0
                    while n < len(view) and (got := f.readinto(view[n:])):
                        n += got
                    out.append(view[:n] if n < len(view) else view)   # shrank: short, corrupt
            except FileNotFoundError:
                out.append(None)
        self._touch([b for b, d in zip(blob_ids, out, strict=True) if d is not None])
        return out

    def prefetch(self, blob_ids: Sequence[str]) -> None:
        """Ask the kernel to start reading these files now (``POSIX_FADV_WILLNEED``), so that
        a cold read of many blobs overlaps with decoding the first ones."""
        advise_files([self.path(b) for b in blob_ids], "WILLNEED")

    def _touch(self, blob_ids: list[str], force: bool = False) -> None:
        """Record reads for the LRU, batched. Reads (not ``force``) wait ``TOUCH_WAIT_S`` at
        most for the write lock (another process may hold it for seconds) and keep the
        touches for the next time when it is busy; the eviction lock is never taken here."""
        with self._touch_lock:
            self._touched.update(blob_ids)
            due = force or len(self._touched) >= TOUCH_BATCH or \
                time.monotonic() - self._touched_at >= TOUCH_EVERY_S
            if not due or not self._touched:
                return
            ids, self._touched = list(self._touched), set()
            self._touched_at = time.monotonic()
        try:
            self.index.touch(ids, timeout_s=None if force else TOUCH_WAIT_S)
        except sqlite3.OperationalError as exc:
            if force or not is_lock_error(exc):
                raise
            with self._touch_lock:
                self._touched.update(ids)

    def has_blob(self, blob_id: str) -> bool:
        return self.index.has_blob(blob_id)

    def put(self, blob_id: str, data: bytes, key: bytes, *, replace: bool = False) -> bool:
        final = self.path(blob_id)
        if len(data) > self.budget:
            return False
        if self.index.has_blob(blob_id):
            self.index.add_blob(blob_id, len(data), key, ensure=lambda: self._ensure(final, data),
                                replace=replace, unlink=self._unlink)
            return True
        self._touch([], force=True)
        with self._lock:
            evicted = self._make_room(len(data))
            if evicted is None:
                return False
        self._dropped(evicted, "evicted")
        try:
            self._write_atomic(final, data)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self._write_after_enospc(final, data)
        if not self.index.add_blob(blob_id, len(data), key, replace=replace, unlink=self._unlink,
                                   ensure=lambda: self._ensure(final, data)):
            final.unlink(missing_ok=True)       # the key kept the blob another writer saved
        return True

    def _ensure(self, final: Path, data: bytes) -> None:
        """(inside the index transaction) The file must be there when its row commits: a
        removal in another process may have unlinked it after we renamed it into place."""
        if not final.exists():
            self._write_atomic(final, data)

    def _write_after_enospc(self, final: Path, data: bytes) -> None:
        # The file system is fuller than our budget thinks: free more, retry once.
        log.warning("disk tier: no space left writing %d bytes; evicting and retrying", len(data))
        with self._lock:
            evicted = self._make_room(len(data) + max(len(data), self.budget // 10), force=True)
        if not evicted:
            raise StorageFull("disk tier is full and nothing can be evicted",
                              hint="raise disk_bytes or free space")
        self._dropped(evicted, "evicted")
        try:
            self._write_atomic(final, data)
        except OSError as exc:
            raise StorageFull(f"disk tier write failed: {exc.strerror}",
                              hint="free space under the store's disk_path") from exc

    def _write_atomic(self, final: Path, data: bytes) -> None:
        tmp = self.tmp_dir / f"{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self._fsync:
            fsync_dir(final.parent)

    def _make_room(self, size: int, *, force: bool = False) -> list[bytes] | None:
        """(under ``_lock``) Evict LRU unpinned blobs so ``size`` fits; the keys dropped, or
        None when even that would not make room (nothing evicted then)."""
        self.index.expire_pins()
        used, _ = self.index.totals()
        need = size if force else used + size - self.budget
        if need <= 0:
            return []
        victims = self.index.eviction_candidates(need)
        if not victims or (not force and sum(s for _, s in victims) < need):
            return None
        ids = [b for b, _ in victims]
        dropped = self.index.remove_blobs(ids, unlink=self._unlink, unpinned_only=True)
        self.evictions += len(ids)
        log.debug("disk tier: evicted %d blobs", len(ids))
        return dropped

    def _unlink(self, blob_ids: Sequence[str]) -> None:
        for b in blob_ids:
            self.path(b).unlink(missing_ok=True)

    def forget_blobs(self, blob_ids: Sequence[str], reason: str,
                     keys: Sequence[bytes] = ()) -> list[bytes]:
        dropped = self.index.remove_blobs(list(blob_ids), unlink=self._unlink)
        self._dropped(dropped, reason)
        return dropped

    def quarantine(self, blob_id: str, reason: str = "") -> Path | None:
        """Move a damaged blob aside (out of the index, its keys reported dropped)."""
        dst = self.quarantine_dir / f"{blob_id}.{int(time.time())}"

        def move(ids: Sequence[str]) -> None:
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path(blob_id), dst)
        self._dropped(self.index.remove_blobs([blob_id], unlink=move), "quarantined")
        if not dst.exists():
            return None
        if reason:
            dst.with_suffix(dst.suffix + ".why").write_text(reason + "\n")
        return dst

    # --- keys ---------------------------------------------------------------------------------

    def lookup_many(self, keys: Sequence[bytes]) -> list[str | None]:
        found = self.index.lookup_many(keys)
        return [found.get(bytes(k)) for k in keys]

    def link_many(self, links: Sequence[tuple[bytes, str]]) -> list[bytes]:
        return self.index.link_many(links, unlink=self._unlink)

    def delete_many(self, keys: Sequence[bytes]) -> list[bytes]:
        return self.index.delete_many(keys, unlink=self._unlink)

    def pin_many(self, keys: Sequence[bytes], *, ttl_s: float | None = None,
                 quota_bytes: int | None = None) -> list[bytes]:
        return self.index.pin_many(keys, ttl_s=ttl_s, quota_bytes=quota_bytes)

    def lease_many(self, keys: Sequence[bytes], *, ttl_s: float) -> list[bytes]:
        return self.index.lease_many(keys, ttl_s=ttl_s)

    def unpin_many(self, keys: Sequence[bytes]) -> list[bytes]:
        return self.index.unpin_many(keys)

    def info_many(self, keys: Sequence[bytes]) -> list[KeyInfo | None]:
        self.index.expire_pins()
        found = {row[0]: KeyInfo(*row) for row in self.index.info_many(keys)}
        return [found.get(bytes(k)) for k in keys]

    def list_keys(self, prefix: bytes = b"", *, after: bytes | None = None,
                  limit: int = 1000) -> list[KeyInfo]:
        self.index.expire_pins()
        return [KeyInfo(*row) for row in self.index.list_keys(prefix, after, limit)]

    # --- maintenance --------------------------------------------------------------------------

    def blob_ids(self) -> list[str]:
        return self.index.all_blobs()

    def unreferenced(self, min_age_s: float = 0.0) -> list[str]:
        return self.index.unreferenced(min_age_s)

    def dangling_keys(self) -> list[bytes]:
        return self.index.dangling_keys()

    def orphans(self, min_age_s: float = 60.0) -> list[Path]:
        """Files not in the index, and temp files older than ``min_age_s`` (killed writers)."""
        now = time.time()
        known = set(self.index.all_blobs())
        out = [p for p in self.tmp_dir.iterdir() if now - p.stat().st_mtime > min_age_s]
        for p in self.blob_dir.glob("*/*/*"):
            if p.name not in known and now - p.stat().st_mtime > min_age_s:
                out.append(p)
        return out

    def usage(self) -> TierUsage:
        size, count = self.index.totals()
        keys, pinned = self.index.counts()
        return TierUsage(self.name, size, count, self.budget, keys=keys, pinned_bytes=pinned)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._touch([], force=True)
        if self.rebuild_thread is not None:
            self.rebuild_thread.join(timeout=60)
        self.index.close()
