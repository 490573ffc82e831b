"""The client side of ``bench/sidecar.py``: requests as a client sends them, and vLLM's
prefix-cache hit rate over a conversation sent directly and through sidecars."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import httpx
import yaml

from cwm_plugin.sidecar.metrics import upstream_counters
from cwm_plugin.testing.sidecar_process import SidecarProcess

KEY = "bench-key-" + secrets.token_hex(8)
SYSTEM = ("You are the assistant of a travel desk that remembers its customers' earlier "
          "conversations. Answer briefly and precisely; when the relevant memory does not say, "
          "say that you do not know rather than guessing. Keep names, dates and numbers exact.")


def post(client: httpx.Client, url: str, body: dict, session: str | None,
         extra: dict[str, str] | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "X-CWM-Debug": "1", **(extra or {})}
    if session:
        headers["X-Session-Id"] = session
    r = client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:300]}")
    return r


def replay(url: str, model: str, lines: list[str], session: str | None,
           salt: str | None = None, headers: dict[str, str] | None = None) -> dict:
    """One conversation, the client replaying its history each turn; what it cost."""
    history = [{"role": "system", "content": SYSTEM}]
    prompt = memory_turns = 0
    with httpx.Client(timeout=600) as client:
        for line in lines:
            history.append({"role": "user", "content": line})
            body = {"model": model, "messages": history, "max_tokens": 8, "temperature": 0.0,
                    **({"cache_salt": salt} if salt else {})}
            r = post(client, url, body, session, headers)
            history.append({"role": "assistant",
                            "content": r.json()["choices"][0]["message"]["content"] or ""})
            prompt += r.json()["usage"]["prompt_tokens"]
            debug = json.loads(r.headers.get("x-cwm-memory") or "{}")
            memory_turns += int(debug.get("tokens", 0) > 0)
    return {"turns": len(lines), "prompt_tokens": prompt, "memory_turns": memory_turns}


def hit_rate(upstream: str, run) -> dict:
    """``run()``'s result with vLLM's prefix-cache hits / queries over it."""
    before = upstream_counters(httpx.get(f"{upstream}/metrics", timeout=30).text)
    out = run()
    after = upstream_counters(httpx.get(f"{upstream}/metrics", timeout=30).text)
    hits, queries = (after.get(k, 0) - before.get(k, 0)
                     for k in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"))
    return {**out, "hit_rate": round(hits / queries, 4) if queries else None}


def with_sidecar(config: Path, upstream: str, work: Path, secret: str, prompt: dict,
                 memory: dict, fn):
    raw = yaml.safe_load(config.read_text())
    path = work / f"sidecar-{len(list(work.glob('sidecar-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({**raw, "prompt": prompt,
                                    "memory": {**raw["memory"], **memory}}))
    with SidecarProcess(path, upstream, work, secret) as sc:
        return fn(sc)


def prefix_runs(config: Path, upstream: str, work: Path, secret: str, model: str,
                lines: list[str], placements: list[dict], memory: dict | None = None) -> dict:
    """Direct, then through a sidecar for each placement, each in a fresh salt."""
    out = {"direct": hit_rate(upstream, lambda: replay(
        upstream, model, lines, None, salt=f"direct-{secrets.token_hex(4)}"))}
    for p in placements:
        name = f"{p['placement']}/{p['refresh']}"
        out[name] = with_sidecar(
            config, upstream, work, secret, p, memory or {}, lambda sc: hit_rate(
                upstream, lambda: replay(sc.url, model, lines, f"hit-{secrets.token_hex(4)}")))
    return out
