"""The one place that picks the compute dtype for this CPU, on the cpuinfo of the
CPU kinds we run on: bfloat16 only where the CPU multiplies it natively."""

from __future__ import annotations

import pytest

from cwm_plugin.compute_dtype import (
    capped,
    compute_dtype,
    cpu_flags,
    isa,
    kernel_isa_cap,
    native_bf16,
)

ZEN3_AVX2 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n"
             "flags\t\t: fpu sse2 avx avx2 fma bmi2 sha_ni\n")
XEON_BF16 = "flags\t\t: fpu avx avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
SAPPHIRE = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv("CWM_DTYPE", raising=False)


@pytest.mark.parametrize(("cpuinfo", "kind", "dtype"), [
    (ZEN3_AVX2, "avx2", "float32"), (XEON_BF16, "avx512_bf16", "bfloat16"),
    (SAPPHIRE, "amx", "bfloat16"), (GRAVITON3, "other", "bfloat16"), ("", "other", "float32"),
    ("flags\t: avx2 avx512f avx512bw\n", "avx512", "float32")])
def test_each_cpu_kind_gets_the_dtype_it_computes_natively(cpuinfo, kind, dtype):
    flags = cpu_flags(cpuinfo)
    assert isa(flags) == kind
    assert native_bf16(flags) == (dtype == "bfloat16")
    assert compute_dtype(None, flags) == compute_dtype("auto", flags) == dtype


def test_the_user_overrides_it(monkeypatch):
    avx2 = cpu_flags(ZEN3_AVX2)
    assert compute_dtype("bf16", avx2) == "bfloat16"  # an explicit dtype wins
    monkeypatch.setenv("CWM_DTYPE", "bfloat16")
    assert compute_dtype(None, avx2) == "bfloat16"
    assert compute_dtype("float32", avx2) == "float32"  # a flag beats the environment
    monkeypatch.setenv("CWM_DTYPE", "fp32")
    assert compute_dtype("auto", cpu_flags(XEON_BF16)) == "float32"
    monkeypatch.setenv("CWM_DTYPE", "int4")
    with pytest.raises(ValueError, match="CWM_DTYPE='int4'"):
        compute_dtype(None, avx2)
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        compute_dtype("fp8", avx2)


def test_this_machine_is_read():
    assert compute_dtype() in ("bfloat16", "float32")
    assert (compute_dtype() == "bfloat16") == native_bf16()


@pytest.mark.parametrize(("env", "cap"), [
    ({}, None), ({"ATEN_CPU_CAPABILITY": "avx2"}, "avx2"), ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "avx2"),
    ({"ONEDNN_MAX_CPU_ISA": "avx2_vnni"}, "avx2"), ({"ATEN_CPU_CAPABILITY": "avx512"}, None),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, "avx512"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, None), ({"ONEDNN_MAX_CPU_ISA": "ALL"}, None)])
def test_a_kernel_isa_cap_is_read_from_the_environment(env, cap):
    assert kernel_isa_cap(env) == cap


def test_capped_kernels_compute_like_the_cpu_kind_they_are_capped_to(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 on an AVX-512 bf16 host runs PyTorch's AVX2 kernels, where
    bfloat16 is emulated: the choice follows the kernels, not the CPU."""
    sapphire = cpu_flags(SAPPHIRE)
    assert isa(capped(sapphire, "avx2")) == "avx2"
    assert compute_dtype(None, capped(sapphire, "avx2")) == "float32"
    assert isa(capped(sapphire, "avx512")) == "avx512"
    assert not native_bf16(capped(sapphire, "avx512"))
    assert capped(sapphire, None) == sapphire
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert isa() in ("avx2", "other") and compute_dtype() == "float32"
