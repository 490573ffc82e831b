"""Settings of the KV connector, from ``kv_connector_extra_config`` with environment fallback.

Example ``--kv-transfer-config``::

    {"kv_connector": "CWMConnector", "kv_connector_module_path": "cwm_plugin.connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"store": {"disk_path": "/var/lib/cwm", "redis_url": null},
                                    "max_stored_tokens_per_request": 32768}}

Everything under ``store`` is a :class:`cwm_plugin.store.config.StoreConfig` field (its own
environment fallback, ``CWM_STORE_<FIELD>``, applies). The connector's own fields fall back to
``CWM_CONNECTOR_<FIELD>``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from cwm_plugin.errors import ConfigError


def _env_bool(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


@dataclass
class ConnectorConfig:
    store: dict[str, Any] = field(default_factory=dict)
    # Never store more than this many tokens of one request (whole blocks, from the start).
    max_stored_tokens_per_request: int = 65536
    # Save blocks of generated tokens too, so the next turn of a conversation hits them.
    save_decode_blocks: bool = True
    # Only requests that carry a cache_salt are saved and loaded.
    salted_only: bool = False
    load_enabled: bool = True
    save_enabled: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(names))
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown}",
                hint=f"known keys: {sorted(names)}",
            )
        values: dict[str, Any] = {}
        for name, f in names.items():
            if name in extra:
                values[name] = extra[name]
                continue
            env = os.environ.get(f"CWM_CONNECTOR_{name.upper()}")
            if env is None or name == "store":
                continue
            if f.type in ("bool", bool):
                values[name] = _env_bool(env)
            elif f.type in ("int", int):
                values[name] = int(env)
        cfg = cls(**values)
        if not isinstance(cfg.store, dict):
            raise ConfigError("kv_connector_extra_config.store must be an object of store settings")
        if cfg.max_stored_tokens_per_request < 0:
            raise ConfigError("max_stored_tokens_per_request must be >= 0")
        return cfg
