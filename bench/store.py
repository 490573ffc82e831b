"""Store benchmark: put/get throughput per tier (memory, disk, Redis) on real KV blocks.

The blocks are SmolLM2-135M's bf16 KV captured from vLLM's paged cache (see ``bench/codec.py``;
cached, or ``--kv-dir``). Each tier is measured alone (the others disabled), then all three
together as a server would run them. ``put`` includes encoding (on the store's pool, io_workers
threads); ``put_blob``/``get_blob`` move encoded bytes only; ``get`` includes decoding with
checksum verification. Throughput is in GB/s of raw tensor bytes, the best of ``--rounds``;
the ratio is raw over stored bytes over all rounds. Redis is a real ``redis-server`` started
for the run (cwm_plugin.testing.redis_server).

    python bench/store.py --json bench/results/store.json [--quick] [--no-redis]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import time
from pathlib import Path

import codec as codec_bench
import torch
from _common import machine, table, write_json
from prometheus_client import CollectorRegistry
from tqdm import tqdm

from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.tiered import KVStore
from cwm_plugin.testing.redis_server import RedisServer


def run_tier(name: str, cfg: StoreConfig, blocks: list[torch.Tensor], rounds: int) -> dict:
    raw = sum(b.numel() * b.element_size() for b in blocks)
    best: dict[str, float] = {}
    raw_total = stored_total = 0
    for r in range(rounds):
        store = KVStore(cfg, registry=CollectorRegistry())
        keys = [f"{name}-{r}-{i}".encode() for i in range(len(blocks))]
        t0 = time.perf_counter()
        for k, b in zip(keys, blocks, strict=True):
            store.put(k, b, num_tokens=128)
        store.flush()
        t_put = time.perf_counter() - t0
        t0 = time.perf_counter()
        blobs = [store.get_blob(k) for k in keys]
        t_get_blob = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = store.get_many(keys)
        t_get = time.perf_counter() - t0
        assert all(o is not None and torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
        keys2 = [k + b"-copy" for k in keys]
        t0 = time.perf_counter()
        for k, blob in zip(keys2, blobs, strict=True):
            store.put_blob(k, blob)
        store.flush()
        t_put_blob = time.perf_counter() - t0
        raw_total += raw
        stored_total += sum(len(b) for b in blobs)
        store.close()
        for label, t in (("put", t_put), ("get", t_get), ("put_blob", t_put_blob),
                         ("get_blob", t_get_blob)):
            best[label] = max(best.get(label, 0.0), raw / t / 1e9)
    return {"tier": name, **{f"{k}_gbps": v for k, v in best.items()},
            "ratio": raw_total / stored_total, "rounds": rounds, "blocks": len(blocks),
            "raw_bytes": raw}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--quick", action="store_true", help="4 blocks, 1 round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-dir", help="folder of captured KV blocks (see bench/codec.py)")
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis tier")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    blocks = (codec_bench.load_kv_dir(args.kv_dir) if args.kv_dir
              else codec_bench.capture_vllm("bfloat16"))
    if args.quick:
        blocks, args.rounds = blocks[:4], 1
    print(f"{len(blocks)} {blocks[0].dtype} blocks of {list(blocks[0].shape)} "
          f"({blocks[0].numel() * blocks[0].element_size() / 1e6:.2f} MB each)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="cwm-bench-store-") as tmp, \
            contextlib.ExitStack() as stack:
        base = {"fingerprint": "bench", "memory_bytes": 0}
        tiers: dict[str, dict] = {
            "memory": {**base, "memory_bytes": 4 << 30},
            "disk": {**base, "disk_path": str(Path(tmp) / "disk")},
        }
        if not args.no_redis:
            redis = stack.enter_context(RedisServer())
            tiers["redis"] = {**base, "redis_url": redis.url, "redis_write": "through"}
            tiers["all (mem+disk+redis behind)"] = {
                **base, "memory_bytes": 4 << 30, "disk_path": str(Path(tmp) / "all"),
                "redis_url": redis.url, "redis_prefix": "all"}
        for name, kw in tqdm(tiers.items(), desc="tiers"):
            rows.append(run_tier(name, StoreConfig(**kw), blocks, args.rounds))
    print(table(rows, ["tier", "put_gbps", "get_gbps", "put_blob_gbps", "get_blob_gbps",
                       "ratio"]))
    write_json(args.json, {"blocks": len(blocks), "block_shape": list(blocks[0].shape),
                           "dtype": str(blocks[0].dtype), "machine": machine(), "rows": rows,
                           "note": "GB/s of raw tensor bytes; put includes encode, get decode"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
