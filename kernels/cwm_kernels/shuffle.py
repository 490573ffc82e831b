"""Lossless byte transforms that make KV tensors compress better, vectorized on the CPU.

A transform turns a tensor's bytes into a few named *streams* (flat ``uint8`` arrays) that a
general compressor handles well, and back, bit-exactly. No Python loop touches single elements;
every step is a numpy ufunc or a strided copy.

* ``"none"``    -- one stream: the raw bytes.
* ``"bytes"``   -- byte planes, high byte first: the most significant byte of every element,
  then the next, ... (``itemsize`` streams). The high plane of a float holds sign and exponent,
  which repeat a lot; the low planes are close to random and the codec may keep them raw.
* ``"kvsplit"`` -- bfloat16 only: K and V apart, exponents as 4-bit residuals against per-row
  and per-column bases, signs as a bit plane, mantissas apart (see :mod:`.kvsplit`).
  ``"kvsplit:apart"`` / ``"kvsplit:folded"`` force how signs are stored (folded, the
  default, keeps sign+mantissa bytes raw; plain ``"kvsplit"`` stores a half's signs as a bit
  plane where that compresses); the decoder reads the choice from the stream names.

Decoding reuses per-thread scratch buffers (a cache, not state): fresh multi-megabyte arrays
cost page faults that, on small VMs, take as long as the arithmetic.

:func:`best_transform` picks the measured winner for a dtype. The Triton twin
(``shuffle_triton``) produces the same ``"bytes"`` planes on a GPU.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cwm_kernels import jit, kvsplit

TRANSFORMS = ("none", "bytes", "kvsplit")
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
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


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def best_transform(dtype: torch.dtype, sign_planes: bool = False) -> str:
    """The transform that won on real vLLM KV for ``dtype`` (bench/README.md, codec). For
    bfloat16, ``"kvsplit:folded"`` (sign+mantissa bytes kept raw: the faster decode) unless
    ``sign_planes`` asks for sign bit planes where they compress (``"kvsplit"``: a slightly
    better ratio for an entropy-coded stream more)."""
    if dtype == torch.bfloat16:
        return "kvsplit" if sign_planes else "kvsplit:folded"
    if itemsize(dtype) > 1:
        return "bytes"
    return "none"


def transforms_for(dtype: torch.dtype) -> list[str]:
    """Every transform (and forced variant) that applies to ``dtype``."""
    out = ["none"] + (["bytes"] if itemsize(dtype) > 1 else [])
    if dtype == torch.bfloat16:
        out += ["kvsplit", "kvsplit:apart", "kvsplit:folded"]
    return out


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view (same device, no copy) of a contiguous tensor's bytes."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(INT_VIEW[flat.element_size()]).view(torch.uint8)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat ``uint8`` numpy view of a CPU tensor's bytes (no copy when contiguous)."""
    return byte_view(t.cpu()).numpy()


def byte_planes(raw: np.ndarray, size: int) -> list[np.ndarray]:
    """``[n*size]`` little-endian bytes -> ``size`` planes of ``n`` bytes, high byte first."""
    if size == 1:
        return [raw]
    rows = raw.reshape(-1, size)
    return [np.ascontiguousarray(rows[:, i]) for i in reversed(range(size))]


