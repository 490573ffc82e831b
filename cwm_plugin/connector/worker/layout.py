"""The KV layout of vLLM's paged cache, taken from the attention backend, never guessed.

vLLM 0.32 allocates every attention layer's cache as a *logical* ``[B, H, N, C]`` view (RFC
#42082): blocks are axis 0 whatever the physical stride order, which vLLM resolves once per
engine from the backend's ``supported_kv_cache_layouts`` (``KVCacheLayout``: LBHNC on CPU,
LBNHC for NHD GPU kernels, ...). When a backend splits a manager block into kernel blocks, axis
0 holds ``num_blocks * k`` of them; vLLM's own ``group_kernel_blocks`` views them as
``[num_blocks, k, ...]``, as its offloading connector does, and so do we.

What a block *means* inside is the backend's business: the CPU backend keeps K and V in the last
axis and packs them for its ISA (``vec``, ``vec16``, ``amx``, ``neon``, ...), a GPU backend has
its own encoding. So a :class:`KVLayout` names the backend, its ISA, vLLM's resolved layout,
the KV dtype, the per-block shape and which layers (a pipeline stage holds only some);
:meth:`KVLayout.describe` goes into the key namespace (two hosts with different ISAs sharing
Redis never exchange blocks, two pipeline stages never share keys) and into every blob, where
the store checks it on load.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cwm_plugin.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    backend: str                 # attention backend name, e.g. "CPU_ATTN", "FLASH_ATTN"
    isa: str                     # the CPU backend's ISA packing ("" when none applies)
    physical: str                # vLLM's resolved KVCacheLayout name, e.g. "LBHNC"
    kv_cache_dtype: str          # "auto", "fp8", ...
    dtype: str                   # the cache tensor's element type
    num_layers: int
    block_shape: tuple[int, ...]  # one manager block of one layer, logical axis order
    device: str                  # "cpu", "cuda", ...
    layers: str = ""             # digest of the layer names (pipeline stages never share keys)

    @property
    def per_block(self) -> tuple[int, ...]:
        """Shape of one stored block: every layer's block, ``[L, *block_shape]``."""
        return (self.num_layers, *self.block_shape)

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.per_block)
        return (f"{self.backend}/{self.isa or '-'}/{self.physical}/{self.kv_cache_dtype}/"
                f"{self.dtype}/{shape}/{self.device}/{self.layers or '-'}")


def block_views(kv_caches: dict[str, torch.Tensor], layer_names: Sequence[str],
                num_blocks: int) -> list[torch.Tensor]:
    """One view per distinct layer tensor with manager blocks on axis 0 (no copies).

    Layers that share another layer's cache (vLLM's KV sharing) alias the same bytes and are
    kept once, so a block is never stored twice.
    """
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    views: list[torch.Tensor] = []
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name in layer_names:
        if name not in kv_caches:
            raise ConfigError(f"vLLM registered no KV tensor for layer {name!r}",
                              hint="this model's cache layout is not supported by cwm")
        t = kv_caches[name]
        if t.dim() < 2 or t.shape[0] % num_blocks:
            raise ConfigError(
                f"KV tensor of layer {name!r} has shape {tuple(t.shape)}, not blocks-first "
                f"with a multiple of {num_blocks} blocks on axis 0",
                hint="cwm needs vLLM >= 0.32's logical [B, H, N, C] layer views")
        ident = (t.data_ptr(), tuple(t.stride()))
        if ident in seen:
            continue
        seen.add(ident)
        views.append(group_kernel_blocks(t, num_blocks))
    shapes = {tuple(v.shape) for v in views}
    dtypes = {v.dtype for v in views}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ConfigError(f"KV layers differ in shape or dtype ({shapes}, {dtypes})",
                          hint="cwm supports models whose attention layers share one KV spec")
    return views


def _attention_layer(vllm_config: Any, name: str) -> Any:
    return vllm_config.compilation_config.static_forward_context.get(name)


def discover_layout(vllm_config: Any, kv_cache_config: Any,
                    kv_caches: dict[str, torch.Tensor]) -> tuple[KVLayout, list[torch.Tensor]]:
    """The layout of this worker's KV cache and its block-major layer views.

    Backend and ISA come from the attention layers vLLM built (their backend class and, on CPU,
    the ``isa`` its metadata builder set on them), the physical order from vLLM's resolved
    ``kv_cache_layout``, shapes from the registered tensors.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"cwm connector supports models with one KV cache group, this one has "
                          f"{len(groups)}", hint="serve this model without the cwm connector")
    names = list(groups[0].layer_names)
    views = block_views(kv_caches, names, kv_cache_config.num_blocks)
    backends: set[str] = set()
    isas: set[str] = set()
    cache_dtypes: set[str] = set()
    for name in names:
        layer = _attention_layer(vllm_config, name)
        if layer is None or not hasattr(layer, "get_attn_backend"):
            raise ConfigError(f"no attention layer {name!r} in vLLM's forward context",
                              hint="the KV layout cannot be taken from the attention backend")
        backends.add(str(layer.get_attn_backend().get_name()))
        isas.add(str(getattr(layer, "isa", "") or ""))
        cache_dtypes.add(str(getattr(layer, "kv_cache_dtype", "auto")))
    if len(backends) != 1 or len(isas) != 1 or len(cache_dtypes) != 1:
        raise ConfigError(f"attention layers disagree on backend/ISA/cache dtype "
                          f"({backends}, {isas}, {cache_dtypes})",
                          hint="cwm supports one attention backend per model")
    physical = (getattr(kv_cache_config, "kv_cache_layout", None)
                or vllm_config.cache_config.kv_cache_layout or "")
    first = views[0]
    layout = KVLayout(backend=backends.pop(), isa=isas.pop(), physical=str(physical),
                      kv_cache_dtype=cache_dtypes.pop(),
                      dtype=str(first.dtype).removeprefix("torch."), num_layers=len(views),
                      block_shape=tuple(first.shape[1:]), device=first.device.type,
                      layers=hashlib.sha256("\n".join(names).encode()).hexdigest()[:8])
    log.info("cwm connector: KV layout %s (%d layers, %d blocks)", layout.describe(),
             len(views), kv_cache_config.num_blocks)
    return layout, views
