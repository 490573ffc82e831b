"""The vLLM KV connector: ``--kv-transfer-config '{"kv_connector": "CWMConnector",
"kv_connector_module_path": "cwm_plugin.connector", "kv_role": "kv_both", ...}'``.

``CWMConnector`` is imported on first use, so that the light modules of this package (config,
keys) can be used without importing vLLM's connector machinery.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CWMConnector"]


def __getattr__(name: str) -> Any:
    if name == "CWMConnector":
        from cwm_plugin.connector.connector import CWMConnector

        return CWMConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
