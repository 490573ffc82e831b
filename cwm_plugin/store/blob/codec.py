"""Blob codec: one tensor <-> bytes, bit-exact, self-describing, checksummed.

The container (:mod:`.container`, which reads and writes its header without torch) is a plain
safetensors file (any safetensors reader can open it): its ``__metadata__`` holds the format
version, model fingerprint, layout, dtype, shape, key, token count, codec parameters, the
payload checksum and a CRC-32 of the metadata itself, and where given the ``content`` a KV
block stands for (what every key sharing the blob shares: :mod:`cwm_plugin.store.binding`) or
the ``revision`` of a record that is rewritten under its key; its tensors are ``uint8``
*streams* made by a byte transform (:mod:`cwm_kernels.shuffle`), each compressed with zstd or
kept raw when zstd would not shrink it.

The payload checksum covers every stored byte and is verified on every decode: each zstd
stream is a frame with its content checksum (XXH64 of the decompressed stream, checked by zstd
while it decompresses), and the raw streams' bytes carry a CRC-32 (``checksum:
"crc32-raw:<hex>"``): cheaper than a CRC-32 over the decoded tensor (``"crc32:<hex>"``, what
format 1 blobs carry, verified when read), and as strong, because the transform is a
deterministic, exactly inverted function of the checked streams.

``level=0`` means no compression and no transform: the payload is the tensor's raw bytes, so a
flipped payload byte with ``checksum=False`` decodes to a (wrong) tensor without an error.
Everything else that is wrong raises :class:`CorruptBlob` (damaged, truncated, not ours) or
:class:`IncompatibleBlob` (another model's or layout's blob, an unknown format version). Every
size in the header is checked against the tensor's shape and dtype (and a zstd frame's declared
size) before anything is allocated, so a damaged header cannot ask for gigabytes.

Format 3 (written) pairs ``kvsplit``'s exponent nibbles far apart and bit-packs its 7-bit
mantissas, so both decode with whole-word shifts instead of byte interleaving and entropy
decoding. Blobs with the ``none`` or ``bytes`` transform of every format are read (format 1
orders byte planes low byte first, formats 2 and 3 high byte first); ``exp`` and ``kvsplit``
blobs of formats 1 and 2 are :class:`IncompatibleBlob` (recomputed).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zstandard

from cwm_kernels import shuffle as sh
from cwm_plugin.errors import CorruptBlob, IncompatibleBlob
from cwm_plugin.store.blob.container import (
    FORMAT,
    check_meta,
    crc32,
    meta_crc,
    pack_blob,
    read_header,
)

FORMAT_VERSION = 3
READABLE_VERSIONS = ("1", "2", "3")
RAW_IF_ABOVE = 0.97       # keep a stream raw when zstd saves less than 3%
MAX_ZSTD_EXPANSION = 1 << 16   # no zstd frame grows more than this (RLE blocks: ~32768x)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_local = threading.local()   # per-thread zstd contexts (a cache, not state)


@dataclass
class DecodedBlob:
    tensor: torch.Tensor
    key: bytes
    num_tokens: int
    layout: str
    fingerprint: str
    meta: dict[str, Any] = field(default_factory=dict)


def _compressor(level: int, checksum: bool = False) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "c", None)
    if cache is None:
        cache = _local.c = {}
    if (level, checksum) not in cache:
        cache[level, checksum] = zstandard.ZstdCompressor(level=level, write_checksum=checksum)
    return cache[level, checksum]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def encode(tensor: torch.Tensor, *, key: bytes, fingerprint: str, num_tokens: int = 0,
           layout: str = "", level: int = 1, shuffle: bool = True,
           checksum: bool = True, transform: str | None = None,
           sign_planes: bool = False, content: bytes = b"",
           revision: int | None = None) -> bytes:
    """Encode ``tensor`` (any shape, a supported dtype) into one self-describing blob.

    ``content``: the content identity of a KV block; ``revision``: a rewritten record's
    revision (both in the header, see the module docstring).

    ``transform`` overrides the byte transform that ``shuffle`` would pick (for benchmarks);
    ``sign_planes``: bfloat16's signs as compressed bit planes where they compress (smaller,
    slower to decode; see :func:`~cwm_kernels.shuffle.best_transform`)."""
    if tensor.dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {tensor.dtype} is not supported by the blob codec")
    if not 0 <= level <= 22:
        raise ValueError(f"zstd level must be 0..22, got {level}")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if transform is None:
        transform = sh.best_transform(t.dtype, sign_planes) if (shuffle and level > 0) \
            else "none"
    parts = sh.split(t, transform, compressed_size=lambda a: len(_compressor(level).compress(a)))
    streams: list[tuple[str, str, int]] = []
    payloads: list[bytes | np.ndarray] = []
    for name, s in zip(parts.names, parts.streams, strict=True):
        if level > 0 and s.size >= 64 and _worth_trying(s, level):
            z = _compressor(level, checksum).compress(s)
            if len(z) < RAW_IF_ABOVE * s.size:
                streams.append((name, "zstd", int(s.size)))
                payloads.append(z)
                continue
        streams.append((name, "raw", int(s.size)))
        payloads.append(s)
    meta = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "fingerprint": fingerprint,
        "layout": layout,
        "dtype": DTYPE_NAMES[t.dtype],
        "shape": json.dumps(list(t.shape)),
        "key": bytes(key).hex(),
        "num_tokens": str(int(num_tokens)),
        "transform": parts.transform,
        "level": str(level),
        "streams": json.dumps(streams),
        "checksum": _raw_crc([p for (_, c, _), p in zip(streams, payloads, strict=True)
                              if c == "raw"]) if checksum else "",
    }
    if content:
        meta["content"] = bytes(content).hex()
    if revision is not None:
        meta["revision"] = str(int(revision))
    if checksum:
        meta["meta_crc"] = meta_crc(meta)
    return pack_blob(meta, payloads)


def _worth_trying(s: np.ndarray, level: int, sample: int = 128 << 10) -> bool:
    """Skip zstd on a large stream whose first ``sample`` bytes do not shrink (the bf16
    mantissa stream): compressing it in full would only cost time."""
    if s.size <= 2 * sample:
        return True
    return len(_compressor(level).compress(s[:sample])) < RAW_IF_ABOVE * sample


def _checksum_of(t: torch.Tensor) -> str:
    """Format 1's checksum: CRC-32 of the tensor's bytes."""
    return f"crc32:{crc32(sh.tensor_bytes(t)):08x}"


def _raw_crc(raw: list) -> str:
    crc = 0
    for p in raw:
        crc = crc32(p, crc)
    return f"crc32-raw:{crc:08x}"


def decode(data: bytes | bytearray | memoryview, *, fingerprint: str | None = None,
           layout: str | None = None, verify: bool = True,
           into: torch.Tensor | None = None, stages: Any = None,
           borrow: bool = False) -> DecodedBlob:
    """Decode a blob made by :func:`encode`. ``fingerprint`` and ``layout`` (if given) must
    match the blob's, else :class:`IncompatibleBlob`.

    ``into``: a contiguous CPU tensor to write the result into (saves an allocation and a
    copy when the caller stacks blocks); used only if its dtype and shape match the blob's,
    and left with unspecified content if decoding fails. ``borrow``: an uncompressed blob
    (``level=0``) decodes to a read-only view of ``data``, not a copy into ``into``: for a
    caller that copies the block on at once, while ``data`` lives. ``stages`` (a
    :class:`~cwm_plugin.timing.Stages`): seconds spent in ``decompress`` (header, zstd,
    checksums) and ``transform`` (the inverse byte transform) are added to it."""
    t0 = time.perf_counter()
    meta, entries, start = read_header(data)
    if "sealed" in meta:
        raise IncompatibleBlob("blob is encrypted at rest", hint="the store opens it with the "
                               "request's cache_salt; without it the block is recomputed")
    version = meta.get("format_version", "")
    if version not in READABLE_VERSIONS:
        raise IncompatibleBlob(f"blob format version {version!r} is not {FORMAT_VERSION}",
                               hint="written by another cwm version; recompute or upgrade")
    if verify:
        check_meta(meta)
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise IncompatibleBlob(
            f"blob belongs to model fingerprint {meta.get('fingerprint')!r}, not {fingerprint!r}",
            hint="the model or KV layout changed; the block must be recomputed")
    if layout is not None and meta.get("layout") != layout:
        raise IncompatibleBlob(f"blob has KV layout {meta.get('layout')!r}, not {layout!r}",
                               hint="the KV cache layout changed; the block must be recomputed")
    dtype, shape, streams, transform = _payload_spec(meta, version)
    try:
        sizes = sh.expected_sizes(transform, dtype, shape, [name for name, _, _ in streams])
    except ValueError as exc:
        raise CorruptBlob(f"blob streams do not fit its metadata: {exc}",
                          hint="damaged blob") from exc
    for (name, _, raw_len), (lo, hi) in zip(streams, sizes, strict=True):
        if not lo <= raw_len <= hi:
            raise CorruptBlob(f"blob stream {name} claims {raw_len} bytes; a {meta['dtype']} "
                              f"{list(shape)} tensor has {lo}..{hi}", hint="damaged blob")
    expected = meta.get("checksum", "") if verify else ""
    if expected and not expected.startswith(("crc32:", "crc32-raw:")):
        raise CorruptBlob(f"unknown blob checksum {expected[:20]!r}", hint="damaged blob")
    raw_streams = _read_streams(memoryview(data), entries, start, streams,
                                stream_checks=expected.startswith("crc32-raw:"))
    if expected.startswith("crc32-raw:"):
        got = _raw_crc([a for a, (_, c, _) in zip(raw_streams, streams, strict=True)
                        if c == "raw"])
        if got != expected:
            raise CorruptBlob(f"blob checksum mismatch ({got} != {expected})",
                              hint="the stored bytes are damaged; the block will be recomputed")
    if version == "1" and transform == "bytes":
        raw_streams = raw_streams[::-1]           # format 1 stored the low byte first
    parts = sh.Split(transform, raw_streams, [name for name, _, _ in streams])
    t1 = time.perf_counter()
    try:
        if into is not None and (into.dtype != dtype or tuple(into.shape) != shape
                                 or not into.is_contiguous() or into.device.type != "cpu"):
            into = None
        tensor = sh.join(parts, dtype, shape, into=into, borrow=borrow)
    except (ValueError, IndexError, MemoryError) as exc:
        raise CorruptBlob(f"blob payload does not rebuild a {meta['dtype']} {list(shape)} "
                          f"tensor: {exc}", hint="damaged blob; recompute") from exc
    if expected.startswith("crc32:"):
        got = _checksum_of(tensor)
        if got != expected:
            raise CorruptBlob(f"blob checksum mismatch ({got} != {expected})",
                              hint="the stored bytes are damaged; the block will be recomputed")
    if stages is not None:
        stages.add("decompress", t1 - t0)
        stages.add("transform", time.perf_counter() - t1)
    return DecodedBlob(tensor, bytes.fromhex(meta["key"]), int(meta["num_tokens"]),
                       meta.get("layout", ""), meta.get("fingerprint", ""), meta)


def _payload_spec(meta: dict[str, str], version: str
                  ) -> tuple[torch.dtype, tuple[int, ...], list[tuple[str, str, int]], str]:
    """(dtype, shape, [(stream name, codec, raw length)], transform) from checked metadata."""
    try:
        dtype = DTYPES[meta["dtype"]]
        shape = tuple(int(x) for x in json.loads(meta["shape"]))
        streams = [(str(a), str(b), int(c)) for a, b, c in json.loads(meta["streams"])]
        transform = meta["transform"]
        bytes.fromhex(meta["key"])
        int(meta["num_tokens"])
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptBlob(f"blob metadata is damaged ({type(exc).__name__}: {exc})",
                          hint="the block will be recomputed") from exc
    if any(d < 0 for d in shape):
        raise CorruptBlob(f"blob shape {shape} is negative", hint="damaged blob")
    if version in ("1", "2") and transform not in ("none", "bytes"):
        raise IncompatibleBlob(f"format {version} blob with transform {transform!r} is no "
                               "longer read",
                               hint="written by an older cwm; the block will be recomputed")
    return dtype, shape, streams, transform


def _read_streams(mv: memoryview, entries: dict[str, Any], start: int,
                  streams: list[tuple[str, str, int]], *, stream_checks: bool = False
                  ) -> list[np.ndarray]:
    """The streams, zstd ones decompressed (into scratch buffers). ``stream_checks``: every
    zstd frame must carry its content checksum (zstd verifies it while decompressing)."""
    names = [f"s{i:02d}" for i in range(len(streams))]
    if sorted(entries) != names:
        raise CorruptBlob("blob streams do not match its metadata", hint="damaged blob")
    end = start
    out: list[np.ndarray] = []
    for name, (_, codec, raw_len) in zip(names, streams, strict=True):
        e = entries[name]
        try:
            a, b = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptBlob("blob stream offsets are damaged", hint="damaged blob") from exc
        if a != end - start or b < a or start + b > len(mv):
            raise CorruptBlob(f"blob stream {name} lies outside the blob ({len(mv)} bytes)",
                              hint="the blob was truncated; the block will be recomputed")
        chunk = mv[start + a:start + b]
        end = start + b
        if codec == "raw":
            if len(chunk) != raw_len:
                raise CorruptBlob(f"raw stream {name} holds {len(chunk)} bytes, not {raw_len}",
                                  hint="damaged blob")
            out.append(np.frombuffer(chunk, np.uint8))
        elif codec == "zstd":
            declared, has_checksum = _frame_info(chunk)
            if declared != raw_len or raw_len > MAX_ZSTD_EXPANSION * len(chunk):
                raise CorruptBlob(f"zstd stream {name} declares {declared} bytes, the header "
                                  f"{raw_len}", hint="damaged blob")
            if stream_checks and not has_checksum:
                raise CorruptBlob(f"zstd stream {name} has lost its checksum",
                                  hint="damaged blob")
            out.append(_decompress_into(chunk, sh.scratch(f"z{len(out)}", raw_len), name))
        else:
            raise CorruptBlob(f"unknown stream codec {codec!r}", hint="damaged blob")
    if end != len(mv):
        raise CorruptBlob(f"blob has {len(mv) - end} trailing bytes", hint="damaged blob")
    return out


def _frame_info(chunk: memoryview) -> tuple[int, bool]:
    """(declared content size or -1, whether the frame carries a content checksum)."""
    try:
        params = zstandard.get_frame_parameters(chunk)
    except zstandard.ZstdError:
        return -1, False
    return int(params.content_size), bool(params.has_checksum)


def _decompress_into(chunk: memoryview, buf: np.ndarray, name: str) -> np.ndarray:
    """Decompress one zstd frame into ``buf`` (a reused scratch array: no page faults), which
    it must fill exactly."""
    want = buf.size
    try:
        reader = _decompressor().stream_reader(chunk, read_across_frames=False)
        view = memoryview(buf).cast("B")
        got = 0
        while got < want:
            n = reader.readinto(view[got:])
            if n == 0:
                break
            got += n
        extra = reader.read(1) if got == want else b""
    except zstandard.ZstdError as exc:
        raise CorruptBlob(f"blob stream {name} does not decompress: {exc}",
                          hint="damaged blob; the block will be recomputed") from exc
    if got != want or extra:
        raise CorruptBlob(f"stream {name} decompressed to {'more' if extra else got} bytes, "
                          f"not {want}", hint="damaged blob")
    return buf
