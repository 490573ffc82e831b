"""The ``kvsplit`` byte transform for bfloat16 KV blocks (numpy, vectorized, one core).

Measured on real KV of SmolLM2-135M served by vLLM on CPU (``bench/codec.py``): a block is
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
  rare exponents outside that range (~0.1%) are stored whole in ``escapes``, their positions
  as gaps in ``escidx`` (so decoding never scans for them);
* keeps, per half, the signs as a packed bit plane (zstd squeezes K's signs, which run in long
  same-sign stretches along a channel) with the 7-bit mantissas bit-packed into 7/8 of a byte
  each (``sign<h>``, ``mant7<h>``: as small as zstd makes them, undone with shifts), or, when
  that half's signs do not compress, sign and mantissa as one raw byte (``sm<h>``).

Entropy of what is left (bits a value, measured): exponent residual 2.4 (K) / 2.6 (V), sign
0.73 (K) / 0.99 (V), mantissa 6.96; the transform gets within ~0.1 bit of that with zstd.
Only the exponent residuals and K's signs go through zstd's entropy decoder.

Decoding uses only whole-array ufuncs on reused scratch buffers; byte shifts go through 64-bit
views (numpy has no SIMD shift for uint8), and a sign+mantissa byte becomes its 16-bit place
with one multiply by 0x0101 and a mask.
"""

from __future__ import annotations

import numpy as np

_BIAS = 8            # residual r is coded as r + 8 in 0..15
_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_BIT = [np.uint64(i) for i in range(9)]
_TOP_BITS = np.uint64(0x8080808080808080)
_LOW_7BITS = np.uint64(0x7F7F7F7F7F7F7F7F)
SIGN_COMPRESSES = 0.9   # keep signs apart when their packed plane zstd's below 90%


def matrices(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(groups, halves, rows, cols): the tensor as ``groups * halves`` matrices of
    ``rows x cols``; ``halves`` is 2 when the second-last axis could be cut in two."""
    n = int(np.prod(shape, dtype=np.int64))
    if len(shape) < 2 or n == 0:
        return 1, 1, 1, n
    g = int(np.prod(shape[:-2], dtype=np.int64))
    r, c = shape[-2], shape[-1]
    if r % 2 == 0:
        return g, 2, r // 2, c
    return g, 1, r, c


def expected_sizes(shape: tuple[int, ...], names: list[str]) -> dict[str, tuple[int, int]]:
    """Stream name -> (min, max) byte size a well-formed blob of ``shape`` can have."""
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


def join(streams: dict[str, np.ndarray], shape: tuple[int, ...], out: np.ndarray,
         scratch) -> None:
    """Inverse of :func:`split`, writing the tensor's bytes into ``out`` (``n * 2`` bytes).
    ``scratch(name, n, dtype)`` hands out reusable buffers. Raises ValueError on streams that
    do not fit ``shape``."""
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
    code = _unpack_codes(streams["exp4"], n, scratch)
    gaps, vals = streams["escidx"], streams["escapes"]
    if gaps.size != 4 * vals.size:
        raise ValueError(f"{gaps.size // 4} escape positions for {vals.size} escaped exponents")
    where = np.cumsum(gaps.view("<u4"), dtype=np.int64)
    if where.size and int(where[-1]) >= n:
        raise ValueError(f"escape position {int(where[-1])} is outside {n} values")
    e3 = code.reshape(g * h, r, c)
    row = streams["rowbase"].reshape(g * h, r) - np.uint8(_BIAS)      # uint8 wrap-around
    np.add(e3, row[:, :, None], out=e3)
    np.add(e3, streams["colbase"].reshape(g * h, 1, c), out=e3)
    code[where] = vals
    words = out.view("<u2")                        # sign:1 exponent:8 mantissa:7
    np.left_shift(code, 7, out=words, dtype=np.uint16)
    w3 = words.reshape(g, h, -1)
    t = scratch("kv-t", g * r * c, np.uint16).reshape(g, -1)
    for i in range(h):
        if f"sm{i}" in streams:                    # byte s:1 m:7 -> s at bit 15, m at 0..6
            np.multiply(streams[f"sm{i}"].reshape(g, -1), np.uint16(0x0101), out=t,
                        dtype=np.uint16)
            np.bitwise_and(t, np.uint16(0x807F), out=t)
        else:
            bits = np.unpackbits(streams[f"sign{i}"], count=g * r * c).reshape(g, -1)
            np.multiply(bits, np.uint16(0x8000), out=t, dtype=np.uint16)
            mant = unpack7(streams[f"mant7{i}"], g * r * c, scratch)
            np.bitwise_or(t, mant.reshape(g, -1), out=t, dtype=np.uint16)
        np.bitwise_or(w3[:, i], t, out=w3[:, i])


def _unpack_codes(packed: np.ndarray, n: int, scratch) -> np.ndarray:
    """Two 4-bit codes a byte -> one code a byte: low nibbles are codes ``[0, half)``, high
    nibbles codes ``[half, n)`` (so both halves come out with whole-word masks and shifts)."""
    half = (n + 1) // 2
    codes = scratch("kv-codes", 2 * half)
    if half % 8 or packed.ctypes.data % 8:       # no aligned 64-bit views: byte by byte
        np.bitwise_and(packed, np.uint8(0x0F), out=codes[:half])
        np.right_shift(packed, np.uint8(4), out=codes[half:])
        return codes[:n]
    p64 = packed.view(np.uint64)
    lo, hi = codes[:half].view(np.uint64), codes[half:].view(np.uint64)
    np.bitwise_and(p64, _LOW_NIBBLES, out=lo)
    np.right_shift(p64, _BIT[4], out=hi)
    np.bitwise_and(hi, _LOW_NIBBLES, out=hi)
    return codes[:n]


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


def unpack7(packed: np.ndarray, n: int, scratch) -> np.ndarray:
    """Inverse of :func:`pack7`: ``n`` values, one a byte, in a scratch buffer."""
    seg = (n + 7) // 8
    buf = scratch("kv-mant7", 8 * seg)
    buf[:7 * seg] = packed
    s = buf.reshape(8, seg)
    wide = seg % 8 == 0 and buf.ctypes.data % 8 == 0   # whole 64-bit words when aligned
    view = (lambda a: a.view(np.uint64)) if wide else (lambda a: a)
    top, low = (_TOP_BITS, _LOW_7BITS) if wide else (np.uint8(0x80), np.uint8(0x7F))
    last = view(s[7])
    last[:] = 0
    bit = view(scratch("kv-bit", seg))
    for j in range(7):
        row = view(s[j])
        np.bitwise_and(row, top, out=bit)               # the borrowed bit, at bit 7
        np.right_shift(bit, _BIT[7 - j] if wide else np.uint8(7 - j), out=bit)
        np.bitwise_or(last, bit, out=last)
        np.bitwise_and(row, low, out=row)
    return buf[:n]
