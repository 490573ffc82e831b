"""Store keys for vLLM blocks: a namespace digest, the TP rank, and vLLM's salted block hash.

The namespace binds a key to everything that must match for a block to be loadable: the weights
(:mod:`~cwm_plugin.connector.fingerprint`), the model and KV dtypes, the quantization method,
``--hf-overrides`` and the RoPE settings in effect, vLLM's version (its kernels decide the KV's
numerics), the KV layout reported by the attention backend
(:mod:`~cwm_plugin.connector.worker.layout`, which names the KV cache dtype and a pipeline
stage's layers), block sizes, head counts, layers,
the tensor- and pipeline-parallel sizes and the hash algorithm. A LoRA adapter's *content*
(vLLM hashes only its name and path) is mixed in per request: :func:`lora_extra`. The rank is
part of each key, not of the namespace: the scheduler plans with rank-free block hashes and
every worker derives its own keys, so rank ``r`` only ever loads rank ``r``'s shard.

The hash seed is not in the namespace because vLLM's block hashes already carry it: they chain
from ``NONE_HASH``, which the seed (``PYTHONHASHSEED`` or vLLM's fixed default) determines, so
after a seed or algorithm change no old key can be matched. The start-up self-check
(:mod:`~cwm_plugin.connector.scheduler.selfcheck`) notices such a change and says so.

A salt isolates tenants only as far as nobody can make two blocks hash alike. vLLM's xxhash
variants are not collision resistant: their only defence is a secret random seed, which
``PYTHONHASHSEED`` (needed for keys that outlive the process) makes known. With them, a blob
that outlives the process is safe from a crafted collision only when it is sealed under its
salt (encryption at rest), so :func:`check_isolation` refuses that setting at connector start.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cwm_plugin.connector.fingerprint import model_fingerprint
from cwm_plugin.errors import ConfigError

NAMESPACE_BYTES = 16
RANK_BYTES = 2
SCOPE_BYTES = NAMESPACE_BYTES + RANK_BYTES   # what precedes vLLM's block hash in a key
PROBE_TOKENS = tuple(range(1, 17))
NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")
HASH_BYTES = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}


@functools.cache
def hash_bytes(hash_algo: str) -> int:
    """How long vLLM's block hashes are under ``--prefix-caching-hash-algo hash_algo``
    (an algorithm not in the table is asked once)."""
    if hash_algo in HASH_BYTES:
        return HASH_BYTES[hash_algo]
    from vllm.utils.hashing import get_hash_fn_by_name

    return len(get_hash_fn_by_name(hash_algo)(b""))


@dataclass(frozen=True)
class KeyNamespace:
    """What a block key is scoped by (see the module docstring); its :attr:`digest` begins
    every key."""

    model: str
    model_fingerprint: str
    model_dtype: str
    vllm_version: str
    dtype: str                 # the KV cache's dtype
    block_size: int
    num_kv_heads: int
    head_size: int
    num_layers: int
    platform: str
    layout: str                # KVLayout.describe(), from the attention backend
    tp_size: int
    hash_algo: str
    quantization: str = ""
    hf_overrides: str = ""     # canonical JSON of --hf-overrides
    rope: str = ""             # canonical JSON of the RoPE settings in the model config
    pp_size: int = 1

    @property
    def digest(self) -> bytes:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).digest()[:NAMESPACE_BYTES]

    @property
    def fingerprint(self) -> str:
        """What the store writes into every blob and checks on decode."""
        return self.digest.hex()

    def scoped(self, extra: bytes = b"") -> bytes:
        """The digest for one request: the namespace's, or mixed with ``extra`` (a LoRA
        adapter's content digest)."""
        if not extra:
            return self.digest
        return hashlib.sha256(self.digest + bytes(extra)).digest()[:NAMESPACE_BYTES]

    def key(self, block_hash: bytes, rank: int, extra: bytes = b"") -> bytes:
        return self.scoped(extra) + rank.to_bytes(RANK_BYTES, "big") + bytes(block_hash)

    def keys(self, block_hashes: Sequence[bytes], rank: int, extra: bytes = b"") -> list[bytes]:
        scope = self.scoped(extra) + rank.to_bytes(RANK_BYTES, "big")
        return [scope + bytes(h) for h in block_hashes]

    def block_hash(self, key: bytes) -> bytes | None:
        """vLLM's block hash in a block key of this namespace's hash algorithm (any rank or LoRA
        scope: the scope is a digest, so it cannot be told apart from another namespace's);
        None for a key of another length (a context record, a window's manifest, a block of
        another algorithm). Another key of the same length gives a hash no block has."""
        key = bytes(key)
        if len(key) != SCOPE_BYTES + hash_bytes(self.hash_algo):
            return None
        return key[SCOPE_BYTES:]


