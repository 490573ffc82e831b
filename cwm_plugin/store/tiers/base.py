"""The one interface every storage tier implements: blobs *and* the key index over them.

A tier stores *blobs* (encoded blocks) under their content id (a hex digest of the blob's
bytes) and owns the index that maps *keys* (opaque bytes: namespace + rank + vLLM block hash)
to blobs, with reference counts and pins. Tiers never decode; they move bytes and keep their
own index consistent. The composition (lookup order, promotion, write policy) is
:class:`~cwm_plugin.store.kv_store.KVStore`'s business.

Key semantics shared by every tier:

* ``put(blob_id, data, key)`` stores the blob (kept as it is if present) and maps ``key`` to it
  in one atomic step. A key that already points to another *held* blob keeps it (first writer
  wins); a key whose blob is gone is re-pointed.
* ``link_many([(key, blob_id), ...])`` points each key at a blob this tier holds (re-pointing a
  key that points elsewhere: the old blob loses a reference and is freed at zero). One atomic
  step per call.
* ``delete_many(keys)`` drops keys and their pins; a blob no key points to any more is freed.
* Pins belong to keys (a blob is protected while any pinned, unexpired key points to it), may
  carry an expiry, and are limited per *group* (the first :data:`GROUP_BYTES` bytes of a key:
  namespace and rank) by a byte quota counted over distinct pinned blobs.
* A *lease* (``lease_many``) is a short pin with an expiry that no quota counts: it protects a
  block between the connector's lookup and its load. It never turns a pin into a lease (a
  shorter pin's expiry is only pushed out to the lease's), and a pin taken on a leased key
  makes it a pin. A tier where nothing of ours evicts or expires keys may only renew TTLs.
* Whatever a tier drops by itself (LRU eviction, TTL expiry, a key found dangling, quarantine)
  it reports to its drop listener as the keys that now answer "absent".
"""

from __future__ import annotations

import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cwm_plugin.errors import CWMError, TierUnavailable

if TYPE_CHECKING:
    from cwm_plugin.store.read_buffers import ReadBuffers

# namespace digest (16) + rank (2): keys of one group share refcounts, pins and a quota
GROUP_BYTES = 18
# what a failing tier raises: the store counts it and goes on with the other tiers
TIER_ERRORS = (TierUnavailable, OSError, sqlite3.Error)


def group_of(key: bytes) -> bytes:
    return bytes(key[:GROUP_BYTES])


class QuotaExceeded(CWMError):
    """Pinning would take a group's pinned bytes over its quota."""

    code = "pin_quota_exceeded"
    http_status = 507


@dataclass
class TierUsage:
    name: str
    bytes: int
    blobs: int
    budget: int | None = None   # None: no budget of ours (e.g. Redis' own maxmemory)
    keys: int | None = None
    pinned_bytes: int = 0


@dataclass(frozen=True)
class KeyInfo:
    """One key of a tier's index (``list_keys``)."""

    key: bytes
    blob_id: str
    pinned: bool = False
    pin_expires: float | None = None   # unix time; None: no expiry
    size: int | None = None            # the blob's size, when the tier knows it
    leased: bool = False               # the pin is a lease (:meth:`Tier.lease_many`)


# Called with the keys a tier dropped on its own and why ("evicted", "expired", "dangling",
# "quarantined", "reset"), so the store can tell the scheduler they are gone.
DropListener = Callable[[list[bytes], str], None]


