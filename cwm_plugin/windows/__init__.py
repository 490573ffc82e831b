"""cwm_plugin.windows"""
