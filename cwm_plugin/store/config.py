"""Settings of the KV block store: one dataclass, read from a dict, a YAML file or the environment.

Precedence for each field: an explicit key in the dict, else ``CWM_STORE_<FIELD>`` in the
environment, else the default. Unknown keys raise :class:`ConfigError` naming the key, so a typo
never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cwm_plugin.errors import ConfigError

ENV_PREFIX = "CWM_STORE_"
WRITE_MODES = ("through", "behind")


@dataclass
class StoreConfig:
    """Where and how blocks are stored. ``memory_bytes=0``, ``disk_path=None`` or
    ``redis_url=None`` disables that tier."""

    fingerprint: str = ""            # model fingerprint + layout; written into every blob
    memory_bytes: int = 2 << 30      # CPU tier budget; 0 disables the tier
    disk_path: str | None = None     # local disk tier root (also holds the SQLite index)
    disk_bytes: int = 50 << 30
    redis_url: str | None = None     # shared tier; None disables
    redis_prefix: str = "cwm"        # key prefix (namespace) in Redis
    redis_ttl_s: int | None = None
    redis_max_value_bytes: int = 8 << 20   # split larger values into parts
    zstd_level: int = 1              # 0 = no compression (raw payload)
    shuffle: bool = True             # byte-plane transform before zstd
    checksum: bool = True            # verify the raw payload checksum on every decode
    disk_write: str = "through"      # "through" (put returns after disk) or "behind"
    redis_write: str = "behind"
    io_workers: int = 2
    queue_depth: int = 256           # bounded pending saves (backpressure)
    behind_bytes: int = 256 << 20    # blob bytes waiting for write-behind (then backpressure)
    gc_min_age_s: int = 600          # gc leaves unreferenced blobs younger than this alone

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("memory_bytes", "disk_bytes", "zstd_level", "queue_depth", "behind_bytes",
                     "gc_min_age_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"store setting {name} must be >= 0, got {getattr(self, name)}")
        if self.zstd_level > 22:
            raise ConfigError(f"store setting zstd_level must be 0..22, got {self.zstd_level}")
        if self.io_workers < 1:
            raise ConfigError(f"store setting io_workers must be >= 1, got {self.io_workers}")
        if self.queue_depth < 1:
            raise ConfigError(f"store setting queue_depth must be >= 1, got {self.queue_depth}")
        if self.redis_max_value_bytes < 1024:
            raise ConfigError("store setting redis_max_value_bytes must be >= 1024")
        if self.redis_ttl_s is not None and self.redis_ttl_s <= 0:
            raise ConfigError("store setting redis_ttl_s must be > 0 or null (no expiry)")
        for name in ("disk_write", "redis_write"):
            if getattr(self, name) not in WRITE_MODES:
                raise ConfigError(f"store setting {name} must be one of {WRITE_MODES}, "
                                  f"got {getattr(self, name)!r}")
        if not self.redis_prefix or any(c in self.redis_prefix for c in " \n\r\t"):
            raise ConfigError("store setting redis_prefix must be a non-empty word without spaces")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None = None, *, env: dict[str, str] | None = None
                  ) -> StoreConfig:
        """Build from ``d``; fields missing from ``d`` come from ``CWM_STORE_<FIELD>`` if set."""
        d = dict(d or {})
        env = os.environ if env is None else env
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise ConfigError(f"unknown store setting {unknown[0]!r}",
                              hint=f"known settings: {', '.join(fields)}")
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for name in fields:
            if name in d:
                values[name] = _coerce(name, d[name], hints[name])
            elif ENV_PREFIX + name.upper() in env:
                values[name] = _coerce(name, env[ENV_PREFIX + name.upper()], hints[name])
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> StoreConfig:
        """Read a YAML file: either the settings at top level or under a ``store:`` key."""
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read store config {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"store config {path} is not valid YAML: {exc}") from exc
        if isinstance(data, dict) and isinstance(data.get("store"), dict):
            data = data["store"]
        if not isinstance(data, dict):
            raise ConfigError(f"store config {path} must be a mapping of settings")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Turn ``value`` (possibly a string from the environment) into the field's type."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    if value is None or (optional and isinstance(value, str) and value.lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"store setting {name} cannot be null")
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            if isinstance(value, int):
                return bool(value)
            raise ValueError(value)
        if hint is int:
            if isinstance(value, bool):
                raise ValueError(value)
            if isinstance(value, str):
                return _parse_size(value)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if hint is str:
            if not isinstance(value, str | Path):
                raise ValueError(value)
            return str(value)
    except ValueError as exc:
        raise ConfigError(f"store setting {name} has invalid value {value!r}",
                          hint=f"expected {hint.__name__}") from exc
    return value


_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _parse_size(text: str) -> int:
    """``"123"``, ``"2G"``, ``"512MiB"``, ``"1.5gb"`` -> bytes (binary units)."""
    s = text.strip().lower().replace("_", "")
    for suffix in ("ib", "b"):
        if s.endswith(suffix) and len(s) > len(suffix) and s[-len(suffix) - 1].isalpha():
            s = s[: -len(suffix)]
            break
    if s and s[-1] in _UNITS:
        return int(float(s[:-1]) * _UNITS[s[-1]])
    return int(s)
