"""The ``kvsplit`` byte transform for bfloat16 KV blocks (numpy, vectorized, one core).

In vLLM's CPU KV cache (real KV of SmolLM2-135M: ``bench/codec.py``) a block is
``[layers, kv_heads, block_size, 2*head_size]``, and inside each ``[block_size, 2*head_size]``
matrix the first half of the rows holds K stored channel-major (a row is one channel over the
block's tokens) and the second half V token-major. So the transform

* views the tensor as matrices ``[rows, cols]`` (the last two axes) and cuts each in two halves
  of rows when the row count is even: K and V apart;
* splits every bfloat16 value into sign, 8 exponent bits and 7 mantissa bits;
* codes the exponent as a 4-bit residual (-8..7) against a per-row plus a per-column base of
  its half-matrix (a K row is a channel, a V column is a channel: the two-way base fits both
  without knowing which is which), two residuals a byte (value ``i`` in the low nibble,
  value ``i + n/2`` in the high one: two masks and a shift undo it, no byte interleave); the
  rare exponents outside that range are stored whole in ``escapes``, their positions
  as gaps in ``escidx`` (so decoding never scans for them);
* keeps, per half, the signs as a packed bit plane (zstd squeezes K's signs, which run in long
  same-sign stretches along a channel) with the 7-bit mantissas bit-packed into 7/8 of a byte
  each (``sign<h>``, ``mant7<h>``: as small as zstd makes them, undone with shifts), or, when
  that half's signs do not compress, sign and mantissa as one raw byte (``sm<h>``).

What is left is near its entropy with zstd (bench/README.md, codec). Only the exponent
residuals and K's signs go through zstd's entropy decoder.

Encoding is numpy (whole-array ufuncs). Decoding runs the compiled kernels of :mod:`.jit`:
one vectorised pass writes every exponent into its 16-bit word, one more ORs in each half's
signs and mantissas (numpy would need several whole-array passes with temporaries).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from cwm_kernels import jit

_BIAS = 8            # residual r is coded as r + 8 in 0..15 (the decoder adds 248: -8 mod 256)
SIGN_COMPRESSES = 0.9   # keep signs apart when their packed plane zstd's below 90%


def matrices(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(groups, halves, rows, cols): the tensor as ``groups * halves`` matrices of
    ``rows x cols``; ``halves`` is 2 when the second-last axis could be cut in two."""
    n = math.prod(shape)
    if len(shape) < 2 or n == 0:
        return 1, 1, 1, n
    g = math.prod(shape[:-2])
    r, c = shape[-2], shape[-1]
    if r % 2 == 0:
        return g, 2, r // 2, c
    return g, 1, r, c


def expected_sizes(shape: tuple[int, ...], names: list[str]) -> dict[str, tuple[int, int]]:
    """Stream name -> (min, max) byte size a well-formed blob of ``shape`` can have."""
    return _expected_sizes(tuple(shape), tuple(names))


