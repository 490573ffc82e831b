"""The one small interface every storage tier implements.

A tier stores *blobs* (encoded blocks) under their content id (a hex digest of the blob's
bytes); which key points to which blob is the index's business (SQLite for local tiers, Redis
for the shared tier). Tiers never decode; they move bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class TierUsage:
    name: str
    bytes: int
    blobs: int
    budget: int | None = None   # None: no budget of ours (e.g. Redis' own maxmemory)


# Called with the blob ids a tier evicted to make room, so the store can drop their keys.
EvictCallback = Callable[[list[str]], None]


class Tier(ABC):
    """Content-addressed blob storage. Implementations must be safe to call from threads."""

    name: str = "tier"

    @abstractmethod
    def get(self, blob_id: str) -> bytes | None:
        """The blob's bytes, or None when this tier does not hold it."""

    def get_many(self, blob_ids: Sequence[str]) -> list[bytes | None]:
        return [self.get(b) for b in blob_ids]

    @abstractmethod
    def put(self, blob_id: str, data: bytes) -> bool:
        """Store a blob; False if it was refused (too large for the budget). Raises
        :class:`~cwm_plugin.errors.StorageFull` or ``TierUnavailable`` on hard failures."""

    @abstractmethod
    def contains(self, blob_id: str) -> bool: ...

    @abstractmethod
    def delete(self, blob_id: str) -> bool: ...

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (connections, files)."""
