"""The window engine as the sidecar's ``windows:`` settings describe it: the one way the
sidecar, ``cwm window --store`` and ``cwm mcp --store`` open it, so each applies the same
``keep_turns``, waits, tenant quota and longest TTL.

``--store`` takes the sidecar's config file (its ``windows:`` section) or a bare store file
(the store's settings at top level or under ``store:``; the windows settings are then the
sidecar's defaults).
"""

from __future__ import annotations

from pathlib import Path

from cwm_plugin.config_file import validate
from cwm_plugin.typed_config import read_yaml
from cwm_plugin.windows.engine import WindowEngine
from cwm_plugin.windows.settings import WindowsSettings


def open_engine(w: WindowsSettings) -> WindowEngine:
    """The engine over ``w.store``, its memory tier off (vLLM's memory is not this
    process's); a bad export key fails here, never turns windows off unnoticed."""
    from prometheus_client import CollectorRegistry

    from cwm_plugin.store.config import StoreConfig
    from cwm_plugin.store.kv_store import KVStore

    export_key = w.export_secret()
    cfg = StoreConfig.from_dict({**w.store, "memory_bytes": 0})
    return WindowEngine(KVStore(cfg, registry=CollectorRegistry()), wait_s=w.wait_s,
                        keep_turns=w.keep_turns, settle_s=w.settle_s,
                        tenant_quota_bytes=w.tenant_quota_bytes, max_ttl_s=w.max_ttl_s,
                        export_key=export_key)


def windows_settings(path: str | Path) -> WindowsSettings:
    """The ``windows:`` settings of a sidecar config file, or the defaults over a store file."""
    data = read_yaml(path)
    if isinstance(data.get("windows"), dict):
        section = data["windows"]
    else:
        section = {"store": data["store"] if isinstance(data.get("store"), dict) else data}
    return validate(WindowsSettings, section, path, "windows")
