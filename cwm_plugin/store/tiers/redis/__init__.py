"""The Redis tier: blobs and their key index shared by every server."""

from cwm_plugin.store.tiers.redis.tier import RedisTier, open_tier

__all__ = ["RedisTier", "open_tier"]
