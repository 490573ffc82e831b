"""Tensor helpers shared by the codec and kernel tests (importable: tests/ is on sys.path)."""

from __future__ import annotations

import numpy as np
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def bits(t: torch.Tensor) -> bytes:
    """The tensor's raw bytes (so NaN payloads and -0.0 compare exactly)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs, infs, subnormals included) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape, dtype=np.int64))
    k = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * k,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def kv_like(shape: tuple[int, ...] = (30, 3, 128, 128), dtype: torch.dtype = torch.bfloat16,
            seed: int = 0) -> torch.Tensor:
    """A block shaped like vLLM's CPU paged KV (``[layers, heads, block, 2*head]``): per matrix
    the first half of the rows is K channel-major (channels with their own scale and a bias
    that keeps their sign), the second half V token-major; a few extreme values too."""
    g = torch.Generator().manual_seed(seed)
    *lead, rows, cols = shape
    half = rows // 2
    k_scale = torch.exp(torch.randn(*lead, half, 1, generator=g))
    k_bias = torch.randn(*lead, half, 1, generator=g) * 2 * (torch.rand(*lead, half, 1,
                                                                       generator=g) < 0.3)
    k = (torch.randn(*lead, half, cols, generator=g) + k_bias) * k_scale
    v_scale = torch.exp(torch.randn(*lead, 1, cols, generator=g) * 0.3)
    v = torch.randn(*lead, rows - half, cols, generator=g) * v_scale
    t = torch.cat([k, v], dim=-2)
    flat = t.reshape(-1)
    special = torch.tensor([0.0, -0.0, 1e-30, 3e4, float("inf"), float("nan")])
    flat[:min(6, flat.numel())] = special[:flat.numel()]
    return t.to(dtype)
