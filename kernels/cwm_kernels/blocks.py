"""Whole-block gather/scatter between vLLM's paged KV tensors and contiguous staging buffers.

A *block* is the layout-safe unit: whatever the attention backend does inside a block (K and V
split in the last dimension on CPU, ISA-specific packing, a physical stride order that differs
from the logical one on GPU), copying every element of a block position keeps it intact.
``block_dim`` says which axis of each layer's tensor indexes blocks. The connector passes the
block-major views that :func:`cwm_plugin.connector.worker.layout.discover_layout` makes from vLLM's
logical ``[B, H, N, C]`` layer views (so ``block_dim`` is 0 there); the layout itself is taken
from the attention backend, never guessed.

The staging layout is ``[n_blocks, n_layers, *per_block_shape]`` on the CPU, contiguous, so one
block of all layers is one slice ``out[i]``: that slice is what the store encodes as one blob.

These are torch ops, so the same code runs on a GPU (``index_select``/``index_copy_`` are device
kernels there, and the host copy is one transfer); no Triton twin is needed for this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.long, device=device)


def gather_blocks(layers: Sequence[torch.Tensor], block_dim: int,
                  block_ids: Sequence[int]) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into a new CPU tensor ``[n, L, *block]``."""
    if not layers:
        raise ValueError("gather_blocks needs at least one layer")
    idx = _index(block_ids, layers[0].device)
    per_layer = [layer.index_select(block_dim, idx).movedim(block_dim, 0) for layer in layers]
    out = torch.stack(per_layer, dim=1)
    return out.to("cpu").contiguous()


def scatter_blocks(layers: Sequence[torch.Tensor], block_dim: int, block_ids: Sequence[int],
                   data: torch.Tensor) -> None:
    """Write ``data`` (``[n, L, *block]``, as made by :func:`gather_blocks`) into the blocks."""
    if data.shape[0] != len(block_ids) or data.shape[1] != len(layers):
        raise ValueError(
            f"scatter_blocks: data has shape {tuple(data.shape)}, expected "
            f"[{len(block_ids)}, {len(layers)}, ...]"
        )
    if not block_ids:
        return
    idx = _index(block_ids, layers[0].device)
    for i, layer in enumerate(layers):
        src = data[:, i].to(device=layer.device, dtype=layer.dtype).movedim(0, block_dim)
        layer.index_copy_(block_dim, idx, src)


class BlockWriter:
    """Writes one block of every layer (``[L, *block]``, e.g. just decoded) into the paged
    cache at a block id: the restore path's copy, one block at a time from whichever thread
    decoded it (distinct block ids touch distinct memory). CPU layers only.

    Layers that are equally spaced views of one storage (vLLM allocates one buffer for all of
    them) are written as one strided array: one copy a block, which takes the GIL once. Layer
    by layer the copy gives the GIL up and takes it back once a layer, and each time another
    thread running Python holds it the writer waits up to the interpreter's switch interval:
    next to a thread looping in Python, a block's copy would take many times its own time."""

    def __init__(self, layers: Sequence[torch.Tensor], block_dim: int) -> None:
        if not layers or any(layer.device.type != "cpu" for layer in layers):
            raise ValueError("BlockWriter writes CPU layers; use scatter_blocks on a device")
        self.block_dim = block_dim
        self.shape = block_shape(layers[0], block_dim)
        self.dtype = layers[0].dtype
        self.n_layers = len(layers)
        joined = _joined(layers)
        self._joined = _ints(joined).numpy() if joined is not None else None
        self._views = [] if joined is not None else [_ints(layer).numpy() for layer in layers]

    @property
    def joined(self) -> bool:
        """Whether a block of every layer is written with one copy."""
        return self._joined is not None

    def write(self, block_id: int, data: torch.Tensor) -> None:
        """``data``: ``[L, *block]`` of the layers' dtype, on the CPU."""
        if data.dtype != self.dtype or tuple(data.shape) != (self.n_layers, *self.shape):
            raise ValueError(f"block of {data.dtype} {list(data.shape)} does not fit layers "
                             f"of {self.dtype} {list(self.shape)}")
        src = _ints(data).numpy()
        if self._joined is not None:
            self._joined[(slice(None),) * (self.block_dim + 1) + (block_id,)] = src
            return
        for view, part in zip(self._views, src, strict=True):
            view[(slice(None),) * self.block_dim + (block_id,)] = part


def _joined(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The layers as one ``[L, *layer]`` view of their storage, or None unless they share it,
    have one shape, stride and dtype, and lie at equal distances that keep them apart."""
    first = layers[0]
    if len(layers) < 2 or any(s <= 0 for s in first.stride()) or any(
            x.shape != first.shape or x.stride() != first.stride() or x.dtype != first.dtype
            or x.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            for x in layers):
        return None
    offsets = [x.storage_offset() for x in layers]
    step = offsets[1] - offsets[0]
    span = 1 + sum((n - 1) * s for n, s in zip(first.shape, first.stride(), strict=True))
    if step < span or any(b - a != step for a, b in zip(offsets[:-1], offsets[1:], strict=True)):
        return None
    return torch.as_strided(first, (len(layers), *first.shape), (step, *first.stride()),
                            offsets[0])


def _ints(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer tensor of the same item size (numpy has no bfloat16)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


def block_shape(layer: torch.Tensor, block_dim: int) -> tuple[int, ...]:
    """The shape of one block of one layer (the layer's shape without ``block_dim``)."""
    shape = list(layer.shape)
    del shape[block_dim]
    return tuple(shape)
