"""Gather/scatter of whole KV blocks: CPU always, the same ops on a GPU when one is present."""

from __future__ import annotations

import pytest
import torch

from cwm_plugin.kernels.blocks import BlockWriter, block_shape, gather_blocks, scatter_blocks

pytestmark = pytest.mark.unit

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# (layer shape, block_dim): the CPU layout and a GPU-style layout with a leading K/V axis.
LAYOUTS = [((10, 2, 32, 128), 0), ((2, 10, 32, 2, 64), 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,block_dim", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_then_scatter_round_trips_exactly(device, shape, block_dim, dtype):
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(3)]
    ids = [7, 2, 5]
    staged = gather_blocks(src, block_dim, ids)
    assert staged.device.type == "cpu"
    assert staged.shape == (3, 3, *block_shape(src[0], block_dim))
    # Block i of layer l in the staging buffer is exactly that block of that layer.
    for i, b in enumerate(ids):
        for lyr in range(3):
            assert torch.equal(staged[i, lyr], src[lyr].select(block_dim, b).cpu())
    dst = [torch.zeros_like(t) for t in src]
    scatter_blocks(dst, block_dim, [1, 3, 9], staged)
    for lyr in range(3):
        for b_src, b_dst in zip(ids, [1, 3, 9], strict=True):
            assert torch.equal(dst[lyr].select(block_dim, b_dst), src[lyr].select(block_dim, b_src))
        # Blocks not written stay untouched.
        assert torch.count_nonzero(dst[lyr].select(block_dim, 0)) == 0


def test_scatter_rejects_mismatched_data():
    layers = [torch.zeros(4, 2, 8, 16)]
    with pytest.raises(ValueError, match="expected"):
        scatter_blocks(layers, 0, [0, 1], torch.zeros(3, 1, 2, 8, 16))


@pytest.mark.parametrize("shape,block_dim", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_writer_writes_one_block_of_every_layer(shape, block_dim, dtype):
    g = torch.Generator().manual_seed(1)
    src = [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]
    block = gather_blocks(src, block_dim, [4])[0]
    dst = [torch.zeros_like(t) for t in src]
    writer = BlockWriter(dst, block_dim)
    writer.write(6, block)
    for lyr in range(3):
        assert torch.equal(dst[lyr].select(block_dim, 6), src[lyr].select(block_dim, 4))
        assert torch.count_nonzero(dst[lyr]) == torch.count_nonzero(block[lyr])
    with pytest.raises(ValueError, match="does not fit"):
        writer.write(0, block.to(torch.float64))
    with pytest.raises(ValueError, match="does not fit"):
        writer.write(0, block[:2])
