"""CPU memory tier: blobs and their key index in this process, LRU within a byte budget.

Blobs that a pinned key protects live outside the LRU (``_held``), so eviction pops from the
LRU's cold end without walking past pins: its cost does not grow with the number of pins. A
put that cannot fit even after evicting every unprotected blob is refused *before* anything is
evicted. Evicted blobs take their keys with them; the keys are reported to the drop listener.
Pin expiries sit in a heap and are applied lazily, before each eviction and pin query.

With *acknowledged eviction* (:meth:`RamTier.defer_evictions`) evicted blobs are retired first
and freed only once the connector's scheduler has seen them reported dropped (:mod:`.retired`).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cwm_plugin.store.tiers.base import KeyInfo, QuotaExceeded, Tier, TierUsage, group_of
from cwm_plugin.store.tiers.ram.retired import Retired

if TYPE_CHECKING:
    from cwm_plugin.store.config import StoreConfig


def open_tier(config: StoreConfig) -> RamTier | None:
    """The RAM tier of ``config`` (None: ``memory_bytes`` is 0)."""
    return RamTier(config.memory_bytes) if config.memory_bytes > 0 else None


class RamTier(Tier):
    name = "memory"
    durable = False

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget = budget
        self._lru: OrderedDict[str, bytes] = OrderedDict()   # unprotected blobs, cold first
        self._held: dict[str, bytes] = {}                    # blobs a pinned key protects
        self._bytes = 0
        self._keys: dict[bytes, str] = {}
        self._refs: dict[str, set[bytes]] = {}
        self._pins: dict[bytes, float | None] = {}           # key -> expiry (unix time)
        self._leased: set[bytes] = set()                     # pinned keys whose pin is a lease
        self._pinned_refs: dict[str, int] = {}               # blob -> pinned keys on it
        self._group_pinned: dict[bytes, int] = {}            # group -> pinned blob bytes
        self._held_group: dict[str, bytes] = {}              # pinned blob -> its group
        self._held_bytes = 0
        self._expiries: list[tuple[float, bytes]] = []
        self._lock = threading.RLock()
        self.evictions = 0
        self._deferred = False
        self._retired = Retired()                            # evicted, not freed yet

    # --- blobs --------------------------------------------------------------------------------

    def _data(self, blob_id: str, *, revive: bool = False) -> bytes | None:
        """(locked) A blob's bytes, made the LRU's most recent; ``revive``: a retired blob
        (saved or linked again) goes back in the LRU (a read alone leaves it retired)."""
        data = self._lru.get(blob_id)
        if data is not None:
            self._lru.move_to_end(blob_id)
            return data
        if revive and blob_id in self._retired:
            data = self._lru[blob_id] = self._retired.take(blob_id)
            return data
        return self._held.get(blob_id) or self._retired.get(blob_id)

    def get_many(self, blob_ids: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            return [self._data(b) for b in blob_ids]

    def has_blob(self, blob_id: str) -> bool:
        with self._lock:
            return blob_id in self._lru or blob_id in self._held or blob_id in self._retired

    def put(self, blob_id: str, data: bytes, key: bytes, *, replace: bool = False) -> bool:
        key = bytes(key)
        evicted: list[bytes] = []
        with self._lock:
            current = self._keys.get(key)
            if not replace and current is not None and current != blob_id and \
                    self.has_blob(current):
                self._data(current, revive=True)
                return True                       # first writer wins
            if not self.has_blob(blob_id):
                if not self._make_room(len(data), evicted):
                    return False
                self._lru[blob_id] = data
                self._bytes += len(data)
            else:
                self._data(blob_id, revive=True)
            self._map(key, blob_id)
        self._dropped(evicted, "evicted")
        return True

    def _make_room(self, size: int, evicted: list[bytes]) -> bool:
        """(locked) Evict cold unprotected blobs until ``size`` fits; refuse up front if even
        evicting all of them would not be enough."""
        self._expire_pins()
        need = self._bytes - self._retired.bytes + size - self.budget
        if need <= 0:
            return True
        if size > self.budget or self._held_bytes + size > self.budget:
            return False
        if self._deferred:     # the step's end retires what is over, up to twice the budget
            need = self._bytes + size - 2 * self.budget       # (the retired blobs included)
        while need > 0 and self._lru:
            blob_id, data = self._lru.popitem(last=False)
            self._bytes -= len(data)
            need -= len(data)
            self.evictions += 1
            for k in self._refs.pop(blob_id, set()):
                self._keys.pop(k, None)
                evicted.append(k)
        return True

    def forget_blobs(self, blob_ids: Sequence[str], reason: str,
                     keys: Sequence[bytes] = ()) -> list[bytes]:
        dropped: list[bytes] = []
        with self._lock:
            for b in blob_ids:
                for k in list(self._refs.get(b, ())):
                    self._unmap(k)
                    dropped.append(k)
                self._free(b)
        self._dropped(dropped, reason)
        return dropped

    def _free(self, blob_id: str) -> None:
        data = self._lru.pop(blob_id, None)
        if data is None and blob_id in self._retired:
            data = self._retired.take(blob_id)
        if data is None and blob_id in self._held:
            data = self._held.pop(blob_id)
            self._release_held(blob_id, len(data))
        if data is not None:
            self._bytes -= len(data)
        self._refs.pop(blob_id, None)
        self._pinned_refs.pop(blob_id, None)

    # --- keys ---------------------------------------------------------------------------------

    def _map(self, key: bytes, blob_id: str) -> None:
        """(locked) Point ``key`` at a held blob, moving its pin along."""
        old = self._keys.get(key)
        if old == blob_id:
            return
        pinned = key in self._pins
        if old is not None:
            self._unmap(key, keep_pin=True)
        self._keys[key] = blob_id
        self._refs.setdefault(blob_id, set()).add(key)
        if pinned:
            self._pin_ref(key, blob_id, +1)

    def _unmap(self, key: bytes, *, keep_pin: bool = False) -> None:
        """(locked) Drop ``key``; a blob left without keys is freed."""
        blob_id = self._keys.pop(key, None)
        if blob_id is None:
            return
        if key in self._pins:
            self._pin_ref(key, blob_id, -1)
            if not keep_pin:
                self._pins.pop(key, None)
                self._leased.discard(key)
        refs = self._refs.get(blob_id)
        if refs is not None:
            refs.discard(key)
            if not refs:
                self._free(blob_id)

    def _pin_ref(self, key: bytes, blob_id: str, delta: int) -> None:
        """(locked) One pinned key more or less on ``blob_id``: move it in or out of the LRU."""
        n = self._pinned_refs.get(blob_id, 0) + delta
        if n > 0:
            self._pinned_refs[blob_id] = n
            if blob_id in self._retired:          # leased while retired: protected again
                self._lru[blob_id] = self._retired.take(blob_id)
            if blob_id in self._lru:
                data = self._held[blob_id] = self._lru.pop(blob_id)
                group = self._held_group[blob_id] = group_of(key)
                self._group_pinned[group] = self._group_pinned.get(group, 0) + len(data)
                self._held_bytes += len(data)
        else:
            self._pinned_refs.pop(blob_id, None)
            if blob_id in self._held:
                data = self._lru[blob_id] = self._held.pop(blob_id)
                self._release_held(blob_id, len(data))

    def _release_held(self, blob_id: str, size: int) -> None:
        group = self._held_group.pop(blob_id, b"")
        self._group_pinned[group] = self._group_pinned.get(group, 0) - size
        self._held_bytes -= size

    def lookup_many(self, keys: Sequence[bytes]) -> list[str | None]:
        with self._lock:
            return [self._keys.get(bytes(k)) for k in keys]

    def link_many(self, links: Sequence[tuple[bytes, str]]) -> list[bytes]:
        done: list[bytes] = []
        with self._lock:
            for key, blob_id in links:
                if self._data(blob_id, revive=True) is not None:
                    self._map(bytes(key), blob_id)
                    done.append(bytes(key))
        return done

    def delete_many(self, keys: Sequence[bytes]) -> list[bytes]:
        out: list[bytes] = []
        with self._lock:
            for k in map(bytes, keys):
                if k in self._keys:
                    self._unmap(k)
                    out.append(k)
        return out

    def pin_many(self, keys: Sequence[bytes], *, ttl_s: float | None = None,
                 quota_bytes: int | None = None) -> list[bytes]:
        expires = None if ttl_s is None else time.time() + ttl_s
        with self._lock:
            self._expire_pins()
            present = [k for k in map(bytes, keys) if k in self._keys]
            if quota_bytes is not None:
                self._check_quota(present, quota_bytes)
            for k in present:
                self._leased.discard(k)
                self._set_pin(k, expires)
            return present

    def lease_many(self, keys: Sequence[bytes], *, ttl_s: float) -> list[bytes]:
        until = time.time() + ttl_s
        leased: list[bytes] = []
        with self._lock:
            self._expire_pins()
            for k in map(bytes, keys):
                if k not in self._keys:
                    continue
                expires = self._pins.get(k, 0.0)
                if expires is None or expires >= until:
                    continue                        # a pin or a lease that outlasts this one
                if k not in self._pins or k in self._leased:
                    self._leased.add(k)
                    leased.append(k)
                self._set_pin(k, until)             # a pin expiring sooner: pushed out
            return leased

    def _set_pin(self, k: bytes, expires: float | None) -> None:
        """(locked) Pin a present key (or renew its pin) until ``expires``."""
        if k not in self._pins:
            self._pin_ref(k, self._keys[k], +1)
        self._pins[k] = expires
        if expires is not None:
            heapq.heappush(self._expiries, (expires, k))

    def _lease_only(self) -> set[str]:
        """(locked) The blobs that only leases pin."""
        return {b for k in self._leased if (b := self._keys.get(k)) is not None and
                not any(r in self._pins and r not in self._leased for r in self._refs[b])}

    def _check_quota(self, keys: list[bytes], quota: int) -> None:
        """(locked) Raise if pinning ``keys`` takes a group's pinned bytes over ``quota``;
        blobs only leases pin count as unpinned."""
        lease_only = self._lease_only()
        held = set(self._pinned_refs) - lease_only
        total = dict(self._group_pinned)
        for b in lease_only & self._held.keys():
            g = self._held_group[b]
            total[g] = total.get(g, 0) - len(self._held[b])
        extra: dict[bytes, int] = {}
        for k in keys:
            b = self._keys[k]
            if b in held:
                continue
            held.add(b)
            g = group_of(k)
            extra[g] = extra.get(g, 0) + len(self._data(b) or b"")
        for g, add in extra.items():
            if total.get(g, 0) + add > quota:
                raise QuotaExceeded(
                    f"pinning {len(keys)} keys would hold {total.get(g, 0) + add:,}"
                    f" pinned bytes in the memory tier, over the quota of {quota:,}",
                    hint="delete or unpin windows, or raise pin_quota_bytes")

    def unpin_many(self, keys: Sequence[bytes]) -> list[bytes]:
        out: list[bytes] = []
        with self._lock:
            for k in map(bytes, keys):
                if k in self._pins:
                    del self._pins[k]
                    self._leased.discard(k)
                    out.append(k)
                    if k in self._keys:
                        self._pin_ref(k, self._keys[k], -1)
        return out

    def _expire_pins(self) -> None:
        now = time.time()
        while self._expiries and self._expiries[0][0] <= now:
            expires, k = heapq.heappop(self._expiries)
            if k in self._pins and self._pins[k] == expires:
                del self._pins[k]
                self._leased.discard(k)
                if k in self._keys:
                    self._pin_ref(k, self._keys[k], -1)

    def info_many(self, keys: Sequence[bytes]) -> list[KeyInfo | None]:
        with self._lock:
            self._expire_pins()
            return [self._info(bytes(k)) if bytes(k) in self._keys else None for k in keys]

    def _info(self, k: bytes) -> KeyInfo:
        b = self._keys[k]
        size = len(self._lru.get(b) or self._held.get(b) or self._retired.get(b) or b"")
        return KeyInfo(k, b, k in self._pins, self._pins.get(k), size, k in self._leased)

    def list_keys(self, prefix: bytes = b"", *, after: bytes | None = None,
                  limit: int = 1000) -> list[KeyInfo]:
        with self._lock:
            self._expire_pins()
            keys = sorted(k for k in self._keys if k.startswith(prefix)
                          and (after is None or k > after))[:limit]
            return [self._info(k) for k in keys]

    # --- acknowledged eviction ---------------------------------------------------------------

    def defer_evictions(self) -> None:
        """Evict only at :meth:`evict`, retiring blobs until :meth:`free_retired`
        (:mod:`.retired`)."""
        self._deferred = True

    def evict(self, step: int) -> list[bytes]:
        """Retire the coldest unprotected blobs until the budget holds (their keys reported
        dropped now, ``step`` noted for :meth:`free_retired`); returns those keys."""
        dropped: list[bytes] = []
        with self._lock:
            self._expire_pins()
            over = self._bytes - self._retired.bytes - self.budget
            while over > 0 and self._lru:
                blob_id, data = self._lru.popitem(last=False)
                self._retired.add(blob_id, data, step)
                over -= len(data)
                self.evictions += 1
                dropped.extend(self._refs.get(blob_id, ()))
        self._dropped(dropped, "evicted")
        return dropped

    def free_retired(self, upto: int) -> int:
        """Free the blobs retired at step ``upto`` or before (their keys go; they were reported
        dropped then); returns how many."""
        with self._lock:
            gone = self._retired.due(upto)
            for b in gone:
                for k in list(self._refs.get(b, ())):
                    self._keys.pop(k, None)
                self._free(b)
        return len(gone)

    # --- maintenance --------------------------------------------------------------------------

    def blob_ids(self) -> list[str]:
        with self._lock:
            return [*self._lru, *self._held, *self._retired]

    def unreferenced(self, min_age_s: float = 0.0) -> list[str]:
        with self._lock:
            return [b for b in self.blob_ids() if not self._refs.get(b)]

    def reset(self) -> None:
        """Drop every unpinned blob (vLLM's ``reset_cache``); the keys are reported."""
        with self._lock:
            unpinned = [*self._lru, *self._retired]
            dropped = [k for b in unpinned for k in self._refs.get(b, ())]
            for b in unpinned:
                for k in list(self._refs.get(b, ())):
                    self._keys.pop(k, None)
                self._free(b)
        self._dropped(dropped, "reset")

    def usage(self) -> TierUsage:
        with self._lock:
            leased = sum(len(self._held[b]) for b in self._lease_only() & self._held.keys())
            return TierUsage(self.name, self._bytes,
                             len(self._lru) + len(self._held) + len(self._retired),
                             self.budget, keys=len(self._keys),
                             pinned_bytes=self._held_bytes - leased)

    def close(self) -> None:
        with self._lock:
            self._lru.clear()
            self._held.clear()
            self._retired.clear()
            self._keys.clear()
            self._refs.clear()
            self._bytes = self._held_bytes = 0
