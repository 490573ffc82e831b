"""The RAM tier: an LRU of blobs in this process."""

from cwm_plugin.store.tiers.ram.tier import RamTier, open_tier

__all__ = ["RamTier", "open_tier"]
