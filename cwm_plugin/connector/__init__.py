"""cwm_plugin.connector"""
