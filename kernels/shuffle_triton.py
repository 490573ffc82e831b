"""Triton GPU twin of the ``"bytes"`` transform in :mod:`cwm_plugin.kernels.shuffle`.

``shuffle_planes(t)`` returns the same bytes as the CPU version's streams concatenated
(plane 0 of every element, then plane 1, ...), computed on the tensor's GPU; ``unshuffle_planes``
is its inverse. Triton is imported on first use, so this module imports fine on a machine
without a GPU or without Triton. With ``TRITON_INTERPRET=1`` the kernels also run on CPU
tensors (how the CPU-only test suite checks them).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK = 1024
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def available() -> bool:
    """True if Triton imports and a CUDA device is present."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def shuffle_kernel(src, dst, n, K: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        for p in tl.static_range(K):
            v = tl.load(src + offs * K + p, mask=mask)
            tl.store(dst + p * n + offs, v, mask=mask)

    @triton.jit
    def unshuffle_kernel(src, dst, n, K: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        for p in tl.static_range(K):
            v = tl.load(src + p * n + offs, mask=mask)
            tl.store(dst + offs * K + p, v, mask=mask)

    return shuffle_kernel, unshuffle_kernel


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(_INT_VIEW[flat.element_size()]).view(torch.uint8)


def shuffle_planes(t: torch.Tensor) -> torch.Tensor:
    """``uint8`` tensor (same device) of ``t``'s byte planes, plane 0 first."""
    k = t.element_size()
    n = t.numel()
    src = _as_bytes(t)
    dst = torch.empty(n * k, dtype=torch.uint8, device=t.device)
    if n:
        shuffle_kernel, _ = _kernels()
        shuffle_kernel[(-(-n // BLOCK),)](src, dst, n, K=k, BLOCK=BLOCK)
    return dst


def unshuffle_planes(planes: torch.Tensor, dtype: torch.dtype,
                     shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`shuffle_planes`: a new tensor of ``dtype``/``shape`` on the same device."""
    k = torch.empty(0, dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    if planes.numel() != n * k:
        raise ValueError(f"{planes.numel()} plane bytes do not hold {n} x {k}-byte elements")
    dst = torch.empty(n * k, dtype=torch.uint8, device=planes.device)
    if n:
        _, unshuffle_kernel = _kernels()
        unshuffle_kernel[(-(-n // BLOCK),)](planes.contiguous(), dst, n, K=k, BLOCK=BLOCK)
        return dst.view(_INT_VIEW[k]).view(dtype).reshape(shape)
    return torch.empty(shape, dtype=dtype, device=planes.device)
