"""Store keys for vLLM blocks: a namespace digest, the TP rank, and vLLM's salted block hash.

The namespace binds a key to everything that must match for a block to be loadable: the model's
weights (a fingerprint of its files), the KV layout (dtype, block size, heads, head size, layers,
platform), the tensor-parallel size, and a *hash probe*: vLLM's own block hash of a fixed token
block. vLLM 0.32's salted sha256 block hashes are identical across restarts (fixed seed); if a
deployment changes that (another hash algorithm, ``PYTHONHASHSEED``), the probe changes, the
namespace changes, and stale keys can never be loaded into the wrong context.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NAMESPACE_BYTES = 16
PROBE_TOKENS = tuple(range(1, 17))


@dataclass(frozen=True)
class Namespace:
    model: str
    model_fingerprint: str
    dtype: str
    block_size: int
    hash_block_size: int
    num_kv_heads: int
    head_size: int
    num_layers: int
    platform: str
    tp_size: int
    hash_algo: str
    hash_probe: str

    @property
    def digest(self) -> bytes:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).digest()[:NAMESPACE_BYTES]

    @property
    def fingerprint(self) -> str:
        """What the store writes into every blob and checks on decode."""
        return self.digest.hex()

    def key(self, block_hash: bytes, rank: int = 0) -> bytes:
        return self.digest + rank.to_bytes(2, "big") + bytes(block_hash)


def model_fingerprint(model: str, revision: str | None = None) -> str:
    """Hash of a local model folder's config and weight files (names, sizes), else of its id."""
    h = hashlib.sha256()
    folder = Path(model)
    if folder.is_dir():
        for name in ("config.json", "tokenizer.json"):
            p = folder / name
            if p.exists():
                h.update(name.encode() + p.read_bytes())
        for p in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
            h.update(f"{p.name}:{p.stat().st_size}".encode())
    else:
        h.update(f"{model}@{revision or ''}".encode())
    return h.hexdigest()[:16]


def hash_probe(hash_fn: Any, block_size: int) -> str:
    """vLLM's block hash of a fixed block of tokens, with the process's current NONE_HASH."""
    from vllm.v1.core import kv_cache_utils

    tokens = (PROBE_TOKENS * (block_size // len(PROBE_TOKENS) + 1))[:block_size]
    return bytes(kv_cache_utils.hash_block_tokens(hash_fn, None, tokens, None)).hex()[:16]


def hashes_reproducible(hash_algo: str) -> bool:
    """False when vLLM seeds its block hashes randomly per process (non-crypto hash without
    ``PYTHONHASHSEED``): such keys are worthless after a restart."""
    return hash_algo.startswith("sha256") or os.environ.get("PYTHONHASHSEED") is not None


def build_namespace(vllm_config: Any, kv_cache_config: Any) -> Namespace:
    from vllm.platforms import current_platform
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    cache = vllm_config.cache_config
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise NotImplementedError(
            f"cwm connector supports models with one KV cache group, this one has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    hash_algo = str(cache.prefix_caching_hash_algo)
    hash_fn = get_hash_fn_by_name(hash_algo)
    if getattr(kv_cache_utils, "NONE_HASH", None) is None:
        kv_cache_utils.init_none_hash(hash_fn)
    mc = vllm_config.model_config
    return Namespace(
        model=os.path.basename(str(mc.model).rstrip("/")),
        model_fingerprint=model_fingerprint(str(mc.model), getattr(mc, "revision", None)),
        dtype=str(spec.dtype).removeprefix("torch."),
        block_size=int(spec.block_size),
        hash_block_size=int(getattr(cache, "hash_block_size", None) or spec.block_size),
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        num_layers=len(groups[0].layer_names),
        platform=str(current_platform.device_type),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        hash_algo=hash_algo,
        hash_probe=hash_probe(hash_fn, int(spec.block_size)),
    )


def block_keys(ns: Namespace, block_hashes: list[bytes], num_blocks: int, rank: int = 0) -> list[bytes]:
    """Keys of the first ``num_blocks`` KV blocks, given vLLM's per-hash-block hashes.

    When the KV block is a multiple of vLLM's hash block, block i is identified by the chained
    hash of its last hash block (which covers the whole prefix up to it).
    """
    ratio = ns.block_size // ns.hash_block_size
    n = min(num_blocks, len(block_hashes) // ratio)
    return [ns.key(block_hashes[(i + 1) * ratio - 1], rank) for i in range(n)]
