"""The windows' settings (the ``windows`` section of the sidecar's settings file)."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr

from cwm_plugin.config_file import Strict
from cwm_plugin.errors import ConfigError


class WindowsSettings(Strict):
    """Context windows (``/v1/windows``): the KV store vLLM's connector writes (its
    ``kv_connector_extra_config.store``: the same disk path and/or Redis), and auto-freeze."""

    store: dict[str, Any] = Field(default_factory=dict)   # StoreConfig fields
    wait_s: float = Field(default=30.0, ge=0)   # a freeze waits this long for pending saves
    # ... of which this long for write-behind, before copying a block a durable tier lacks
    settle_s: float = Field(default=3.0, ge=0)
    auto_freeze: bool = True                    # freeze for real at the checkpoint threshold
    auto_freeze_cooldown_s: float = Field(default=600.0, ge=0)
    auto_keep: int = Field(default=3, ge=1)     # auto-checkpoint windows kept per session
    keep_turns: int = Field(default=8, ge=1, le=256)  # client turns a session can freeze
    # the client's messages travel with a window up to this size (JSON), else they are left out
    max_message_bytes: int = Field(default=1 << 20, ge=0)
    # blob bytes the windows of one tenant and its users may pin; auto: the store's pin quota
    # divided by the principals (tenants + providers); None: no tenant quota (the pin quota only)
    tenant_quota_bytes: Annotated[int, Field(ge=0)] | Literal["auto"] | None = "auto"
    max_ttl_s: float | None = Field(default=None, gt=0)  # windows' longest TTL (None: any)
    max_import_bytes: int = Field(default=1 << 30, ge=1024)  # an imported window file's size
    imports_per_tenant: int = Field(default=1, ge=1)  # window imports of one tenant at once
    # bytes of an import kept in memory (past them it spools to a temporary file)
    import_spool_bytes: int = Field(default=8 << 20, ge=1)
    import_timeout_s: float = Field(default=3600.0, gt=0)  # an import's upload, start to end
    tenant_threads: int = Field(default=2, ge=1, le=64)  # one tenant's window operations at once
    tenant_waiting: int = Field(default=32, ge=0)  # ... and waiting for one of those
    # HMAC key: exports are signed with it, imports must be signed with it (None: unsigned)
    export_key: SecretStr | None = None
    export_key_env: str = "CWM_WINDOW_EXPORT_KEY"   # ... read from here when not in the file

    def export_secret(self) -> bytes | None:
        """The export key: ``export_key``, else ``$<export_key_env>``; None: files unsigned."""
        value = self.export_key.get_secret_value() if self.export_key \
            else os.environ.get(self.export_key_env)
        if not value:
            return None
        if len(value) < 16:
            raise ConfigError("windows.export_key is too short",
                              hint=f"set it (or ${self.export_key_env}) to 16+ random "
                                   "characters, the same on every server that shares files")
        return value.encode()
