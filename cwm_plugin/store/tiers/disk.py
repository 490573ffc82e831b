"""Local disk tier: one file a blob in sharded folders, atomic writes, a byte budget.

A blob is written to ``tmp/`` under a unique name, fsynced, renamed to
``blobs/<ab>/<cd>/<blob_id>`` and only then entered in the SQLite index; so a writer killed at
any point leaves at most an invisible temp file or an unindexed file (``gc`` removes both), and
two writers of one blob rename identical bytes over each other. Over budget, the least recently
used blobs that no pinned key protects go first; a write that still does not fit (or hits ENOSPC) is refused
cleanly with :class:`StorageFull`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from cwm_plugin.errors import StorageFull
from cwm_plugin.store.index import BlobIndex
from cwm_plugin.store.tiers.base import EvictCallback, Tier, TierUsage

log = logging.getLogger(__name__)


class DiskTier(Tier):
    name = "disk"

    def __init__(self, root: str | Path, budget: int, *, index: BlobIndex | None = None,
                 on_evict: EvictCallback | None = None, fsync: bool = True) -> None:
        self.root = Path(root)
        self.budget = budget
        self.blob_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        self.quarantine_dir = self.root / "quarantine"
        for d in (self.blob_dir, self.tmp_dir, self.quarantine_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.index = index if index is not None else BlobIndex(self.root / "index.sqlite")
        self._on_evict = on_evict
        self._fsync = fsync
        self._lock = threading.Lock()          # serialises budget accounting and eviction
        self.evictions = 0

    def path(self, blob_id: str) -> Path:
        if len(blob_id) < 8 or not all(c in "0123456789abcdef" for c in blob_id):
            raise ValueError(f"not a blob id: {blob_id!r}")
        return self.blob_dir / blob_id[:2] / blob_id[2:4] / blob_id

    # --- reads --------------------------------------------------------------------------------

    def get(self, blob_id: str) -> bytes | None:
        try:
            with open(self.path(blob_id), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def get_many(self, blob_ids: Sequence[str]) -> list[bytes | None]:
        out = [self.get(b) for b in blob_ids]
        hit = [b for b, d in zip(blob_ids, out, strict=True) if d is not None]
        if hit:
            self.index.touch(hit)
        return out

    def contains(self, blob_id: str) -> bool:
        return self.index.has_blob(blob_id)

    # --- writes -------------------------------------------------------------------------------

    def put(self, blob_id: str, data: bytes, *, key: bytes | None = None) -> bool:
        """Store a blob; with ``key``, map it in the same index transaction that records the
        blob (False: refused, nothing written, ``key`` not mapped)."""
        final = self.path(blob_id)
        if self.index.has_blob(blob_id) and final.exists():
            return key is None or self.index.map_key(key, blob_id)
        if len(data) > self.budget:
            return False
        with self._lock:
            if not self._make_room(len(data)):
                return False
            try:
                self._write_atomic(final, data)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # The file system is fuller than our budget thinks: free more, retry once.
                log.warning("disk tier: no space left writing %d bytes; evicting and retrying",
                            len(data))
                if not self._make_room(len(data) + max(len(data), self.budget // 10),
                                       force=True):
                    raise StorageFull("disk tier is full and nothing can be evicted",
                                      hint="raise disk_bytes or free space") from exc
                try:
                    self._write_atomic(final, data)
                except OSError as exc2:
                    raise StorageFull(f"disk tier write failed: {exc2.strerror}",
                                      hint="free space under the store's disk_path") from exc2
            self.index.add_blob(blob_id, len(data), key=key)
        return True

    def _write_atomic(self, final: Path, data: bytes) -> None:
        tmp = self.tmp_dir / f"{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
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
            _fsync_dir(final.parent)

    def _make_room(self, size: int, *, force: bool = False) -> bool:
        used, _ = self.index.totals()
        need = used + size - self.budget if not force else size
        if need <= 0:
            return True
        victims = self.index.eviction_candidates(need)
        freed = sum(s for _, s in victims)
        if freed < need and not force:
            return False
        if not victims:
            return False
        self._remove([b for b, _ in victims])
        self.evictions += len(victims)
        log.debug("disk tier: evicted %d blobs (%d bytes)", len(victims), freed)
        if self._on_evict is not None:
            self._on_evict([b for b, _ in victims])
        return force or freed >= need

    def _remove(self, blob_ids: list[str]) -> None:
        self.index.remove_blobs(blob_ids)       # index first: no reader sees a missing file
        for b in blob_ids:
            self.path(b).unlink(missing_ok=True)

    def delete(self, blob_id: str) -> bool:
        existed = self.index.has_blob(blob_id)
        self._remove([blob_id])
        return existed

    def quarantine(self, blob_id: str, reason: str = "") -> Path | None:
        """Move a damaged blob aside (out of the index) so it is never served again."""
        self.index.remove_blobs([blob_id])
        src = self.path(blob_id)
        dst = self.quarantine_dir / f"{blob_id}.{int(time.time())}"
        try:
            os.replace(src, dst)
        except FileNotFoundError:
            return None
        if reason:
            dst.with_suffix(dst.suffix + ".why").write_text(reason + "\n")
        return dst

    # --- maintenance --------------------------------------------------------------------------

    def orphans(self, min_age_s: float = 60.0) -> list[Path]:
        """Files not in the index, and temp files older than ``min_age_s`` (killed writers)."""
        now = time.time()
        known = {b for b, _ in self.index.all_blobs()}
        out = [p for p in self.tmp_dir.iterdir() if now - p.stat().st_mtime > min_age_s]
        for p in self.blob_dir.glob("*/*/*"):
            if p.name not in known and now - p.stat().st_mtime > min_age_s:
                out.append(p)
        return out

    def usage(self) -> TierUsage:
        size, count = self.index.totals()
        return TierUsage(self.name, size, count, self.budget)

    def close(self) -> None:
        self.index.close()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
