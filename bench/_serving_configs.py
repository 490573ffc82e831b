"""bench/serving.py's configurations: one fresh ``vllm serve`` each, sized so that vLLM's own
KV cache holds only a fraction of the active users' KV.

* ``vllm``      vLLM alone, prefix caching on;
* ``lmcache``   vLLM + LMCache's multi-process server, CPU offload only (L1 in memory, LRU,
  sized to hold every user; see docs/vllm-cpu.md), in 128-token chunks: block for block with
  our 128-token blocks, so neither recomputes more of a prompt's tail than the other;
* ``lmcache_256`` the same in LMCache's default 256-token chunks (it recomputes up to 255
  tokens of a prompt where a 128-token config recomputes up to 127);
* ``cwm_cpu``   our connector, CPU memory tier only, sized to hold every user;
* ``cwm_disk``  our connector, disk tier only (memory tier off; page cache as it is);
* ``cwm_redis`` our connector as configs/connector-shared-redis.json ships it (memory + disk +
  Redis behind, TTL, salted only), against a real redis-server the bench starts (the fault
  rounds run on a second such server that reaches it through a TCP proxy);
* ``fits``      the reference: vLLM alone with a cache that holds every user.

vLLM's cache is set in blocks (``--num-gpu-blocks-override``): ``VLLM_CPU_KVCACHE_SPACE`` counts
whole GiB, 46k tokens of SmolLM2 in bf16, far more than a 2-core machine can prefill in a
benchmark's time.

Every config computes on the same cores: ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``. By default vLLM's
CPU worker keeps one core a rank for its engine process and one more when a KV connector is
configured (vllm/utils/ompmultiprocessing.py); on 2 cores that leaves vLLM alone computing on
one core while any connector config (whose reservation of 2 is not possible there) gets both,
so the configs would not compare like with like.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cwm_plugin.testing.lmcache_server import LMCacheServer
from cwm_plugin.testing.vllm_server import VLLMServer, cwm_connector_args

CONFIGS = ("vllm", "lmcache", "lmcache_256", "cwm_cpu", "cwm_cpu_priority", "cwm_disk",
           "cwm_redis")
# configs whose vLLM runs with --scheduling-policy priority, and the priority their returning
# rounds are sent with (the sidecar's routing.returning_priority; first rounds keep 0)
RETURNING_PRIORITY = {"cwm_cpu_priority": -1}
SHIPPED_REDIS = Path(__file__).resolve().parents[1] / "configs" / "connector-shared-redis.json"
SERVED = "smollm2"
BLOCK = 128
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
HIT_METRICS = {"external_hit_tokens": "vllm:external_prefix_cache_hits",
               "external_query_tokens": "vllm:external_prefix_cache_queries",
               "prefix_hit_tokens": "vllm:prefix_cache_hits",
               "prefix_query_tokens": "vllm:prefix_cache_queries",
               "preemptions": "vllm:num_preemptions",
               # ours (0 elsewhere): why a restore did or did not happen
               "loaded_blocks": "cwm:connector_loaded_blocks",
               "lookups_deferred": "cwm:connector_lookups_deferred",
               "lookup_timeouts": "cwm:connector_lookup_timeouts",
               "load_errors": "cwm:connector_load_errors",
               "load_failures_recomputed": "cwm:connector_load_failures_recomputed",
               "save_errors": "cwm:connector_save_errors"}


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """K and V of every layer for one token: 2 x layers x KV heads x head_dim x dtype bytes."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class Sizes:
    """vLLM's cache and the tiers', in blocks and bytes, for ``users`` users whose prompts
    reach ``user_tokens`` tokens."""

    users: int
    user_tokens: int
    kv_bytes_per_token: int
    fraction: float                 # of the users' KV that vLLM's cache should hold
    max_model_len: int = 4096

    @property
    def user_blocks(self) -> int:
        return math.ceil(self.user_tokens / BLOCK)

    @property
    def min_blocks(self) -> int:    # one max-length request, plus the null block vLLM keeps
        return self.max_model_len // BLOCK + 1

    @property
    def vllm_blocks(self) -> int:
        return max(self.min_blocks, round(self.fraction * self.users * self.user_blocks))

    @property
    def users_fitting(self) -> float:
        return (self.vllm_blocks - 1) / self.user_blocks

    def fits_blocks(self, users: int) -> int:
        """A cache that holds ``users`` users' KV twice over."""
        return max(self.min_blocks, 2 * users * self.user_blocks + 1)

    def store_bytes(self, users: int) -> int:
        """Raw KV of ``users`` users twice over: a tier that holds them all, uncompressed."""
        return 2 * users * self.user_blocks * BLOCK * self.kv_bytes_per_token

    def as_dict(self) -> dict[str, Any]:
        return {"block_tokens": BLOCK, "user_tokens": self.user_tokens,
                "user_blocks": self.user_blocks, "users": self.users,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "vllm_cache_blocks": self.vllm_blocks,
                "vllm_cache_tokens": (self.vllm_blocks - 1) * BLOCK,
                "vllm_cache_bytes": self.vllm_blocks * BLOCK * self.kv_bytes_per_token,
                "users_fitting_in_vllm": round(self.users_fitting, 2),
                "fraction_fitting": round(self.users_fitting / self.users, 3),
                "max_model_len": self.max_model_len}


