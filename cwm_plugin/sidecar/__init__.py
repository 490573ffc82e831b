"""cwm_plugin.sidecar"""
