"""Storage tiers of the KV block store: each holds content-addressed blobs behind one interface.

:class:`~cwm_plugin.store.tiers.base.Tier` is that interface. Each tier is a subpackage --
``ram`` (LRU in this process; its label is ``memory``), ``disk`` (atomic files, SQLite index),
``redis`` (shared between servers) -- whose ``open_tier(config)`` the registry
(:mod:`.registry`) calls, in lookup order.
"""

from cwm_plugin.store.tiers.base import Tier, TierUsage

__all__ = ["Tier", "TierUsage"]
