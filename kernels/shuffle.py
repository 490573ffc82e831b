"""Lossless byte transforms that make KV tensors compress better, vectorized on the CPU.

A transform turns a tensor's bytes into a few *streams* (flat ``uint8`` arrays) that a general
compressor handles well, and back, bit-exactly. No Python loop touches single elements; every
step is a numpy ufunc or a strided copy.

* ``"none"``  -- one stream: the raw bytes.
* ``"bytes"`` -- byte planes: byte 0 of every element, then byte 1, ... (``itemsize`` streams).
  The high plane of a float holds sign and exponent, which repeat a lot; the low planes are
  close to random and the codec may keep them uncompressed.
* ``"exp"``   -- for bfloat16 (measured on real SmolLM2 KV): split each value into an exponent
  byte and a sign+mantissa byte; subtract a per-column base exponent (a column is one channel
  of the last axis, its values run over the second-last axis: tokens in a KV block), code the
  small deltas in 4 bits (two per byte, element ``i`` with element ``i + n/2``) with the rare
  outliers stored by position. The exponent stream then holds ~2.5 bits a value instead of
  ~2.9 after Huffman; the mantissa stream (``mantissa << 1 | sign``, so that decoding is one
  interleave and one 1-bit rotation of 16-bit words) is left for the codec to store raw.

Decoding reuses per-thread scratch buffers (a cache, not state): fresh multi-megabyte arrays
cost page faults that, on small VMs, take as long as the arithmetic.

:func:`best_transform` picks the measured winner for a dtype. The Triton twin
(``shuffle_triton``) produces the same ``"bytes"`` streams on a GPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

TRANSFORMS = ("none", "bytes", "exp")
_EXP_LO = -8          # exponent deltas in [_EXP_LO, _EXP_LO + 14] fit the 4-bit code
_EXP_SPAN = 14
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_scratch = threading.local()


def scratch(name: str, n: int, dtype: type = np.uint8) -> np.ndarray:
    """A reusable per-thread scratch array of at least ``n`` items (first ``n`` returned)."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    buf = bufs.get(name)
    if buf is None or buf.size < n or buf.dtype != dtype:
        buf = bufs[name] = np.empty(max(n, 1), dtype)
    return buf[:n]


@dataclass
class Split:
    """The streams of one tensor; ``names`` label them for the container."""

    transform: str
    streams: list[np.ndarray]
    names: list[str]


def best_transform(dtype: torch.dtype) -> str:
    """The transform that won on real KV for ``dtype`` (see ``bench/codec.py``)."""
    if dtype == torch.bfloat16:
        return "exp"
    if torch.empty(0, dtype=dtype).element_size() > 1:
        return "bytes"
    return "none"


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat ``uint8`` numpy view of a contiguous CPU tensor's bytes (no copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return np.empty(0, np.uint8)
    return t.view(_INT_VIEW[t.element_size()]).numpy().view(np.uint8)


