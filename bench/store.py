"""Store benchmark: put/get throughput per tier (memory, disk, Redis) on real KV blocks.

The blocks are SmolLM2-135M's bf16 KV captured from vLLM's paged cache (see ``bench/codec.py``;
cached, or ``--kv-dir``). Each tier is measured alone (the others disabled), then all three
together as a server would run them. ``put`` includes encoding (on the store's pool, io_workers
threads); ``put_blob``/``get_blob`` move encoded bytes only; ``get`` includes decoding with
checksum verification, from a cold page cache where the tier has a disk (its files are evicted
with ``posix_fadvise(DONTNEED)`` after the puts; ``get_warm`` reads them again, cached);
``read_into`` is the connector's restore path (blobs fetched chunk by chunk, decoded in
parallel on the store's threads, each block copied into a paged cache: a tensor a layer).
Throughput is in GB/s of raw tensor bytes, the best of ``--rounds``; the ratio is raw over
stored bytes over all rounds. Redis is a real ``redis-server`` started for the run
(cwm_plugin.testing.redis_server). The JSON names the machine, the load average and this
machine's memory copy and cached file read bandwidth.

Key operations: ``link_many``, ``pin_many``, ``unpin_many`` and ``delete_many`` of
``--keys`` (10k) keys in one call per tier, as keys/s; and a fill curve: put latency (p50/p99
of 200 puts of a small block, through encode and every write) as a tier grows to ``--fill``
(100k) blobs -- it should stay flat, not grow with the number of stored blobs.

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
from _common import bandwidth, evict_page_cache, load_average, machine, table, write_json
from prometheus_client import CollectorRegistry
from tqdm import tqdm

from cwm_kernels.blocks import BlockWriter
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.testing.redis_server import RedisServer


def run_tier(name: str, cfg: StoreConfig, blocks: list[torch.Tensor], rounds: int) -> dict:
    raw = sum(b.numel() * b.element_size() for b in blocks)
    best: dict[str, float] = {}
    raw_total = stored_total = 0
    layers = [torch.zeros(len(blocks), *blocks[0].shape[1:], dtype=blocks[0].dtype)
              for _ in range(blocks[0].shape[0])]        # a paged cache: a tensor a layer
    writer = BlockWriter(layers, 0)
    for r in range(rounds):
        store = KVStore(cfg, registry=CollectorRegistry())
        keys = [f"{name}-{r}-{i}".encode() for i in range(len(blocks))]
        t0 = time.perf_counter()
        for k, b in zip(keys, blocks, strict=True):
            store.put(k, b, num_tokens=128)
        store.flush()
        times = {"put": time.perf_counter() - t0}
        if cfg.disk_path:                  # a cold disk: nothing of the store in the page cache
            evict_page_cache(cfg.disk_path)
        t0 = time.perf_counter()
        out = store.get_many(keys)
        times["get"] = time.perf_counter() - t0
        assert all(o is not None and torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
        t0 = time.perf_counter()
        store.get_many(keys)
        times["get_warm"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        served = store.read_into(keys, lambda i, t: writer.write(i, t) or True,
                                 shape=tuple(blocks[0].shape), dtype=blocks[0].dtype)
        times["read_into"] = time.perf_counter() - t0
        assert None not in served and torch.equal(layers[0][0], blocks[0][0])
        t0 = time.perf_counter()
        blobs = [store.get_blob(k) for k in keys]
        times["get_blob"] = time.perf_counter() - t0
        keys2 = [k + b"-copy" for k in keys]
        t0 = time.perf_counter()
        for k, blob in zip(keys2, blobs, strict=True):
            store.put_blob(k, blob)
        store.flush()
        times["put_blob"] = time.perf_counter() - t0
        raw_total += raw
        stored_total += sum(len(b) for b in blobs)
        store.close()
        for label, t in times.items():
            best[label] = max(best.get(label, 0.0), raw / t / 1e9)
    return {"tier": name, **{f"{k}_gbps": v for k, v in best.items()},
            "ratio": raw_total / stored_total, "rounds": rounds, "blocks": len(blocks),
            "raw_bytes": raw, "cold": bool(cfg.disk_path)}


def keyop_rates(name: str, cfg: StoreConfig, n: int) -> dict:
    """keys/s of one batch call of each key operation over ``n`` keys of one group."""
    store = KVStore(cfg, registry=CollectorRegistry())
    group = b"K" * 18
    store.put(group + b"base", torch.ones(64)).result()
    keys = [group + i.to_bytes(4, "big") for i in range(n)]
    out: dict = {"tier": name, "keys": n}
    for op, call in (("link_many", lambda: store.link_many([(k, group + b"base")
                                                            for k in keys])),
                     ("pin_many", lambda: store.pin_many(keys)),
                     ("unpin_many", lambda: store.unpin_many(keys)),
                     ("delete_many", lambda: store.delete_many(keys))):
        t0 = time.perf_counter()
        done = call()
        out[f"{op}_keys_per_s"] = n / (time.perf_counter() - t0)
        assert any(len(v) == n for v in done.values()), (op, {t: len(v) for t, v in done.items()})
    store.close()
    return out


def fill_curve(name: str, cfg: StoreConfig, total: int, marks: list[int], sample: int = 200
               ) -> list[dict]:
    """Put latency of ``sample`` small blocks each time the tier holds ``marks`` blobs."""
    store = KVStore(cfg, registry=CollectorRegistry())
    rows: list[dict] = []
    g = torch.Generator().manual_seed(0)
    stored = 0
    with tqdm(total=total, desc=f"fill {name}", unit="blob") as bar:
        for mark in marks:
            while stored < mark - sample:
                futs = [store.put(f"f{stored + i}".encode(), torch.randn(256, generator=g))
                        for i in range(min(500, mark - sample - stored))]
                for f in futs:
                    f.result()
                bar.update(len(futs))
                stored += len(futs)
            lat = []
            for _ in range(sample):
                t0 = time.perf_counter()
                store.put(f"f{stored}".encode(), torch.randn(256, generator=g)).result()
                lat.append(time.perf_counter() - t0)
                stored += 1
            bar.update(sample)
            lat.sort()
            rows.append({"tier": name, "blobs": stored, "put_p50_ms": lat[len(lat) // 2] * 1e3,
                         "put_p99_ms": lat[int(len(lat) * 0.99) - 1] * 1e3})
    store.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--quick", action="store_true", help="4 blocks, 1 round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-dir", help="folder of captured KV blocks (see bench/codec.py)")
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis tier")
    ap.add_argument("--keys", type=int, default=10_000, help="keys per batch key operation")
    ap.add_argument("--fill", type=int, default=100_000, help="blobs to fill each tier to")
    ap.add_argument("--no-throughput", action="store_true", help="key ops and fill only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.quick:
        args.rounds, args.keys, args.fill = 1, 2000, 5000
    blocks: list[torch.Tensor] = []
    if not args.no_throughput:
        blocks = (codec_bench.load_kv_dir(args.kv_dir) if args.kv_dir
                  else codec_bench.capture_vllm("bfloat16"))
        blocks = blocks[:4] if args.quick else blocks
        print(f"{len(blocks)} {blocks[0].dtype} blocks of {list(blocks[0].shape)} "
              f"({blocks[0].numel() * blocks[0].element_size() / 1e6:.2f} MB each)")
    rows: list[dict] = []
    keyops: list[dict] = []
    fill: list[dict] = []
    marks = sorted({m for m in (1000, 10_000, 50_000, args.fill) if m <= args.fill})
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
            if blocks:
                rows.append(run_tier(name, StoreConfig(**kw), blocks, args.rounds))
            if name in ("memory", "disk", "redis"):
                for tag in ("k", "f"):     # a fresh store for each measurement
                    fresh = {**kw, "redis_prefix": f"{tag}{name}"}
                    if "disk_path" in kw:
                        fresh["disk_path"] = f"{kw['disk_path']}-{tag}"
                    if tag == "k":
                        keyops.append(keyop_rates(name, StoreConfig(**fresh), args.keys))
                    else:
                        fill += fill_curve(name, StoreConfig(**fresh), args.fill, marks)
    if rows:
        print("get: the disk's files evicted from the page cache first (posix_fadvise "
              "DONTNEED; the memory tier, where there is one, serves without them); get_warm: "
              "again, files cached; read_into: the connector's path (parallel decode, each "
              "block copied into a paged cache), warm")
        print(table(rows, ["tier", "put_gbps", "get_gbps", "get_warm_gbps", "read_into_gbps",
                           "put_blob_gbps", "get_blob_gbps", "ratio"]))
    print(table(keyops, ["tier", "keys", "link_many_keys_per_s", "pin_many_keys_per_s",
                         "unpin_many_keys_per_s", "delete_many_keys_per_s"]))
    print(table(fill, ["tier", "blobs", "put_p50_ms", "put_p99_ms"]))
    write_json(args.json, {"blocks": len(blocks),
                           "block_shape": list(blocks[0].shape) if blocks else None,
                           "dtype": str(blocks[0].dtype) if blocks else None,
                           "machine": machine(), "load_average": load_average(),
                           "bandwidth": bandwidth(), "rows": rows, "keyops": keyops,
                           "fill": fill,
                           "note": "GB/s of raw tensor bytes; put includes encode, get decode "
                                   "(get: a cold page cache for tiers with a disk, get_warm: "
                                   "cached; read_into: the connector's restore path); key ops "
                                   "in keys/s of one batch call; fill: put latency as the "
                                   "tier grows"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
