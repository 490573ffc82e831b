"""Connector test helpers: real vLLM KV allocations, fake attention layers, namespaces."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from cwm_plugin.connector.keys import KeyNamespace

BS = 16
# Scheduler settings under which a lookup answers at the first ask (it may wait a minute for
# the store): the planning tests; the tests of deferred lookups use their own.
SYNC = {"lookup_wait_ms": 60_000}


def namespace(layout: str = "CPU_ATTN/vec/LBHNC/auto/float32/2x2x16x16/cpu", **kw) -> KeyNamespace:
    base = dict(model="m", model_fingerprint="f", model_dtype="float32", vllm_version="0.32.0",
                dtype="float32", block_size=BS, num_kv_heads=2, head_size=8, num_layers=2,
                platform="cpu", layout=layout, tp_size=2, hash_algo="sha256")
    return KeyNamespace(**{**base, **kw})


def kv_allocation(*, num_blocks: int = 8, layers: int = 2, heads: int = 2, head_size: int = 8,
                  dtype: torch.dtype = torch.float32, layout: KVCacheLayout = KVCacheLayout.LBHNC,
                  kernel_block_size: int | None = None, block_size: int = BS
                  ) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """A KV cache allocated by vLLM's own allocator (logical [B, H, N, C] layer views)."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size,
                             dtype=dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    page = spec.page_size_bytes
    if layout.is_layer_compact:
        t = KVCacheTensor(size=page * num_blocks * layers, layers=names,
                          layer_stride=page * num_blocks, block_stride=page)
    else:
        t = KVCacheTensor(size=page * num_blocks * layers, layers=names, layer_stride=page,
                          block_stride=page * layers)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[t],
                        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                        kv_cache_layout=layout.name)
    kernel = [kernel_block_size] if kernel_block_size else None
    return cfg, allocate_kv_cache(cfg, torch.device("cpu"), layout, kernel)


def fill_random(kv_caches: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in kv_caches.values():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def vllm_config_for(kv_caches: dict[str, torch.Tensor], *, backend=CPUAttentionBackend,
                    isa: str = "vec", kv_cache_dtype: str = "auto") -> SimpleNamespace:
    """The parts of a VllmConfig the layout discovery reads: attention layers as vLLM builds
    them (backend class, the ISA the CPU metadata builder sets) in the forward context."""
    layers = {name: SimpleNamespace(get_attn_backend=lambda b=backend: b, isa=isa,
                                    kv_cache_dtype=kv_cache_dtype) for name in kv_caches}
    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers),
                           cache_config=SimpleNamespace(kv_cache_layout=None))