@functools.lru_cache(maxsize=256)      # every block of a model asks the same: a decode's overhead
def _expected_sizes(shape: tuple[int, ...], names: tuple[str, ...]
                    ) -> dict[str, tuple[int, int]]:
    g, h, r, c = matrices(shape)
    n = g * h * r * c
    per_half = g * r * c
    out = {"exp4": ((n + 1) // 2,) * 2, "rowbase": (g * h * r,) * 2,
           "colbase": (g * h * c,) * 2, "escidx": (0, 4 * n), "escapes": (0, n)}
    for i in range(h):
        out[f"sign{i}"] = ((per_half + 7) // 8,) * 2
        out[f"mant7{i}"] = (7 * ((per_half + 7) // 8),) * 2
        out[f"sm{i}"] = (per_half,) * 2
    return {k: out[k] for k in names if k in out}


def split(raw: np.ndarray, shape: tuple[int, ...], *, signs: str = "auto",
          compressed_size=None) -> tuple[list[np.ndarray], list[str]]:
    """Streams of a bfloat16 tensor given as its raw bytes. ``signs``: "auto" (per half, by
    ``compressed_size(plane) / plane.size``), "apart" or "folded"."""
    g, h, r, c = matrices(shape)
    n = g * h * r * c
    words = raw.view("<u2")
    exp = (words >> 7).astype(np.uint8)                      # the sign bit drops off
    e3 = exp.reshape(g * h, r, c)
    if n:                       # bases: rounded means (a residual is exact mod 256 anyway)
        rows = np.add.reduce(e3, axis=2, dtype=np.uint32)                       # [G, r]
        row = ((rows + c // 2) // c).astype(np.uint8)
        cols = np.add.reduce(e3, axis=1, dtype=np.int64)                        # [G, c]
        shift = cols - row.sum(axis=1, dtype=np.int64)[:, None]
        col = np.clip(np.floor(shift / r + 0.5), -128, 127).astype(np.int8)
    else:
        row = np.zeros((g * h, r), np.uint8)
        col = np.zeros((g * h, c), np.int8)
    code = np.empty(n + n % 2, np.uint8)                     # e - row - col + 8, mod 256
    c3 = code[:n].reshape(g * h, r, c)
    np.subtract(e3, (row - np.uint8(_BIAS))[:, :, None], out=c3)
    np.subtract(c3, col.view(np.uint8)[:, None, :], out=c3)
    esc = np.flatnonzero(code[:n] > 15)
    escapes = exp[esc]
    gaps = np.diff(esc, prepend=0).astype("<u4")
    code[esc] = 0
    code[n:] = 0
    half = (n + 1) // 2                                      # low nibbles: codes [0, half),
    packed = code[:half] | (code[half:2 * half] << 4)        # high nibbles: codes [half, n)
    streams = [packed, row.reshape(-1), col.view(np.uint8).reshape(-1), gaps.view(np.uint8),
               escapes]
    names = ["exp4", "rowbase", "colbase", "escidx", "escapes"]
    sign = (words >> 15).astype(np.uint8).reshape(g, h, -1)
    sm = (((words >> 8) & 0x80) | (words & 0x7F)).astype(np.uint8).reshape(g, h, -1)
    for i in range(h):
        plane = np.packbits(sign[:, i])
        apart = signs == "apart" or (
            signs == "auto" and compressed_size is not None and plane.size
            and compressed_size(plane) < SIGN_COMPRESSES * plane.size)
        if apart:
            streams += [plane, pack7((sm[:, i] & 0x7F).reshape(-1))]
            names += [f"sign{i}", f"mant7{i}"]
        else:
            streams.append(np.ascontiguousarray(sm[:, i]).reshape(-1))
            names.append(f"sm{i}")
    return streams, names


def join(streams: dict[str, np.ndarray], shape: tuple[int, ...], out: np.ndarray) -> None:
    """Inverse of :func:`split`, writing the tensor's bytes into ``out`` (``n * 2`` bytes,
    2-byte aligned) with the compiled kernels of :mod:`.jit`. Raises ValueError on streams
    that do not fit ``shape``."""
    g, h, r, c = matrices(shape)
    n = g * h * r * c
    for name, (lo, hi) in expected_sizes(shape, list(streams)).items():
        if not lo <= streams[name].size <= hi:
            raise ValueError(f"stream {name} holds {streams[name].size} bytes, expected "
                             f"{lo}..{hi} for a bfloat16 {list(shape)} tensor")
    for i in range(h):
        if not ({f"sign{i}", f"mant7{i}"} <= set(streams) or f"sm{i}" in streams):
            raise ValueError(f"kvsplit streams of half {i} are missing")
    if n == 0:
        return
    gaps, vals = streams["escidx"], streams["escapes"]
    if gaps.size != 4 * vals.size:
        raise ValueError(f"{gaps.size // 4} escape positions for {vals.size} escaped exponents")
    gaps = gaps.view("<u4") if gaps.ctypes.data % 4 == 0 else gaps.copy().view("<u4")
    empty = np.zeros(0, np.uint8)
    ro = [jit.readonly(streams.get(name, empty)) for name in
          ("exp4", "rowbase", "colbase", "escapes", "sm0", "sm1", "sign0", "sign1", "mant70",
           "mant71")]
    exp4, rowbase, colbase, vals, *halves = ro
    if jit.kv_join(exp4, rowbase, colbase, jit.readonly(gaps), vals, g, h, r, c, *halves,
                   out.view("<u2")) < 0:
        raise ValueError(f"an escape position is outside {n} values")


def pack7(values: np.ndarray) -> np.ndarray:
    """7-bit values (one a byte) -> 7/8 of the bytes: the values are cut into 8 equal
    segments (zero padded); segments 0..6 are kept and bit ``j`` of each value of segment 7
    goes into the free top bit of segment ``j``. As small as zstd gets such bytes, and undone
    with whole-array shifts instead of entropy decoding."""
    seg = (values.size + 7) // 8
    s = np.zeros(8 * seg, np.uint8)
    s[:values.size] = values
    s = s.reshape(8, seg)
    out = s[:7].copy()
    for j in range(7):
        out[j] |= ((s[7] >> j) & 1) << 7
    return out.reshape(-1)


def unpack7(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`pack7`: ``n`` values, one a byte."""
    words = np.zeros(n, np.uint16)
    if n:
        jit.mant7_values(packed, words)
    return words.astype(np.uint8)
