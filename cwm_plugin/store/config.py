"""Settings of the KV block store: one dataclass, read from a dict, a YAML file or the environment.

Precedence for each field: an explicit key in the dict, else ``CWM_STORE_<FIELD>`` in the
environment, else the default. Every value is typed and range-checked
(:mod:`cwm_plugin.typed_config`): an unknown key, a wrong type or an out-of-range value raises
one :class:`ConfigError` naming the field and what it accepts, so a typo never silently falls
back to a default. ``encryption_key`` is never shown in messages or ``repr``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cwm_plugin.errors import ConfigError
from cwm_plugin.typed_config import check_fields, limits, load, read_yaml

ENV_PREFIX = "CWM_STORE_"
WRITE_MODES = ("through", "behind")


@dataclass
class StoreConfig:
    """Where and how blocks are stored. ``memory_bytes=0``, ``disk_path=None`` or
    ``redis_url=None`` disables that tier."""

    fingerprint: str = ""            # model fingerprint + layout; written into every blob
    # 0 disables the tier. A vLLM worker's tier evicts at the end of each step and frees what
    # it evicted once its scheduler has seen that (no promised block goes before its load), so
    # for a step or two it may hold up to twice this.
    memory_bytes: int = field(default=2 << 30, metadata=limits(min=0))
    disk_path: str | None = None     # local disk tier root (also holds the SQLite index)
    disk_bytes: int = field(default=50 << 30, metadata=limits(min=0))
    redis_url: str | None = None     # shared tier; None disables
    redis_cluster: bool = False      # redis_url names a node of a Redis Cluster
    redis_prefix: str = "cwm"        # key prefix (namespace) in Redis
    redis_ttl_s: int | None = field(default=None, metadata=limits(min=1))
    redis_max_value_bytes: int = field(default=8 << 20, metadata=limits(min=1024))
    redis_read_chunk_bytes: int = field(default=64 << 20, metadata=limits(min=1 << 20))
    redis_timeout_ms: int = field(default=2000, metadata=limits(min=1, max=600_000))
    # the scheduler's lookups: a slow or black-holed Redis must not stall vLLM's step
    redis_lookup_timeout_ms: int = field(default=80, metadata=limits(min=1, max=60_000))
    # pinned (window) bytes allowed per key group (model namespace + rank) in each tier that
    # holds pins; None: half of the tier's budget (disk_bytes, memory_bytes), and in Redis,
    # which has no budget here, redis_pin_quota_bytes. Pinned blobs are never evicted.
    pin_quota_bytes: int | None = field(default=None, metadata=limits(min=0))
    # Redis keeps pinned blobs in its memory without a TTL: a share of its maxmemory
    redis_pin_quota_bytes: int = field(default=4 << 30, metadata=limits(min=0))
    zstd_level: int = field(default=1, metadata=limits(min=0, max=22))   # 0 = no compression
    # the memory tier holds blocks uncompressed (a load is one copy: 8k tokens of SmolLM2-135M
    # in 57-82 ms inside vLLM on 2 cores against 154 ms decoding zstd; ~1.5x the bytes a block);
    # True: the same compressed blobs as the disk and Redis tiers
    memory_compress: bool = False
    shuffle: bool = True             # byte-plane transform before zstd
    # bf16: signs as compressed bit planes where they compress (a better ratio, a slower decode)
    sign_planes: bool = False
    checksum: bool = True            # verify the raw payload checksum on every decode
    # AES-256-GCM at rest, a key per cache_salt (64 hex chars or base64 of 32 bytes)
    encryption_key: str | None = field(default=None, repr=False, metadata=limits(secret=True))
    disk_write: str = field(default="through", metadata=limits(choices=WRITE_MODES))
    redis_write: str = field(default="behind", metadata=limits(choices=WRITE_MODES))
    io_workers: int = field(default=2, metadata=limits(min=1, max=64))
    queue_depth: int = field(default=256, metadata=limits(min=1))
    behind_bytes: int = field(default=256 << 20, metadata=limits(min=0))
    gc_min_age_s: int = field(default=600, metadata=limits(min=0))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_fields(self, "store")
        if not self.redis_prefix or any(c in self.redis_prefix for c in " \n\r\t{}"):
            raise ConfigError("store setting redis_prefix must be a non-empty word without "
                              f"spaces or braces; got {self.redis_prefix!r}")
        if self.redis_url is not None:
            _check_redis_url(self.redis_url)
        if self.encryption_key is not None:
            from cwm_plugin.store.blob.crypto import parse_master_key
            parse_master_key(self.encryption_key)

    def pin_quota_for(self, tier: str) -> int | None:
        """The pinned bytes one key group may hold in ``tier`` (see ``pin_quota_bytes``;
        None: a tier of no known budget)."""
        if self.pin_quota_bytes is not None:
            return self.pin_quota_bytes
        budget = {"memory": self.memory_bytes, "disk": self.disk_bytes}.get(tier)
        if budget is not None:
            return budget // 2
        return self.redis_pin_quota_bytes if tier == "redis" else None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None = None, *, env: dict[str, str] | None = None
                  ) -> StoreConfig:
        """Build from ``d``; fields missing from ``d`` come from ``CWM_STORE_<FIELD>`` if set."""
        return load(cls, d, env_prefix=ENV_PREFIX, section="store", env=env)

    @classmethod
    def from_file(cls, path: str | Path) -> StoreConfig:
        """Read a YAML file: either the settings at top level or under a ``store:`` key."""
        data = read_yaml(path, "store config")
        return cls.from_dict(data["store"] if isinstance(data.get("store"), dict) else data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_redis_url(url: str) -> None:
    """A URL redis-py can connect with (else the first request, not the start, would fail)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is not a number raises here
        ok = parts.scheme == "unix" or (parts.scheme in ("redis", "rediss")
                                        and bool(parts.hostname))
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"store setting redis_url {redact(url)!r} is not a Redis URL",
                          hint="write it as redis://host:6379/0 (rediss:// for TLS, "
                               "unix:///path/to/redis.sock)")


def redact(url: str) -> str:
    """The URL without a password, for log lines."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
