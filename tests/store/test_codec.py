"""Blob codec: bit-exact round trips, self-description, and clean failures on damage."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_helpers import DTYPES, kv_like, same_bits
from kv_helpers import random_bits as random_tensor

from cwm_kernels import shuffle as sh
from cwm_plugin.errors import CorruptBlob, IncompatibleBlob
from cwm_plugin.store.blob import codec, container

pytestmark = pytest.mark.unit

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31),
       level=st.sampled_from([0, 1, 3]), shuffle=st.booleans(), check=st.booleans())
def test_round_trip_is_bit_exact(shape, dtype, seed, level, shuffle, check):
    t = random_tensor(shape, dtype, seed)
    blob = codec.encode(t, key=b"\x01\x02", fingerprint="fp", num_tokens=7, layout="L",
                        level=level, shuffle=shuffle, checksum=check)
    out = codec.decode(blob, fingerprint="fp")
    assert same_bits(out.tensor, t)
    assert (out.key, out.num_tokens, out.layout, out.fingerprint) == (b"\x01\x02", 7, "L", "fp")
    into = torch.empty(shape, dtype=dtype)
    assert same_bits(codec.decode(blob, into=into).tensor, t) and same_bits(into, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_realistic_kv_round_trip_and_compresses(dtype):
    # smooth per-channel scales like real KV, so the exponent transform has outliers too
    g = torch.Generator().manual_seed(1)
    scale = torch.exp(torch.randn(1, 1, 1, 64, generator=g) * 2)
    t = (torch.randn(3, 2, 32, 64, generator=g) * scale)
    t[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 1e-30, 3e4])
    t = t.to(dtype)
    blob = codec.encode(t, key=b"k", fingerprint="fp")
    assert same_bits(codec.decode(blob).tensor, t)
    if dtype.is_floating_point and t.element_size() > 1:
        assert len(blob) < t.numel() * t.element_size()


def test_container_is_safetensors_with_metadata():
    t = torch.randn(2, 8, 16).to(torch.bfloat16)
    blob = codec.encode(t, key=b"\xab", fingerprint="model-x", num_tokens=16, layout="cpu")
    streams = safetensors.torch.load(blob)          # any safetensors reader opens it
    assert all(v.dtype == torch.uint8 for v in streams.values())
    meta = container.peek(blob)
    assert meta["fingerprint"] == "model-x" and meta["key"] == "ab"
    assert json.loads(meta["shape"]) == [2, 8, 16] and meta["dtype"] == "bfloat16"
    assert meta["checksum"].startswith("crc32-raw:") and meta["format_version"] == "3"


def test_wrong_fingerprint_and_version_are_incompatible():
    t = torch.randn(4, 4)
    blob = codec.encode(t, key=b"k", fingerprint="a")
    with pytest.raises(IncompatibleBlob, match="fingerprint"):
        codec.decode(blob, fingerprint="b")
    n = struct.unpack("<Q", blob[:8])[0]
    header = blob[8:8 + n].replace(b'"format_version":"3"', b'"format_version":"9"')
    with pytest.raises(IncompatibleBlob, match="version"):
        codec.decode(blob[:8] + header + blob[8 + n:])
    with pytest.raises(CorruptBlob, match="metadata checksum"):   # same length, other key
        codec.decode(blob.replace(b'"key":"6b"', b'"key":"6c"'))


def test_not_ours_is_corrupt():
    other = safetensors.torch.save({"x": torch.zeros(3)})
    for data in (b"", b"\x00" * 7, b"hello world, not a blob", other):
        with pytest.raises(CorruptBlob):
            codec.decode(data)


def test_negative_control_flipped_payload_without_checksum_decodes_wrong():
    t = torch.randn(4, 16, 32).to(torch.bfloat16)
    blob = bytearray(codec.encode(t, key=b"k", fingerprint="fp", level=0, checksum=False))
    blob[-5] ^= 0x40
    out = codec.decode(bytes(blob), fingerprint="fp", verify=True)
    assert out.tensor.shape == t.shape and not same_bits(out.tensor, t)
    checked = bytearray(codec.encode(t, key=b"k", fingerprint="fp", level=0, checksum=True))
    checked[-5] ^= 0x40
    with pytest.raises(CorruptBlob, match="checksum"):
        codec.decode(bytes(checked), fingerprint="fp", verify=True)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("level,check", [(1, True), (0, True), (3, False), (0, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_any_flipped_or_truncated_byte_fails_cleanly(level, check, dtype, verify):
    """Every single-byte damage raises CorruptBlob/IncompatibleBlob, or (checksums not written
    or not verified) decodes to a tensor of the right shape: never another exception."""
    t = (torch.randn(2, 16, 24) * 4).to(dtype)
    blob = codec.encode(t, key=b"key", fingerprint="fp", level=level, checksum=check)
    positions = sorted(set(range(0, len(blob), max(1, len(blob) // 300))) | {0, 7, 8, len(blob) - 1})
    for pos in positions:
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[pos] ^= flip
            _decode_or_clean_error(bytes(bad), check and verify, t, verify)
    for cut in range(0, len(blob), max(1, len(blob) // 100)):
        with pytest.raises((CorruptBlob, IncompatibleBlob)):
            codec.decode(blob[:cut], fingerprint="fp", verify=verify)


def _decode_or_clean_error(data: bytes, exact: bool, original: torch.Tensor,
                           verify: bool = True) -> None:
    try:
        out = codec.decode(data, fingerprint="fp", verify=verify)
    except (CorruptBlob, IncompatibleBlob):
        return
    assert out.tensor.dtype == original.dtype and out.tensor.shape == original.shape
    if exact:   # with checksums on, whatever decodes is exactly what was written
        assert same_bits(out.tensor, original)
        assert (out.key, out.layout, out.fingerprint) == (b"key", "", "fp")


def _rewrite_meta(blob: bytes, **changes: str) -> bytes:
    """The blob with metadata fields replaced (and its header re-packed), payload unchanged."""
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    header["__metadata__"].update(changes)
    header["__metadata__"].pop("meta_crc", None)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    return struct.pack("<Q", len(hj)) + hj + blob[8 + n:]


@pytest.mark.parametrize("verify", [True, False])
def test_header_sizes_are_checked_before_allocating(verify):
    import tracemalloc

    t = kv_like((2, 2, 8, 16))
    blob = codec.encode(t, key=b"k", fingerprint="fp", checksum=False)
    streams = json.loads(container.peek(blob)["streams"])
    huge = [[name, c, 1 << 40] for name, c, _ in streams]
    cases = [_rewrite_meta(blob, shape="[1099511627776, 2, 8, 16]"),      # 2^40 rows
             _rewrite_meta(blob, streams=json.dumps(huge)),
             _rewrite_meta(codec.encode(t, key=b"k", fingerprint="fp", level=0),
                           shape="[4096, 4096, 4096]")]
    tracemalloc.start()
    try:
        for bad in cases:
            with pytest.raises(CorruptBlob):
                codec.decode(bad, verify=verify)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_zstd_stream_that_lost_its_checksum_is_corrupt():
    t = kv_like((2, 2, 16, 64))
    checked = codec.encode(t, key=b"k", fingerprint="fp")
    plain = codec.encode(t, key=b"k", fingerprint="fp", checksum=False)
    meta = {k: v for k, v in container.peek(checked).items() if k != "meta_crc"}
    frames = [v.numpy() for _, v in sorted(safetensors.torch.load(plain).items())]
    forged = container.pack_blob(meta, frames)          # same streams, frames without XXH64
    assert same_bits(codec.decode(forged, verify=False).tensor, t)
    with pytest.raises(CorruptBlob, match="checksum"):
        codec.decode(forged)


def test_layout_must_match_when_given():
    t = torch.randn(2, 4, 8).to(torch.bfloat16)
    blob = codec.encode(t, key=b"k", fingerprint="fp", layout="cpu:blockdim0:[2, 4, 8]")
    assert same_bits(codec.decode(blob, layout="cpu:blockdim0:[2, 4, 8]").tensor, t)
    with pytest.raises(IncompatibleBlob, match="layout"):
        codec.decode(blob, layout="cuda:blockdim1:[2, 4, 8]")


def test_format_1_blobs_bytes_read_exp_refused():
    t = torch.randn(3, 8, 16).to(torch.float16)
    raw = codec.encode(t, key=b"k", fingerprint="fp", level=0)
    planes = sh.split(t, "bytes").streams                   # high byte first
    meta = {k: v for k, v in container.peek(raw).items() if k != "meta_crc"}
    v1 = container.pack_blob({**meta, "format_version": "1", "transform": "bytes",
                      "checksum": codec._checksum_of(t),       # format 1: CRC of the tensor
                      "streams": json.dumps([["plane0", "raw", t.numel()],
                                             ["plane1", "raw", t.numel()]])},
                     planes[::-1])                          # format 1: low byte first
    assert same_bits(codec.decode(v1).tensor, t)
    bad = bytearray(v1)
    bad[-3] ^= 0x10
    with pytest.raises(CorruptBlob, match="checksum"):
        codec.decode(bytes(bad))
    old_exp = _rewrite_meta(codec.encode(t.to(torch.bfloat16), key=b"k", fingerprint="fp"),
                            format_version="1", transform="exp")
    with pytest.raises(IncompatibleBlob, match="format 1"):
        codec.decode(old_exp)


def test_format_2_kvsplit_blobs_are_refused_not_misread():
    # Format 2 paired exponent nibbles as neighbours and zstd'ed whole mantissa bytes; read
    # with format 3's layout its streams would fit and decode to a wrong tensor.
    t = torch.randn(4, 8, 16).to(torch.bfloat16)
    v2 = _rewrite_meta(codec.encode(t, key=b"k", fingerprint="fp"), format_version="2")
    with pytest.raises(IncompatibleBlob, match="format 2"):
        codec.decode(v2)
    planes = codec.encode(t, key=b"k", fingerprint="fp", transform="bytes")
    assert same_bits(codec.decode(_rewrite_meta(planes, format_version="2")).tensor, t)


def test_production_size_bf16_block():
    """A 2.9 MB block shaped like SmolLM2's on vLLM CPU: large streams go through the
    compress-or-not sampling; the round trip is exact and it compresses."""
    t = kv_like((30, 3, 128, 128), seed=2)
    blob = codec.encode(t, key=b"big", fingerprint="fp", num_tokens=128, layout="L")
    assert same_bits(codec.decode(blob, fingerprint="fp", layout="L").tensor, t)
    into = torch.empty_like(t)
    assert codec.decode(blob, into=into).tensor is into and same_bits(into, t)
    streams = {name: c for name, c, _ in json.loads(container.peek(blob)["streams"])}
    assert streams["exp4"] == "zstd"
    assert len(blob) < 0.75 * t.numel() * 2


def test_bf16_signs_folded_by_default_planes_on_request_and_every_variant_decodes():
    # folded (the default) keeps sign+mantissa bytes raw; sign_planes lets a half's signs be
    # a zstd bit plane where that compresses (a little smaller, one entropy-coded stream
    # more to decode). A store reads every variant whatever its own setting: the decoder
    # goes by the stream names.
    t = kv_like((30, 3, 128, 128), seed=4)

    def streams(**kw) -> list[list]:
        return json.loads(container.peek(codec.encode(t, key=b"k", fingerprint="fp", **kw))["streams"])

    assert streams() == streams(transform="kvsplit:folded")
    assert streams(sign_planes=True) == streams(transform="kvsplit")
    assert "sm0" in [n for n, _, _ in streams()]
    for kw in ({}, {"sign_planes": True}, {"transform": "kvsplit:apart"}):
        blob = codec.encode(t, key=b"k", fingerprint="fp", **kw)
        assert same_bits(codec.decode(blob, fingerprint="fp").tensor, t), kw
    apart = [n for n, _, _ in streams(transform="kvsplit:apart")]
    assert "sign0" in apart and "sm0" not in apart


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=300))
def test_garbage_never_crashes(data):
    with pytest.raises((CorruptBlob, IncompatibleBlob)):
        codec.decode(data)
