"""KV layout discovery on caches made by vLLM's own allocator, for several physical layouts."""

from __future__ import annotations

import pytest
import torch
from connector_helpers import fill_random, kv_allocation, vllm_config_for
from vllm.v1.kv_cache_layout import KVCacheLayout

from cwm_kernels.blocks import gather_blocks, scatter_blocks
from cwm_plugin.connector.worker.layout import discover_layout
from cwm_plugin.errors import ConfigError

pytestmark = pytest.mark.unit


def test_the_layout_names_backend_isa_physical_order_dtype_and_shape():
    cfg, kv = kv_allocation(num_blocks=8, layers=3, heads=2, head_size=8)
    layout, views = discover_layout(vllm_config_for(kv, isa="vec"), cfg, kv)
    assert layout.describe().startswith("CPU_ATTN/vec/LBHNC/auto/float32/3x2x16x16/cpu/")
    assert layout.per_block == (3, 2, 16, 16)
    # The views are the cache itself (no copies), blocks first.
    assert [v.data_ptr() for v in views] == [t.data_ptr() for t in kv.values()]
    amx, _ = discover_layout(vllm_config_for(kv, isa="amx"), cfg, kv)
    assert amx.describe() != layout.describe()    # another ISA packs blocks differently


def test_pipeline_stages_with_equal_shapes_get_different_layouts():
    cfg, kv = kv_allocation(num_blocks=4, layers=2)
    stage0, _ = discover_layout(vllm_config_for(kv), cfg, kv)
    renamed = {n.replace("layers.", "layers.1"): t for n, t in kv.items()}   # layers 10, 11
    cfg.kv_cache_groups[0].layer_names = list(renamed)
    stage1, _ = discover_layout(vllm_config_for(renamed), cfg, renamed)
    assert stage0.per_block == stage1.per_block and stage0.describe() != stage1.describe()


@pytest.mark.parametrize("physical", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC,
                                      KVCacheLayout.BLHNC])
def test_blocks_round_trip_whatever_the_physical_order(physical):
    cfg, kv = kv_allocation(num_blocks=6, layout=physical)
    fill_random(kv, 0)
    layout, views = discover_layout(vllm_config_for(kv), cfg, kv)
    assert layout.physical == physical.name
    staged = gather_blocks(views, 0, [4, 1])
    assert staged.shape == (2, *layout.per_block)
    cfg2, kv2 = kv_allocation(num_blocks=6, layout=physical)
    _, views2 = discover_layout(vllm_config_for(kv2), cfg2, kv2)
    scatter_blocks(views2, 0, [0, 5], staged)
    for src, dst in ((4, 0), (1, 5)):
        for a, b in zip(views, views2, strict=True):
            assert torch.equal(a[src], b[dst])


def test_kernel_blocks_are_grouped_into_manager_blocks():
    cfg, kv = kv_allocation(num_blocks=4, block_size=32, kernel_block_size=16)
    first = next(iter(kv.values()))
    assert first.shape[0] == 8                     # vLLM split each block into 2 kernel blocks
    layout, views = discover_layout(vllm_config_for(kv), cfg, kv)
    assert views[0].shape[:2] == (4, 2) and layout.block_shape[0] == 2
    assert views[0][1].data_ptr() == first[2].data_ptr()


def test_layers_sharing_one_cache_are_stored_once():
    cfg, kv = kv_allocation(num_blocks=4, layers=2)
    names = list(kv)
    kv[names[1]] = kv[names[0]]                    # vLLM's cross-layer KV sharing
    layout, views = discover_layout(vllm_config_for(kv), cfg, kv)
    assert len(views) == 1 and layout.num_layers == 1


def test_what_cannot_be_told_is_refused_with_a_clear_error():
    cfg, kv = kv_allocation(num_blocks=4, layers=2)
    config = vllm_config_for(kv)
    first = next(iter(kv))
    config.compilation_config.static_forward_context[first].isa = "amx"
    with pytest.raises(ConfigError, match="disagree"):
        discover_layout(config, cfg, kv)
    config.compilation_config.static_forward_context.pop(first)
    with pytest.raises(ConfigError, match="forward context"):
        discover_layout(config, cfg, kv)
    cfg.kv_cache_groups = cfg.kv_cache_groups * 2
    with pytest.raises(ConfigError, match="one KV cache group"):
        discover_layout(vllm_config_for(kv), cfg, kv)
