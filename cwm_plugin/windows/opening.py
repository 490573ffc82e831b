"""The window engine as the sidecar's ``windows:`` settings describe it: the one way the
sidecar, ``cwm window --store`` and ``cwm mcp --store`` open it, so each applies the same
``keep_turns``, waits, tenant quota and longest TTL.

``--store`` takes the sidecar's config file (its ``windows:`` section, and its tenants and
providers: the principals an ``auto`` tenant quota is shared by) or a bare store file (the
store's settings at top level or under ``store:``; the windows settings are then the
sidecar's defaults, for one principal).
"""

from __future__ import annotations

from pathlib import Path

from cwm_plugin.config_file import validate
from cwm_plugin.typed_config import read_yaml
from cwm_plugin.windows.engine import WindowEngine
from cwm_plugin.windows.settings import WindowsSettings


def open_engine(w: WindowsSettings, principals: int = 1) -> WindowEngine:
    """The engine over ``w.store``, its memory tier off (vLLM's memory is not this
    process's), for ``principals`` tenants and providers (they share the store's pin quota);
    a bad export key or tenant quota fails here, never turns windows off unnoticed."""
    from prometheus_client import CollectorRegistry

    from cwm_plugin.store.config import StoreConfig
    from cwm_plugin.store.kv_store import KVStore

    export_key = w.export_secret()
    cfg = StoreConfig.from_dict({**w.store, "memory_bytes": 0})
    store = KVStore(cfg, registry=CollectorRegistry())
    try:
        return WindowEngine(store, wait_s=w.wait_s, keep_turns=w.keep_turns,
                            settle_s=w.settle_s, tenant_quota_bytes=w.tenant_quota_bytes,
                            principals=principals, max_ttl_s=w.max_ttl_s,
                            export_key=export_key)
    except BaseException:
        store.close()
        raise


def windows_settings(path: str | Path) -> tuple[WindowsSettings, int]:
    """The ``windows:`` settings of a sidecar config file and its principals (tenants and
    providers: ``Settings.principals``), or the defaults over a store file and one."""
    data = read_yaml(path)
    if isinstance(data.get("windows"), dict):
        section = data["windows"]
        principals = sum(len(v) for k in ("tenants", "providers")
                         if isinstance(v := data.get(k), list))
    else:
        section = {"store": data["store"] if isinstance(data.get("store"), dict) else data}
        principals = 1
    return validate(WindowsSettings, section, path, "windows"), principals
