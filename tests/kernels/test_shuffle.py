"""Byte transforms: the CPU kernels always; the Triton twin on a GPU and, always, under Triton's
interpreter in a subprocess. Both must give the same bytes and invert bit-exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import DTYPES, bits, kv_like, random_bits

from cwm_kernels import kvsplit
from cwm_kernels import shuffle as sh
from cwm_kernels import shuffle_triton as tri

pytestmark = pytest.mark.unit

ALL_DTYPES = [*DTYPES, torch.float64]


def round_trip(t: torch.Tensor, transform: str) -> torch.Tensor:
    return sh.join(sh.split(t, transform), t.dtype, tuple(t.shape))


@settings(max_examples=150, deadline=None)
@given(shape=st.lists(st.integers(0, 9), max_size=4).map(tuple),
       dtype=st.sampled_from(ALL_DTYPES), seed=st.integers(0, 2**31))
def test_cpu_transforms_invert_bit_exactly(shape, dtype, seed):
    t = random_bits(shape, dtype, seed)
    for name in sh.transforms_for(dtype):
        out = round_trip(t, name)
        assert out.shape == t.shape and bits(out) == bits(t), name


@pytest.mark.parametrize("shape", [(30, 3, 128, 128), (2, 3, 7, 5), (4, 33), (9,), (1, 2, 1)])
@pytest.mark.parametrize("variant", ["kvsplit", "kvsplit:apart", "kvsplit:folded"])
def test_kvsplit_on_kv_like_blocks(shape, variant):
    t = kv_like(shape, seed=len(shape)) if len(shape) >= 2 else random_bits(shape, torch.bfloat16, 3)
    s = sh.split(t, variant, compressed_size=lambda a: int(a.size * 0.5))
    assert s.transform == "kvsplit"
    assert bits(sh.join(s, t.dtype, shape)) == bits(t)
    into = torch.empty(shape, dtype=t.dtype)
    assert sh.join(s, t.dtype, shape, into=into) is into and bits(into) == bits(t)


def test_kvsplit_streams_escapes_and_sign_choice():
    t = kv_like((2, 3, 16, 32), seed=5)
    t.view(-1)[7] = 1e-38                       # exponent far from its row and column
    s = sh.split(t, "kvsplit", compressed_size=lambda a: a.size)       # signs never compress
    assert s.names == ["exp4", "rowbase", "colbase", "escidx", "escapes", "sm0", "sm1"]
    assert s.streams[4].size >= 2 and s.streams[3].size == 4 * s.streams[4].size   # escaped
    apart = sh.split(t, "kvsplit", compressed_size=lambda a: 0)
    assert apart.names[5:] == ["sign0", "mant70", "sign1", "mant71"]
    assert apart.streams[5].size == 2 * 3 * 8 * 32 // 8
    g, h, r, c = kvsplit.matrices((2, 3, 16, 32))
    assert (g, h, r, c) == (6, 2, 8, 32)


def test_byte_planes_are_high_byte_first():
    t = torch.tensor([0x0102, 0x0304, 0x0506], dtype=torch.int16)
    planes = sh.split(t, "bytes").streams
    assert planes[0].tolist() == [0x01, 0x03, 0x05] and planes[1].tolist() == [0x02, 0x04, 0x06]
    assert sh.best_transform(torch.bfloat16) == "kvsplit:folded"
    assert sh.best_transform(torch.bfloat16, sign_planes=True) == "kvsplit"
    assert sh.best_transform(torch.float16) == "bytes"
    assert sh.best_transform(torch.int8) == "none"


def test_byte_view_and_tensor_bytes_agree():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert sh.byte_view(t).dtype == torch.uint8 and sh.byte_view(t).numel() == 24
    assert sh.tensor_bytes(t).tobytes() == bits(t)
    assert sh.byte_view(torch.empty(0, 3)).numel() == 0


def test_damaged_streams_raise_value_error():
    t = kv_like((2, 2, 8, 8), seed=1)
    s = sh.split(t, "kvsplit")
    with pytest.raises(ValueError):
        sh.join(sh.Split("kvsplit", s.streams[:3], s.names[:3]), t.dtype, (2, 2, 8, 8))
    short = [s.streams[0][:-1], *s.streams[1:]]
    with pytest.raises(ValueError):
        sh.join(sh.Split("kvsplit", short, s.names), t.dtype, (2, 2, 8, 8))
    wrong_escapes = [*s.streams[:4], np.zeros(s.streams[4].size + 1, np.uint8), *s.streams[5:]]
    with pytest.raises(ValueError, match="escape"):
        sh.join(sh.Split("kvsplit", wrong_escapes, s.names), t.dtype, (2, 2, 8, 8))
    with pytest.raises(ValueError):
        sh.split(t, "rot13")
    with pytest.raises(ValueError):
        sh.split(t.float(), "kvsplit")
    with pytest.raises(ValueError):
        sh.expected_sizes("bytes", torch.float16, (4,), ["plane0", "plane7"])


def test_triton_module_imports_without_a_gpu():
    code = ("import cwm_kernels.shuffle_triton as m, sys; "
            "sys.exit(0 if 'triton' not in sys.modules else 1)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def _triton_matches_cpu(device: str) -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
        for shape in ((3, 5, 7), (1,), (0,), (1000, 3)):
            t = random_bits(shape, dtype, 7)
            cpu = np.concatenate(sh.split(t, "bytes").streams) if t.numel() else np.empty(0)
            planes = tri.shuffle_planes(t.to(device))
            assert planes.cpu().numpy().tobytes() == cpu.astype(np.uint8).tobytes()
            back = tri.unshuffle_planes(planes, dtype, shape)
            assert bits(back.cpu()) == bits(t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_matches_cpu_on_gpu():
    _triton_matches_cpu("cuda")


def test_triton_matches_cpu_interpreted():
    """Runs the Triton kernels under TRITON_INTERPRET=1 (set before triton is imported, hence
    the subprocess) and compares them with the CPU planes."""
    pytest.importorskip("triton")
    here = Path(__file__).resolve()
    code = (f"import sys; sys.path[:0] = [{str(here.parent)!r}, {str(here.parents[1])!r}]\n"
            "import test_shuffle\n"
            "test_shuffle._triton_matches_cpu('cpu')\n"
            "print('triton-interpreted-ok')\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "triton-interpreted-ok" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 4096 * 9])
def test_seven_bit_packing_round_trips_at_any_length(n):
    rng = np.random.default_rng(n)
    values = rng.integers(0, 128, n, dtype=np.uint8)
    packed = kvsplit.pack7(values)
    assert packed.size == 7 * ((n + 7) // 8)
    assert np.array_equal(kvsplit.unpack7(packed, n), values)