def byte_planes(raw: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """``[n*itemsize]`` bytes -> ``itemsize`` planes of ``n`` bytes (plane i = byte i of each)."""
    if itemsize == 1:
        return [raw]
    rows = raw.reshape(-1, itemsize)
    return [np.ascontiguousarray(rows[:, i]) for i in range(itemsize)]


def join_planes(planes: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`byte_planes`: interleave the planes back into one flat byte array."""
    k = len(planes)
    n = planes[0].size if planes else 0
    if out is None:
        out = np.empty(n * k, np.uint8)
    if k == 1:
        out[:] = planes[0]
        return out
    rows = out.reshape(n, k)
    for i, p in enumerate(planes):
        rows[:, i] = p
    return out


def split(t: torch.Tensor, transform: str) -> Split:
    """Turn ``t`` into streams with ``transform``; see the module docstring."""
    raw = tensor_bytes(t)
    if transform == "none":
        return Split("none", [raw], ["raw"])
    if transform == "bytes":
        planes = byte_planes(raw, t.element_size())
        return Split("bytes", planes, [f"plane{i}" for i in range(len(planes))])
    if transform == "exp":
        if t.dtype != torch.bfloat16:
            raise ValueError(f"transform 'exp' is for bfloat16, not {t.dtype}")
        return _split_exp(raw, tuple(t.shape))
    raise ValueError(f"unknown transform {transform!r}; known: {TRANSFORMS}")


def join(streams: list[np.ndarray], transform: str, dtype: torch.dtype,
         shape: tuple[int, ...], *, into: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`split`: rebuild a tensor of ``dtype`` and ``shape``, new or written
    into ``into`` (a contiguous CPU tensor of that dtype and shape, e.g. one row of a batch)."""
    n = int(np.prod(shape, dtype=np.int64))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if into is not None and n:
        if (into.dtype != dtype or tuple(into.shape) != tuple(shape)
                or not into.is_contiguous() or into.device.type != "cpu"):
            raise ValueError(f"cannot decode a {dtype} {list(shape)} tensor into a "
                             f"{into.dtype} {list(into.shape)} one")
        out = tensor_bytes(into)
    else:
        into = None
        out = np.empty(n * itemsize, np.uint8)
    if transform == "none":
        _expect(streams, 1, transform)
        out[:] = _sized(streams[0], out.size)
    elif transform == "bytes":
        _expect(streams, itemsize, transform)
        join_planes([_sized(s, n) for s in streams], out)
    elif transform == "exp":
        if dtype != torch.bfloat16:
            raise ValueError(f"transform 'exp' is for bfloat16, not {dtype}")
        _join_exp(streams, shape, out)
    else:
        raise ValueError(f"unknown transform {transform!r}; known: {TRANSFORMS}")
    if into is not None:
        return into
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(out).view(_INT_VIEW[itemsize]).view(dtype).reshape(shape)


def _expect(streams: list[np.ndarray], k: int, transform: str) -> None:
    if len(streams) != k:
        raise ValueError(f"transform {transform!r} needs {k} streams, got {len(streams)}")


def _sized(s: np.ndarray, n: int) -> np.ndarray:
    if s.size != n:
        raise ValueError(f"stream holds {s.size} bytes, expected {n}")
    return s


def _columns(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(groups, rows, cols): the last axis is a column (channel), the second-last its rows."""
    if len(shape) >= 2:
        cols, rows = shape[-1], shape[-2]
        groups = int(np.prod(shape[:-2], dtype=np.int64))
        return groups, rows, cols
    n = int(np.prod(shape, dtype=np.int64))
    return 1, 1, n


def _split_exp(raw: np.ndarray, shape: tuple[int, ...]) -> Split:
    g, r, c = _columns(shape)
    n = g * r * c
    words = raw.view("<u2")                               # 16-bit words: numpy SIMD paths
    exp = (words >> 7).astype(np.uint8)                   # 8 exponent bits (sign drops off)
    sm = (words << 1).astype(np.uint8)                    # 7 mantissa bits, then the sign
    sm |= (words >> 15).astype(np.uint8)
    exp3 = exp.reshape(g, r, c)
    if n:
        base = np.rint(exp3.mean(axis=1, dtype=np.float32)).astype(np.uint8)  # [g, c]
    else:
        base = np.zeros((g, c), np.uint8)
    code = (exp3 - (base - np.uint8(-_EXP_LO & 0xFF))[:, None, :]).reshape(-1)  # delta + 8
    outlier = code > _EXP_SPAN
    idx = np.flatnonzero(outlier).astype("<u4")
    vals = exp[idx]
    half = (n + 1) // 2
    padded = np.zeros(2 * half, np.uint8)
    padded[:n] = code
    padded[idx] = 0
    packed = padded[:half] | (padded[half:] << 4)
    return Split("exp", [packed, sm, base.reshape(-1), idx.view(np.uint8), vals],
                 ["exp4", "signmant", "base", "outlier_idx", "outlier_val"])


def _join_exp(streams: list[np.ndarray], shape: tuple[int, ...], out: np.ndarray) -> None:
    _expect(streams, 5, "exp")
    packed, sm, base, idx_bytes, vals = streams
    g, r, c = _columns(shape)
    n = g * r * c
    half = (n + 1) // 2
    _sized(packed, half)
    _sized(sm, n)
    _sized(base, g * c)
    if idx_bytes.size % 4 or idx_bytes.size // 4 != vals.size:
        raise ValueError("outlier streams disagree in length")
    code = scratch("code", 2 * half)
    np.bitwise_and(packed, 0x0F, out=code[:half])
    np.right_shift(packed, 4, out=code[half:])
    exp = code[:n]
    shift = (base.reshape(g, 1, c) - np.uint8(-_EXP_LO & 0xFF))
    np.add(exp.reshape(g, r, c), shift, out=exp.reshape(g, r, c))
    if vals.size:
        idx = idx_bytes.view("<u4")
        if int(idx.max()) >= n:
            raise ValueError("outlier index out of range")
        exp[idx] = vals
    # word = sign:1 exp:8 mantissa:7, built with widening 8->16-bit ufuncs (SIMD; faster than
    # interleaving bytes with strided copies)
    words = out.view("<u2")
    t8 = scratch("t8", n)
    t16 = scratch("t16", n, np.uint16)
    np.left_shift(exp, 7, out=words, dtype=np.uint16)
    np.right_shift(sm, 1, out=t8)
    np.bitwise_or(words, t8, out=words, dtype=np.uint16)
    np.left_shift(sm, 15, out=t16, dtype=np.uint16)
    np.bitwise_or(words, t16, out=words)
