"""cwm_plugin.store"""
