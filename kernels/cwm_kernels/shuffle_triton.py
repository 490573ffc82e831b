"""Triton GPU twin of the ``"bytes"`` transform in :mod:`cwm_kernels.shuffle`.

``shuffle_planes(t)`` returns the same bytes as the CPU version's streams concatenated (the
high byte of every element, then the next, ...), computed on the tensor's GPU;
``unshuffle_planes`` is its inverse. Both are checked bit-exact against the CPU code by
``tests/kernels/test_shuffle.py`` (on a GPU when one is present, and always under Triton's
interpreter, ``TRITON_INTERPRET=1``, in a subprocess).

What the GPU path does and does not do: the codec's default for bfloat16 is ``"kvsplit"``
(exponent residuals against per-row/column bases, sign planes, escapes), which needs
reductions and a compaction that are not worth a kernel here: vLLM's connector copies each
block to host memory anyway, and ``kvsplit`` runs there on the CPU. On a GPU this twin can
produce ``"bytes"`` planes before the copy (fp16/fp32 blocks, or bf16 with
``transform="bytes"``); a blob's streams are the same whichever side made them.

Triton is imported on first use, so this module imports fine without a GPU or Triton.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from cwm_kernels.shuffle import INT_VIEW, byte_view

BLOCK = 1024


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
        for p in tl.static_range(K):          # plane p holds byte K-1-p: high byte first
            v = tl.load(src + offs * K + (K - 1 - p), mask=mask)
            tl.store(dst + p * n + offs, v, mask=mask)

    @triton.jit
    def unshuffle_kernel(src, dst, n, K: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        for p in tl.static_range(K):
            v = tl.load(src + p * n + offs, mask=mask)
            tl.store(dst + offs * K + (K - 1 - p), v, mask=mask)

    return shuffle_kernel, unshuffle_kernel


def shuffle_planes(t: torch.Tensor) -> torch.Tensor:
    """``uint8`` tensor (same device) of ``t``'s byte planes, high byte first."""
    k = t.element_size()
    n = t.numel()
    src = byte_view(t)
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
        return dst.view(INT_VIEW[k]).view(dtype).reshape(shape)
    return torch.empty(shape, dtype=dtype, device=planes.device)
