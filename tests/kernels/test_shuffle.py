"""Byte transforms: the CPU kernels always; the Triton twin on a GPU (and, where Triton's
interpreter runs, on the CPU too). Both must give the same bytes and invert bit-exactly."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cwm_plugin.kernels import shuffle as sh
from cwm_plugin.kernels import shuffle_triton as tri

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float64]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def bits(t: torch.Tensor) -> bytes:
    return sh.tensor_bytes(t).tobytes()


def random_bits(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape, dtype=np.int64))
    k = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * k,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


@settings(max_examples=120, deadline=None)
@given(shape=st.lists(st.integers(0, 9), max_size=4).map(tuple),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def test_cpu_transforms_invert_bit_exactly(shape, dtype, seed):
    t = random_bits(shape, dtype, seed)
    transforms = ["none", "bytes"] + (["exp"] if dtype == torch.bfloat16 else [])
    for name in transforms:
        s = sh.split(t, name)
        out = sh.join(s.streams, name, dtype, tuple(shape))
        assert out.shape == t.shape and bits(out) == bits(t), name


def test_byte_planes_layout():
    t = torch.tensor([0x0102, 0x0304, 0x0506], dtype=torch.int16)
    planes = sh.split(t, "bytes").streams
    assert planes[0].tolist() == [0x02, 0x04, 0x06] and planes[1].tolist() == [0x01, 0x03, 0x05]


def test_exp_transform_separates_exponents():
    t = torch.tensor([[1.0, -2.0], [1.5, -3.0], [1.25, -2.5]], dtype=torch.bfloat16)
    s = sh.split(t, "exp")
    base = s.streams[2]
    assert base.tolist() == [127, 128]                 # per-column exponent base
    assert s.streams[3].size == 0                       # no outliers
    assert sh.best_transform(torch.bfloat16) == "exp"
    assert sh.best_transform(torch.float16) == "bytes"
    assert sh.best_transform(torch.int8) == "none"


def test_exp_transform_outliers_and_specials():
    vals = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-38, 1e38, 1e-40, 3.0]
    t = torch.tensor(vals * 20, dtype=torch.bfloat16).reshape(9, 20)
    s = sh.split(t, "exp")
    assert s.streams[4].size > 0
    assert bits(sh.join(s.streams, "exp", t.dtype, tuple(t.shape))) == bits(t)


def test_damaged_streams_raise_value_error():
    t = torch.randn(4, 8).to(torch.bfloat16)
    s = sh.split(t, "exp")
    with pytest.raises(ValueError):
        sh.join(s.streams[:3], "exp", t.dtype, (4, 8))
    with pytest.raises(ValueError):
        sh.join([s.streams[0][:-1], *s.streams[1:]], "exp", t.dtype, (4, 8))
    with pytest.raises(ValueError):
        sh.split(t, "rot13")


def test_triton_module_imports_without_a_gpu():
    code = ("import cwm_plugin.kernels.shuffle_triton as m, sys; "
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


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="set TRITON_INTERPRET=1 to run the Triton kernels on the CPU")
def test_triton_matches_cpu_interpreted():
    _triton_matches_cpu("cpu")