class Tier(ABC):
    """Content-addressed blob storage with its own key index. Safe to call from threads."""

    name: str = "tier"
    durable: bool = False       # survives a restart of this process
    read_batch: int = 1 << 20   # the most blobs one get_many should ask for (a round trip)
    recovered: str | None = None   # why its index was rebuilt when it opened, if it was

    def __init__(self) -> None:
        self._on_drop: DropListener | None = None

    def set_drop_listener(self, listener: DropListener | None) -> None:
        self._on_drop = listener

    def _dropped(self, keys: Sequence[bytes], reason: str) -> None:
        if keys and self._on_drop is not None:
            self._on_drop([bytes(k) for k in keys], reason)

    # --- blobs --------------------------------------------------------------------------------

    @abstractmethod
    def get_many(self, blob_ids: Sequence[str]) -> list[bytes | None]:
        """The blobs' bytes, None where this tier does not hold one."""

    def get(self, blob_id: str) -> bytes | None:
        return self.get_many([blob_id])[0]

    def read_lent(self, blob_ids: Sequence[str], buffers: ReadBuffers
                  ) -> list[bytes | memoryview | None]:
        """The blobs for a reader that decodes them and gives the buffers back (the load
        path): a tier that reads files reads each into a buffer lent by ``buffers`` (a
        ``memoryview``: the reader returns it with ``buffers.give_back`` once decoded, and
        copies what it keeps); the others return ``bytes``, as :meth:`get_many`."""
        return list(self.get_many(blob_ids))

    def prefetch(self, blob_ids: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """A hint that these blobs are about to be read (the disk starts reading them)."""

    @abstractmethod
    def put(self, blob_id: str, data: bytes, key: bytes, *, replace: bool = False) -> bool:
        """Store a blob and map ``key`` to it (see the module doc; ``replace`` re-points a key
        that points to another held blob, freeing that one if unreferenced); False if refused
        (over budget). Raises ``StorageFull`` or ``TierUnavailable`` on hard failures."""

    @abstractmethod
    def has_blob(self, blob_id: str) -> bool: ...

    @abstractmethod
    def forget_blobs(self, blob_ids: Sequence[str], reason: str,
                     keys: Sequence[bytes] = ()) -> list[bytes]:
        """Take blobs out of service with the keys pointing to them (reported as dropped);
        returns those keys. ``keys``: keys known to point there (a tier that cannot find a
        blob's keys from the blob removes these, and finds the others dangling later)."""

    # --- keys ---------------------------------------------------------------------------------

    @abstractmethod
    def lookup_many(self, keys: Sequence[bytes]) -> list[str | None]:
        """The blob each key points to, None if absent."""

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is mapped to a blob this tier can serve."""
        return [b is not None for b in self.lookup_many(keys)]

    @abstractmethod
    def link_many(self, links: Sequence[tuple[bytes, str]]) -> list[bytes]:
        """Point keys at blobs this tier holds, atomically; returns the keys now pointing
        where asked (a link to a blob this tier lacks is skipped)."""

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> list[bytes]:
        """Drop keys and their pins, freeing blobs left unreferenced; returns the keys that
        were there."""

    @abstractmethod
    def pin_many(self, keys: Sequence[bytes], *, ttl_s: float | None = None,
                 quota_bytes: int | None = None) -> list[bytes]:
        """Pin keys (renewing the expiry of pinned ones), atomically; raises
        :class:`QuotaExceeded` (nothing pinned) when a group would exceed ``quota_bytes``.
        Returns the keys pinned (absent keys are skipped)."""

    @abstractmethod
    def lease_many(self, keys: Sequence[bytes], *, ttl_s: float) -> list[bytes]:
        """Lease present keys for ``ttl_s`` seconds, atomically (see the module doc): keys
        unpinned or leased for less become leased, pinned keys keep their pin (expiring no
        sooner than the lease). Returns the keys leased (pinned ones are left out)."""

    leases_released: bool = True   # False: a lease here only renews TTLs; nothing to release

    @abstractmethod
    def unpin_many(self, keys: Sequence[bytes]) -> list[bytes]:
        """Unpin keys (pins and leases); returns those that were pinned."""

    @abstractmethod
    def info_many(self, keys: Sequence[bytes]) -> list[KeyInfo | None]:
        """What the index holds for each key (None: absent)."""

    @abstractmethod
    def list_keys(self, prefix: bytes = b"", *, after: bytes | None = None,
                  limit: int = 1000) -> list[KeyInfo]:
        """Keys starting with ``prefix``, in byte order, after ``after`` (pagination)."""

    # --- maintenance --------------------------------------------------------------------------

    @abstractmethod
    def blob_ids(self) -> list[str]: ...

    @abstractmethod
    def unreferenced(self, min_age_s: float = 0.0) -> list[str]:
        """Blobs no key points to (older than ``min_age_s`` where the tier knows ages)."""

    def dangling_keys(self) -> list[bytes]:
        """Keys whose blob is gone (``gc`` removes them)."""
        return []

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (connections, files)."""