def shipped_redis(redis_url: str, disk_path: Path, **store: Any) -> dict[str, Any]:
    """configs/connector-shared-redis.json's ``kv_connector_extra_config`` with this run's
    Redis and disk folder (and ``store`` overrides: the tiny-budget fault)."""
    extra = json.loads(SHIPPED_REDIS.read_text())["kv_connector_extra_config"]
    extra["store"] = {**extra["store"], "redis_url": redis_url, "disk_path": str(disk_path),
                      **store}
    return extra


def connector_args(extra: dict[str, Any]) -> list[str]:
    extra = dict(extra)
    return cwm_connector_args(extra.pop("store"), **extra)


@dataclass
class Servers:
    """Starts the configs' servers for one run (model, dtype, sizes, work folder)."""

    model: Path
    dtype: str
    sizes: Sizes
    work: Path
    all_users: int                  # every user the run will ever have on one server
    max_num_batched_tokens: int = 2048  # vLLM's token budget a step (CPU default 2048)
    store_override: dict[str, Any] = field(default_factory=dict)  # our configs' store settings
    long_prefill_token_threshold: int = 0  # vLLM's cap on one prefill's tokens a step (0: none)

    def vllm(self, extra: list[str], *, blocks: int | None = None,
             env: dict[str, str] | None = None) -> VLLMServer:
        return VLLMServer(model_dir=self.model, served_name=SERVED, dtype=self.dtype,
                          max_model_len=self.sizes.max_model_len, log_dir=self.work,
                          extra_args=["--block-size", str(BLOCK), "--num-gpu-blocks-override",
                                      str(blocks or self.sizes.vllm_blocks),
                                      "--max-num-batched-tokens",
                                      str(self.max_num_batched_tokens),
                                      *(["--long-prefill-token-threshold",
                                         str(self.long_prefill_token_threshold)]
                                        if self.long_prefill_token_threshold else []),
                                      *extra],
                          env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                               **(env or {})},
                          startup_timeout=600)

    def tier_bytes(self) -> int:
        return self.sizes.store_bytes(self.all_users)

    def cwm_args(self, name: str, redis_url: str | None = None) -> list[str]:
        if name in ("cwm_cpu", "cwm_cpu_priority"):
            store = {"memory_bytes": self.tier_bytes(), "disk_path": None, "redis_url": None}
            policy = ["--scheduling-policy", "priority"] if name in RETURNING_PRIORITY else []
            return [*cwm_connector_args({**store, **self.store_override}), *policy]
        if name == "cwm_disk":
            store = {"memory_bytes": 0, "disk_path": str(self.work / "disk"),
                     "disk_bytes": 4 * self.tier_bytes(), "redis_url": None}
            return cwm_connector_args({**store, **self.store_override})
        if name == "cwm_redis":
            assert redis_url is not None
            return connector_args(shipped_redis(redis_url, self.work / "redis-disk",
                                                **self.store_override))
        raise ValueError(name)

    @contextlib.contextmanager
    def serve(self, name: str, *, redis_url: str | None = None) -> Iterator[VLLMServer]:
        """A started server of config ``name`` (``fits``: vLLM with room for everyone)."""
        lm = None
        if name in ("vllm", "fits"):
            blocks = self.sizes.fits_blocks(self.all_users) if name == "fits" else None
            server = self.vllm([], blocks=blocks)
        elif name in ("lmcache", "lmcache_256"):
            gb = max(1, math.ceil(self.tier_bytes() / 2**30))
            lm = LMCacheServer(store_dir=self.work / name, log_dir=self.work, l1_gb=gb,
                               l2_fs=False, chunk_size=256 if name == "lmcache_256" else BLOCK
                               ).start()
            server = self.vllm(lm.vllm_args())
        else:
            server = self.vllm(self.cwm_args(name, redis_url))
        try:
            server.start()
            yield server
        finally:
            server.stop()
            if lm is not None:
                lm.stop()


def hit_counters(server: VLLMServer) -> dict[str, float]:
    """vLLM's prefix-cache and connector counters (tokens), for differences around a phase."""
    m = server.metrics()
    out = {k: m.get(name, m.get(name + "_total", 0.0)) for k, name in HIT_METRICS.items()}
    out["lease_failures"] = server.metric_where("cwm:connector_leases", event="failed")
    # vLLM's own inter-token times (engine side, no client or network in them): how many
    # there were, and how many took longer than 0.15 s (a bucket edge of its histogram)
    out["server_itls"] = server.metric("vllm:inter_token_latency_seconds_count")
    out["server_itls_over_150ms"] = out["server_itls"] - server.metric_where(
        "vllm:inter_token_latency_seconds_bucket", le="0.15")
    return out


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}