def join_planes(planes: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`byte_planes`: interleave the planes back into one flat byte array
    (2- and 4-byte elements with the compiled kernels of :mod:`.jit`)."""
    k = len(planes)
    n = planes[0].size if planes else 0
    if out is None:
        out = np.empty(n * k, np.uint8)
    if k == 1:
        out[:] = planes[0]
    elif k == 2 and out.ctypes.data % 2 == 0:
        jit.interleave2(*map(jit.readonly, planes), out.view("<u2"))
    elif k == 4 and out.ctypes.data % 4 == 0:
        jit.interleave4(*map(jit.readonly, planes), out.view("<u4"))
    else:
        rows = out.reshape(n, k)
        for i, p in enumerate(planes):
            rows[:, k - 1 - i] = p
    return out


def split(t: torch.Tensor, transform: str,
          compressed_size: Callable[[np.ndarray], int] | None = None) -> Split:
    """Turn ``t`` into streams with ``transform``; see the module docstring.
    ``compressed_size`` lets ``kvsplit`` decide per half whether signs compress."""
    raw = tensor_bytes(t)
    base, _, variant = transform.partition(":")
    if base == "none":
        return Split("none", [raw], ["raw"])
    if base == "bytes":
        planes = byte_planes(raw, t.element_size())
        return Split("bytes", planes, [f"plane{i}" for i in range(len(planes))])
    if base == "kvsplit" and variant in ("", "apart", "folded"):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"transform 'kvsplit' is for bfloat16, not {t.dtype}")
        streams, names = kvsplit.split(raw, tuple(t.shape), signs=variant or "auto",
                                       compressed_size=compressed_size)
        return Split("kvsplit", streams, names)
    raise ValueError(f"unknown transform {transform!r}; known: {transforms_for(t.dtype)}")


def expected_sizes(transform: str, dtype: torch.dtype, shape: tuple[int, ...],
                   names: list[str]) -> list[tuple[int, int]]:
    """(min, max) bytes of each named stream of a well-formed blob; checked before anything
    is allocated. Raises ValueError for names the transform does not make."""
    return _expected_sizes(transform, dtype, tuple(shape), tuple(names))


@functools.lru_cache(maxsize=256)      # every block of a model asks the same: a decode's overhead
def _expected_sizes(transform: str, dtype: torch.dtype, shape: tuple[int, ...],
                    names: tuple[str, ...]) -> list[tuple[int, int]]:
    n = math.prod(shape)
    k = itemsize(dtype)
    if transform == "none":
        sizes = {"raw": (n * k, n * k)}
    elif transform == "bytes":
        sizes = {f"plane{i}": (n, n) for i in range(k)}
    elif transform == "kvsplit":
        if dtype != torch.bfloat16:
            raise ValueError(f"transform 'kvsplit' is for bfloat16, not {dtype}")
        sizes = kvsplit.expected_sizes(shape, names)
    else:
        raise ValueError(f"unknown transform {transform!r}")
    unknown = [x for x in names if x not in sizes]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"streams {names} do not belong to transform {transform!r}")
    return [sizes[x] for x in names]


def join(parts: Split, dtype: torch.dtype, shape: tuple[int, ...], *,
         into: torch.Tensor | None = None, borrow: bool = False) -> torch.Tensor:
    """Inverse of :func:`split`: rebuild a tensor of ``dtype`` and ``shape``, new or written
    into ``into`` (a contiguous CPU tensor of that dtype and shape, e.g. one row of a batch).
    ``borrow``: a ``none`` transform's tensor is a view of its stream (no copy, ``into`` left
    alone); the caller only reads it, and not after the stream's buffer is gone."""
    n = math.prod(shape)
    k = itemsize(dtype)
    names, streams = parts.names, parts.streams
    for name, s, (lo, hi) in zip(names, streams, expected_sizes(parts.transform, dtype, shape,
                                                                 names), strict=True):
        if not lo <= s.size <= hi:
            raise ValueError(f"stream {name} holds {s.size} bytes, expected {lo}..{hi}")
    if borrow and n and parts.transform == "none":
        _expect(names, ["raw"])
        return _read_only(streams[0]).view(INT_VIEW[k]).view(dtype).reshape(shape)
    if into is not None and n:
        if (into.dtype != dtype or tuple(into.shape) != tuple(shape)
                or not into.is_contiguous() or into.device.type != "cpu"):
            raise ValueError(f"cannot decode a {dtype} {list(shape)} tensor into a "
                             f"{into.dtype} {list(into.shape)} one")
        out = tensor_bytes(into)
    else:
        into = None
        out = np.empty(n * k, np.uint8)
    if parts.transform == "none":
        _expect(names, ["raw"])
        out[:] = streams[0]
    elif parts.transform == "bytes":
        _expect(names, [f"plane{i}" for i in range(k)])
        join_planes(streams, out)
    else:
        kvsplit.join(dict(zip(names, streams, strict=True)), shape, out)
    if into is not None:
        return into
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(out).view(INT_VIEW[k]).view(dtype).reshape(shape)


_warn_lock = threading.Lock()
_warned = threading.Event()   # torch has warned (once per process) of a read-only array


def _read_only(a: np.ndarray) -> torch.Tensor:
    """A tensor over ``a``'s bytes; ``a`` may be read-only (a view of ``bytes``), which torch
    warns of once per process: the warning is taken here, where nothing writes to it."""
    if a.flags.writeable or _warned.is_set():
        return torch.from_numpy(a)
    with _warn_lock:     # the filters are process-wide: changed by one thread at a time, once
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(a)
        _warned.set()
    return t


def _expect(names: list[str], want: list[str]) -> None:
    if names != want:
        raise ValueError(f"streams {names} are not {want}")
