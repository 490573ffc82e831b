"""Gather/scatter of whole KV blocks: CPU always, the same ops on a GPU when one is present."""

from __future__ import annotations

import math

import pytest
import torch

from cwm_kernels.blocks import BlockWriter, block_shape, gather_blocks, scatter_blocks

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


def _one_buffer(shape, n_layers, dtype, gap=0, permute=None):
    """Layers as vLLM allocates them: views of one buffer, one after another (``gap``
    elements between them), optionally seen through a permutation."""
    per = math.prod(shape)
    buf = torch.zeros(n_layers * (per + gap), dtype=dtype)
    layers = [buf[i * (per + gap):i * (per + gap) + per].view(shape) for i in range(n_layers)]
    return [x.permute(*permute) for x in layers] if permute else layers, buf


@pytest.mark.parametrize("gap", [0, 7])
@pytest.mark.parametrize("permute", [None, (1, 0, 2, 3)])
def test_block_writer_joins_layers_of_one_buffer(gap, permute):
    g = torch.Generator().manual_seed(2)
    dst, buf = _one_buffer((2, 6, 8, 16), 4, torch.bfloat16, gap, permute)
    block_dim = 1 if permute is None else 0
    src = [torch.randn(tuple(x.shape), generator=g).to(torch.bfloat16) for x in dst]
    block = gather_blocks(src, block_dim, [3])[0]
    writer = BlockWriter(dst, block_dim)
    assert writer.joined
    writer.write(5, block)
    for lyr in range(4):
        assert torch.equal(dst[lyr].select(block_dim, 5), src[lyr].select(block_dim, 3))
    assert torch.count_nonzero(buf) == torch.count_nonzero(block)  # nothing else written


def test_block_writer_falls_back_when_layers_are_not_evenly_spaced():
    buf = torch.zeros(3 * 100 + 10)
    layers = [buf[0:100].view(4, 25), buf[100:200].view(4, 25), buf[210:310].view(4, 25)]
    overlapping = [buf[0:100].view(4, 25), buf[50:150].view(4, 25)]
    apart = [torch.zeros(4, 25) for _ in range(3)]
    for dst in (layers, overlapping, apart):
        writer = BlockWriter(dst, 0)
        assert not writer.joined
    writer = BlockWriter(layers, 0)
    block = torch.arange(75, dtype=torch.float32).view(3, 25) + 1
    writer.write(2, block)
    for lyr in range(3):
        assert torch.equal(layers[lyr][2], block[lyr])
    assert torch.count_nonzero(buf) == 75
