"""Key operations of :class:`~cwm_plugin.store.tiered.KVStore`: presence, delete, link, pins.

All tiers agree on these semantics:

* ``link(new_key, existing_key)`` points ``new_key`` at ``existing_key``'s blob without copying
  it (its reference count + 1). If ``new_key`` already points to another blob it is
  *re-pointed*: the old blob loses a reference (and is deleted when none is left), and a pin on
  ``new_key`` now protects the new blob.
* Pins belong to keys: a blob is never evicted while any pinned key points to it, so unpinning
  a clone never unprotects the window it was cloned from. ``pin`` waits for the key's pending
  save and write-behinds first (so ``put(k); pin(k)`` works with any write policy).
* ``delete(key)`` drops the key and its pin; a blob no key points to any more is deleted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cwm_plugin.errors import NotFound, TierUnavailable

if TYPE_CHECKING:
    from cwm_plugin.store.tiered import KVStore

    _Base = KVStore
else:
    _Base = object


class KeyOps(_Base):
    """Mixin of KVStore (uses its tiers, maps, lock and queue)."""

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Cheap presence check (no decode), valid across processes sharing the config."""
        keys = [bytes(k) for k in keys]
        out = [k in self._keys for k in keys]
        rest = [k for k, hit in zip(keys, out, strict=True) if not hit]
        found: set[bytes] = set()
        if rest and self.index is not None:
            found |= set(self._index_lookup(rest))
            rest = [k for k in rest if k not in found]
        if rest and self.redis is not None:
            with contextlib.suppress(TierUnavailable):
                found |= {k for k, e in zip(rest, self.redis.exists_many(rest), strict=True) if e}
        return [hit or k in found for k, hit in zip(keys, out, strict=True)]

    def delete(self, key: bytes) -> bool:
        key = bytes(key)
        self._saves.wait_key(key)
        found = False
        with self._lock:
            self._pinned.discard(key)
            blob_id = self._keys.pop(key, None)
            if blob_id is not None:
                found = True
                self._drop_memory_ref(blob_id, key)
        if self.index is not None:
            b, left = self.index.unmap_key(key)
            if b is not None:
                found = True
                if left == 0 and self.disk is not None:
                    self.disk.delete(b)
        if self.redis is not None:
            try:
                b, left = self.redis.unmap_key(key)
                if b is not None:
                    found = True
                    if left <= 0:
                        self.redis.delete(b)
            except TierUnavailable as exc:
                self._log_once("redis-delete", "store: delete could not reach redis: %s", exc)
        self._gauges()
        return found

    def _drop_memory_ref(self, blob_id: str, key: bytes) -> None:
        """(under the lock) ``key`` no longer points to ``blob_id`` in this process."""
        refs = self._by_blob.get(blob_id, set())
        refs.discard(key)
        if not refs:
            self._by_blob.pop(blob_id, None)
            if self.memory is not None:
                self.memory.delete(blob_id)
        elif self.memory is not None:
            self.memory.pin(blob_id, any(k in self._pinned for k in refs))

    def link(self, new_key: bytes, existing_key: bytes) -> None:
        """Make ``new_key`` point to ``existing_key``'s blob (no copy; see the module doc)."""
        new_key, existing_key = bytes(new_key), bytes(existing_key)
        self._saves.wait_key(existing_key)
        self._saves.wait_key(new_key)
        linked = False
        with self._lock:
            blob_id = self._keys.get(existing_key)
            if blob_id is not None:
                old = self._keys.get(new_key)
                if old != blob_id:
                    if old is not None:
                        self._drop_memory_ref(old, new_key)
                    self._keys[new_key] = blob_id
                    self._by_blob.setdefault(blob_id, set()).add(new_key)
                    if self.memory is not None and new_key in self._pinned:
                        self.memory.pin(blob_id, True)
                linked = True
        if self.index is not None:
            b = self.index.lookup(existing_key)
            if b is not None:
                done, old, left = self.index.repoint(new_key, b)
                linked = linked or done
                if old is not None and left == 0 and self.disk is not None:
                    self.disk.delete(old)
        if self.redis is not None:
            try:
                b = self.redis.lookup_many([existing_key])[0]
                if b is not None:
                    status, old, left = self.redis.map_key(new_key, b, replace=True)
                    linked = linked or status == 1
                    if old is not None and left <= 0:
                        self.redis.delete(old)
            except TierUnavailable as exc:
                self._log_once("redis-link", "store: link could not reach redis: %s", exc)
        if not linked:
            raise NotFound(f"cannot link: key {existing_key.hex()[:16]} is not in the store",
                           hint="save the block first")
        self._gauges()

    def pin(self, key: bytes) -> None:
        """Protect ``key``'s blob from eviction while this key is pinned (see the module doc)."""
        self._set_pin(bytes(key), True)

    def unpin(self, key: bytes) -> None:
        self._set_pin(bytes(key), False)

    def pinned(self, key: bytes) -> bool:
        """Whether ``key`` is pinned (this process, the disk index or Redis)."""
        key = bytes(key)
        if key in self._pinned:
            return True
        if self.index is not None and self.index.is_key_pinned(key):
            return True
        if self.redis is not None:
            with contextlib.suppress(TierUnavailable):
                b = self.redis.lookup_many([key])[0]
                return b is not None and self.redis.is_pinned(key, b)
        return False

    def _set_pin(self, key: bytes, pinned: bool) -> None:
        self._saves.wait_key(key)
        blob_id = self._resolve([key])[0]
        if blob_id is None:
            raise NotFound(f"cannot {'pin' if pinned else 'unpin'}: key {key.hex()[:16]} is "
                           "not in the store", hint="save the block first")
        with self._lock:
            if pinned:
                self._pinned.add(key)
            else:
                self._pinned.discard(key)
            mine = self._keys.get(key)
            if self.memory is not None and mine is not None:
                refs = self._by_blob.get(mine, set())
                self.memory.pin(mine, any(k in self._pinned for k in refs))
        if self.index is not None:
            self.index.pin_key(key, pinned)
        if self.redis is not None:
            try:
                b = self.redis.lookup_many([key])[0]
                if b is not None:
                    self.redis.pin(b, key, pinned)
            except TierUnavailable as exc:
                self._log_once("redis-pin", "store: pin could not reach redis: %s", exc)

    def _memory_evicted(self, blob_ids: list[str]) -> None:
        self.metrics.evictions.labels("memory").inc(len(blob_ids))
        with self._lock:
            for b in blob_ids:
                for k in self._by_blob.pop(b, set()):
                    self._keys.pop(k, None)
