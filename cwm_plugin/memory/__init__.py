"""cwm_plugin.memory"""
