"""Codec benchmark on real KV: compression ratio and one-core encode/decode speed per dtype.

KV source (pluggable):
* ``--kv-dir DIR``: safetensors files of KV blocks (e.g. captured from the connector's disk
  tier; cwm blobs are decoded first), every tensor in them is one block;
* default: SmolLM2-135M (real weights, bf16) run by transformers over ~2k tokens of LoCoMo
  conversation text, ``past_key_values`` laid out like vLLM's CPU cache blocks: per layer
  ``[kv_heads, 128 tokens, 2*head_size]`` (K then V), stacked over layers per block. Cached
  under ~/.cache/cwm_plugin/kv after the first run.

fp32 and fp16 are casts of the bf16 KV. Baselines measured in the same run: raw safetensors
(save/load bytes) and torch.save/torch.load. Everything runs with ``torch.set_num_threads(1)``.

    python bench/codec.py --json out/codec.json [--quick] [--kv-dir DIR]
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import sys
import time
from pathlib import Path

import torch
from _common import best_time, machine, table, write_json
from safetensors.torch import load, load_file, save, save_file
from tqdm import tqdm

from cwm_plugin.store import codec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BLOCK_TOKENS = 128
CACHE = Path(os.environ.get("CWM_KV_CACHE", Path.home() / ".cache" / "cwm_plugin" / "kv"))


def conversation_text(limit_chars: int = 40_000) -> str:
    lines: list[str] = []
    for f in sorted(glob.glob("/work/shared/data/locomo-dev/*.json")):
        conv = json.loads(Path(f).read_text())
        for i in range(1, 64):
            for turn in conv.get(f"session_{i}") or []:
                lines.append(f"{turn['speaker']}: {turn['text']}")
    return "\n".join(lines)[:limit_chars]


def capture_smollm2(tokens: int = 2048) -> list[torch.Tensor]:
    """Real KV of SmolLM2-135M in vLLM CPU block layout (cached on disk)."""
    cached = CACHE / f"smollm2-locomo-{tokens}.safetensors"
    if cached.exists():
        blocks = load_file(cached)
        return [blocks[k] for k in sorted(blocks, key=lambda k: int(k[5:]))]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cwm_plugin.testing.models import build_smollm2

    folder = build_smollm2()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ids = tok(conversation_text(), return_tensors="pt").input_ids[:, :tokens]
    print(f"capturing KV of SmolLM2 over {ids.shape[1]} tokens (once, ~1-2 min)...")
    with torch.no_grad():
        pkv = model(ids, use_cache=True).past_key_values
    layers = ([(x.keys, x.values) for x in pkv.layers] if hasattr(pkv, "layers")
              else list(zip(pkv.key_cache, pkv.value_cache, strict=True)))
    per_layer = [torch.cat([k[0], v[0]], dim=-1) for k, v in layers]   # [H, T, 2D]
    n = per_layer[0].shape[1] // BLOCK_TOKENS
    blocks = [torch.stack([x[:, b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS] for x in per_layer])
              .contiguous() for b in range(n)]
    CACHE.mkdir(parents=True, exist_ok=True)
    save_file({f"block{i}": b for i, b in enumerate(blocks)}, cached)
    return blocks


def load_kv_dir(path: str) -> list[torch.Tensor]:
    blocks: list[torch.Tensor] = []
    for f in sorted(Path(path).rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        try:
            blocks.append(codec.decode(data, verify=False).tensor)
            continue
        except Exception:
            pass
        try:
            blocks += list(load(data).values())
        except Exception:
            continue
    if not blocks:
        sys.exit(f"no KV blocks found under {path}")
    return blocks


def measure(blocks: list[torch.Tensor], enc, dec, repeat: int) -> dict[str, float]:
    raw = sum(b.numel() * b.element_size() for b in blocks)
    blobs = [enc(b) for b in blocks]
    stored = sum(len(x) for x in blobs)
    for b, x in zip(blocks, blobs, strict=True):       # every configuration must be exact
        out = dec(x)
        assert out.dtype == b.dtype and torch.equal(out.view(torch.uint8), b.view(torch.uint8))
    t_enc = best_time(lambda: [enc(b) for b in blocks], repeat)
    t_dec = best_time(lambda: [dec(x) for x in blobs], repeat)
    out = {"ratio": raw / stored, "encode_gbps": raw / t_enc / 1e9,
           "decode_gbps": raw / t_dec / 1e9, "raw_bytes": raw, "stored_bytes": stored}
    if dec is _dec:        # what the checksum costs: decode without verifying it
        t_nv = best_time(lambda: [_dec_noverify(x) for x in blobs], repeat)
        out["decode_noverify_gbps"] = raw / t_nv / 1e9
    return out


def configs(dtype: torch.dtype) -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = [("codec level0 (raw payload)", {"level": 0})]
    for level in (1, 3):
        out.append((f"codec zstd{level} no-shuffle", {"level": level, "shuffle": False}))
        out.append((f"codec zstd{level} bytes-shuffle", {"level": level, "transform": "bytes"}))
        if dtype == torch.bfloat16:
            out.append((f"codec zstd{level} exp-split", {"level": level, "transform": "exp"}))
    return out


def default_name(dtype: torch.dtype) -> str:
    from cwm_plugin.kernels.shuffle import best_transform

    name = {"exp": "exp-split", "bytes": "bytes-shuffle", "none": "no-shuffle"}
    return f"codec zstd1 {name[best_transform(dtype)]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--quick", action="store_true", help="4 blocks, 1 repeat")
    ap.add_argument("--kv-dir", help="folder of captured KV blocks (safetensors / cwm blobs)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    blocks = load_kv_dir(args.kv_dir) if args.kv_dir else capture_smollm2()
    source = args.kv_dir or "smollm2-135m transformers capture (locomo text)"
    if args.quick:
        blocks, args.repeat = blocks[:4], 1
    print(f"{len(blocks)} blocks of {list(blocks[0].shape)} from {source}")
    result: dict = {"source": source, "blocks": len(blocks), "block_shape": list(blocks[0].shape),
                    "threads": 1, "machine": machine(), "dtypes": {}}
    for name, dtype in DTYPES.items():
        data = [b.to(dtype) for b in blocks]
        rows = []
        todo = [("safetensors raw", lambda t: save({"t": t}), lambda x: load(x)["t"]),
                ("torch.save", _torch_save, _torch_load)]
        todo += [(label, _enc(kw), _dec) for label, kw in configs(dtype)]
        for label, enc, dec in tqdm(todo, desc=name, leave=False):
            rows.append({"config": label, **measure(data, enc, dec, args.repeat)})
        base = rows[0]
        for r in rows:
            r["ratio_vs_safetensors"] = r["stored_bytes"] and base["stored_bytes"] / r["stored_bytes"]
        chosen = next(r for r in rows if r["config"] == default_name(dtype))
        result["dtypes"][name] = {"default": chosen["config"], "ratio": chosen["ratio"],
                                  "encode_gbps": chosen["encode_gbps"],
                                  "decode_gbps": chosen["decode_gbps"],
                                  "decode_noverify_gbps": chosen["decode_noverify_gbps"],
                                  "table": rows}
        print(f"\n{name} (default: {chosen['config']})")
        print(table(rows, ["config", "ratio", "encode_gbps", "decode_gbps",
                           "decode_noverify_gbps", "ratio_vs_safetensors"]))
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json(args.json, result)
    return 0


def _enc(kw: dict):
    return lambda t: codec.encode(t, key=b"bench", fingerprint="bench", **kw)


def _dec(blob: bytes) -> torch.Tensor:
    return codec.decode(blob, fingerprint="bench", verify=True).tensor


def _dec_noverify(blob: bytes) -> torch.Tensor:
    return codec.decode(blob, fingerprint="bench", verify=False).tensor


def _torch_save(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _torch_load(x: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(x), weights_only=True)


if __name__ == "__main__":
    sys.exit(main())
