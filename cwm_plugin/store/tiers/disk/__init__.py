"""The disk tier: one file a blob, atomic writes, a SQLite key index."""

from cwm_plugin.store.tiers.disk.tier import DiskTier, open_tier

__all__ = ["DiskTier", "open_tier"]
