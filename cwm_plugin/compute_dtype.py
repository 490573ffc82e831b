"""The dtype this CPU computes in: one answer for ``make demo``, the test harness's ``vllm
serve`` processes, the MiniLM embedder and every benchmark.

bfloat16 where the CPU multiplies it natively (x86 AVX512-BF16 or AMX, Arm BF16); float32
elsewhere, where a bfloat16 graph is emulated and runs much slower than float32 (the
figures: bench/README.md). ``CWM_DTYPE`` (``auto``, ``bfloat16``, ``float32``,
``float16``) overrides the choice for every user of this module; an explicit dtype passed in
(a ``--dtype`` flag, a config field) overrides both.

The store keeps dtypes apart by itself: the KV dtype is part of every key's namespace, so KV
saved by a bfloat16 server is never restored into a float32 one (it is recomputed).

A process whose kernels are capped below AVX-512 (``ATEN_CPU_CAPABILITY=avx2`` for PyTorch,
``ONEDNN_MAX_CPU_ISA=AVX2`` for oneDNN) computes like an AVX2-only machine, whatever the CPU
has: the flags read from this machine drop AVX-512 and AMX then, so the choice follows the
kernels that actually run (and an AVX-512 host can measure what an AVX2 one would see).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ENV = "CWM_DTYPE"
DTYPES = ("bfloat16", "float32", "float16")
ALIASES = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "fp16": "float16",
           "half": "float16"}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``), empty where unknown."""
    this_machine = cpuinfo is None
    if this_machine:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return set()
    line = next((ln for ln in cpuinfo.splitlines()
                 if re.match(r"(flags|Features)\s*:", ln)), "")
    flags = set(line.partition(":")[2].split())
    return capped(flags, kernel_isa_cap()) if this_machine else flags


def kernel_isa_cap(env: dict[str, str] | None = None) -> str | None:
    """The ISA this process's kernels are capped to: ``avx2`` (no AVX-512 at all), ``avx512``
    (no bfloat16 or AMX instructions), or ``None`` when uncapped."""
    env = os.environ if env is None else env
    aten = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    onednn = env.get("ONEDNN_MAX_CPU_ISA", "").strip().lower()
    if aten in ("default", "avx2") or onednn.startswith(("sse", "avx2")) or onednn == "avx":
        return "avx2"
    if onednn in ("avx512_core", "avx512_core_vnni"):
        return "avx512"
    return None


def capped(flags: set[str], cap: str | None) -> set[str]:
    """``flags`` less what a kernel cap (:func:`kernel_isa_cap`) keeps from running."""
    dropped = {"avx2": ("avx512", "amx"), "avx512": ("avx512_bf16", "amx")}.get(cap or "")
    return {f for f in flags if not f.startswith(dropped)} if dropped else flags


def native_bf16(flags: set[str] | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16, AMX-BF16, Arm BF16)."""
    flags = cpu_flags() if flags is None else flags
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def isa(flags: set[str] | None = None) -> str:
    """The CPU kind for reports: ``amx``, ``avx512_bf16``, ``avx512``, ``avx2`` or ``other``."""
    flags = cpu_flags() if flags is None else flags
    for name, needs in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"),
                        ("avx512", "avx512f"), ("avx2", "avx2")):
        if needs in flags:
            return name
    return "other"


def compute_dtype(requested: str | None = None, flags: set[str] | None = None) -> str:
    """``requested`` as a dtype name; ``None`` or ``auto``: ``CWM_DTYPE`` if set, else
    bfloat16 where the CPU has native bfloat16 arithmetic, else float32."""
    name = (requested or "auto").strip().lower()
    if name == "auto":
        name = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if name == "auto":
        return "bfloat16" if native_bf16(flags) else "float32"
    name = ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {requested!r} (or {ENV}={os.environ.get(ENV)!r}): "
                         f"use auto or one of {', '.join(DTYPES)}")
    return name