def kv_block_hashes(block_hashes: Sequence[bytes], num_blocks: int, ratio: int = 1) -> list[bytes]:
    """Rank-free identities of the first ``num_blocks`` KV blocks, from vLLM's hashes.

    vLLM hashes every ``hash_block_size`` tokens; when a KV block spans ``ratio`` hash blocks, it
    is identified by the chained hash of its last one (which covers the whole prefix up to it).
    The hash granularity needs no place in the namespace: other hash block boundaries give
    other chained hashes for the same tokens.
    """
    n = min(num_blocks, len(block_hashes) // ratio)
    return [bytes(block_hashes[(i + 1) * ratio - 1]) for i in range(n)]


def hash_probe(hash_fn: Any, block_size: int) -> str:
    """vLLM's chained hashes of two fixed token blocks, with the process's current NONE_HASH.

    Call it only after vLLM's ``init_none_hash`` has run in this process (the scheduler's first
    lookup): before that, ``NONE_HASH`` is not the one vLLM's requests use.
    """
    from vllm.v1.core import kv_cache_utils

    tokens = (PROBE_TOKENS * (block_size // len(PROBE_TOKENS) + 1))[:block_size]
    first = kv_cache_utils.hash_block_tokens(hash_fn, None, tokens, None)
    second = kv_cache_utils.hash_block_tokens(hash_fn, first, tokens[::-1], None)
    return bytes(second).hex()[:32]


def hashes_reproducible(hash_algo: str) -> bool:
    """False when vLLM seeds its block hashes randomly per process (non-crypto hash without
    ``PYTHONHASHSEED``, see ``vllm.v1.core.kv_cache_utils.resolve_none_hash_seed``)."""
    return hash_algo not in NON_CRYPTO_HASHES or os.environ.get("PYTHONHASHSEED") is not None


def check_isolation(hash_algo: str, store: Any) -> None:
    """Refuse (:class:`ConfigError`) block hashes anyone can collide where they key blobs that
    outlive the process unsealed: a non-cryptographic algorithm (xxhash) with a known seed
    (``PYTHONHASHSEED``: without it vLLM seeds randomly and nothing is saved), a disk or Redis
    tier (``store``: the :class:`~cwm_plugin.store.config.StoreConfig`) and no
    ``encryption_key``. A memory tier lives no longer than vLLM's own prefix cache, which the
    same hashes key."""
    if hash_algo not in NON_CRYPTO_HASHES or not hashes_reproducible(hash_algo):
        return
    if (store.disk_path or store.redis_url) and not store.encryption_key:
        raise ConfigError(
            f"cwm connector: --prefix-caching-hash-algo {hash_algo} with PYTHONHASHSEED set "
            "keys a disk or Redis store that anyone who knows the seed can collide: a crafted "
            "prompt would read another tenant's KV whatever its cache_salt",
            hint="use --prefix-caching-hash-algo sha256 (or sha256_cbor), or set the store's "
                 "encryption_key (each blob then opens only under its own salt), or keep "
                 "the store in memory only")


def canonical(value: Any) -> str:
    """Canonical JSON of a config value ("" for none; a callable by its qualified name)."""
    if value is None or value == {}:
        return ""
    if callable(value):
        return f"callable:{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    return json.dumps(value, sort_keys=True, default=str)


ROPE_FIELDS = ("rope_scaling", "rope_theta", "rope_parameters", "partial_rotary_factor",
               "rotary_emb_base", "max_position_embeddings")


def rope_settings(hf_config: Any) -> str:
    if hf_config is None:
        return ""
    found = {name: getattr(hf_config, name) for name in ROPE_FIELDS
             if getattr(hf_config, name, None) is not None}
    return canonical(found)


def lora_extra(lora_request: Any) -> bytes:
    """The content digest of a request's LoRA adapter (b"" for none): vLLM's block hashes
    carry the adapter's name and path, not its weights, so a changed adapter at the same path
    must not load the old one's KV."""
    if not lora_request:
        return b""
    from pathlib import Path

    from cwm_plugin.connector.fingerprint import file_digest

    path = Path(str(getattr(lora_request, "lora_path", "") or ""))
    h = hashlib.sha256(f"lora:{getattr(lora_request, 'lora_name', '')}".encode())
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else (
        [path] if path.is_file() else [])
    for p in files:
        h.update(f"{p.relative_to(path) if path.is_dir() else p.name}:{file_digest(p)}\n"
                 .encode())
    if not files:
        h.update(f"path:{path}".encode())
    return h.digest()[:NAMESPACE_BYTES]


def build_namespace(vllm_config: Any, kv_cache_config: Any, layout: str) -> KeyNamespace:
    """The namespace of this engine, given the KV layout its workers reported."""
    import vllm
    from vllm.platforms import current_platform

    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec
    cache = vllm_config.cache_config
    mc = vllm_config.model_config
    return KeyNamespace(
        model=os.path.basename(str(mc.model).rstrip("/")),
        model_fingerprint=model_fingerprint(
            str(mc.model), getattr(mc, "revision", None),
            getattr(getattr(vllm_config, "load_config", None), "download_dir", None)),
        model_dtype=str(mc.dtype).removeprefix("torch."),
        vllm_version=str(vllm.__version__),
        dtype=str(spec.dtype).removeprefix("torch."),
        block_size=int(spec.block_size),
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        num_layers=len(groups[0].layer_names),
        platform=str(current_platform.device_type),
        layout=layout,
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        hash_algo=str(cache.prefix_caching_hash_algo),
        quantization=str(getattr(mc, "quantization", None) or ""),
        hf_overrides=canonical(getattr(mc, "hf_overrides", None)),
        rope=rope_settings(getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)),
        pp_size=int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1),
    )
