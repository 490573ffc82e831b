"""The memory tier's retired blobs: evicted and reported dropped, still readable until freed.

*Acknowledged eviction* (:meth:`~cwm_plugin.store.tiers.ram.tier.RamTier.defer_evictions`:
the connector's workers, whose scheduler promises blocks it believes are in this tier): a put
evicts nothing (up to twice the budget); at each step's end
:meth:`~cwm_plugin.store.tiers.ram.tier.RamTier.evict` *retires* the cold blobs over the budget
-- reported dropped at once, still readable -- and
:meth:`~cwm_plugin.store.tiers.ram.tier.RamTier.free_retired` frees them only once the
scheduler has seen that report. A block promised before the scheduler knew is still there when
its load leases it (a lease or a save of a retired blob brings it back), so a promise never
meets an eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class Retired:
    """Retired blobs in the order they were retired, the step each was retired at, and their
    bytes. Not thread-safe: the tier calls it under its lock."""

    def __init__(self) -> None:
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        self._at: dict[str, int] = {}
        self.bytes = 0

    def __contains__(self, blob_id: str) -> bool:
        return blob_id in self._blobs

    def __iter__(self) -> Iterator[str]:
        return iter(self._blobs)

    def __len__(self) -> int:
        return len(self._blobs)

    def get(self, blob_id: str) -> bytes | None:
        return self._blobs.get(blob_id)

    def add(self, blob_id: str, data: bytes, step: int) -> None:
        self._blobs[blob_id] = data
        self._at[blob_id] = step
        self.bytes += len(data)

    def take(self, blob_id: str) -> bytes:
        """Take a blob out of the retired ones (brought back, or freed); returns its bytes."""
        data = self._blobs.pop(blob_id)
        self._at.pop(blob_id, None)
        self.bytes -= len(data)
        return data

    def due(self, upto: int) -> list[str]:
        """The blobs retired at step ``upto`` or before."""
        return [b for b, step in self._at.items() if step <= upto]

    def clear(self) -> None:
        self._blobs.clear()
        self._at.clear()
        self.bytes = 0
