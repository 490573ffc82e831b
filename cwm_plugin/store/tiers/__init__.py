"""cwm_plugin.store.tiers"""
