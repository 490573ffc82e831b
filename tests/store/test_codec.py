"""Blob codec: bit-exact round trips, self-description, and clean failures on damage."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cwm_plugin.errors import CorruptBlob, IncompatibleBlob
from cwm_plugin.store import codec

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and a.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            == b.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs, infs, subnormals included) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.tensor(shape).prod()) if shape else 1
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return raw.view(dtype).reshape(shape)


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
    meta = codec.peek(blob)
    assert meta["fingerprint"] == "model-x" and meta["key"] == "ab"
    assert json.loads(meta["shape"]) == [2, 8, 16] and meta["dtype"] == "bfloat16"
    assert meta["checksum"].startswith("crc32:") and meta["format_version"] == "1"


def test_wrong_fingerprint_and_version_are_incompatible():
    t = torch.randn(4, 4)
    blob = codec.encode(t, key=b"k", fingerprint="a")
    with pytest.raises(IncompatibleBlob, match="fingerprint"):
        codec.decode(blob, fingerprint="b")
    n = struct.unpack("<Q", blob[:8])[0]
    header = blob[8:8 + n].replace(b'"format_version":"1"', b'"format_version":"9"')
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


@pytest.mark.parametrize("level,check", [(1, True), (0, True), (3, False), (0, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_any_flipped_or_truncated_byte_fails_cleanly(level, check, dtype):
    """Every single-byte damage raises CorruptBlob/IncompatibleBlob, or (checksum off)
    decodes to a tensor: never another exception."""
    t = (torch.randn(2, 16, 24) * 4).to(dtype)
    blob = codec.encode(t, key=b"key", fingerprint="fp", level=level, checksum=check)
    positions = sorted(set(range(0, len(blob), max(1, len(blob) // 300))) | {0, 7, 8, len(blob) - 1})
    for pos in positions:
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[pos] ^= flip
            _decode_or_clean_error(bytes(bad), check, t)
    for cut in range(0, len(blob), max(1, len(blob) // 100)):
        with pytest.raises((CorruptBlob, IncompatibleBlob)):
            codec.decode(blob[:cut], fingerprint="fp")


def _decode_or_clean_error(data: bytes, check: bool, original: torch.Tensor) -> None:
    try:
        out = codec.decode(data, fingerprint="fp")
    except (CorruptBlob, IncompatibleBlob):
        return
    if check:   # with checksums on, whatever decodes is exactly what was written
        assert same_bits(out.tensor, original)
        assert (out.key, out.layout, out.fingerprint) == (b"key", "", "fp")


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=300))
def test_garbage_never_crashes(data):
    with pytest.raises((CorruptBlob, IncompatibleBlob)):
        codec.decode(data)
