"""Storage tiers of the KV block store: each holds content-addressed blobs behind one interface.

:class:`~cwm_plugin.store.tiers.base.Tier` is that interface; ``memory`` (LRU in RAM),
``disk`` (one file a blob, atomic writes) and ``redis`` (shared between servers) implement it.
"""

from cwm_plugin.store.tiers.base import Tier, TierUsage

__all__ = ["Tier", "TierUsage"]
