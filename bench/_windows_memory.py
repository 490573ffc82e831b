"""Windows in the default configuration, measured: a thaw into a new session with memory on,
and portable export/import (used by ``bench/windows.py``).

* **thaw with memory on**: ``cwm serve`` (memory as shipped: the local embedder, summaries and
  fact extraction due every turn, durable facts in memory, a ``windows`` store) in front of
  the same vLLM. A conversation of several turns reaching about ``--tokens`` tokens is frozen
  through REST after its background work ran; each sample thaws it into a new session, resets
  vLLM's own prefix cache, and streams the next turn through the sidecar (the ``openai`` SDK):
  ``memory_thaw_ttft_s``, and ``memory_thaw_hit_fraction`` = vLLM's external hits / the
  window's tokens (the target: >= 0.9). Against the exact prompt of that turn sent to
  vLLM under a fresh salt (``memory_recompute_ttft_s``) and again under the thawed salt once
  loaded (``memory_prefix_cache_ttft_s``: the floor). The answer must equal the recompute's.
* **export/import**: the window written to a file (``export_s``, ``export_bytes_per_1k``
  tokens) and imported into a fresh store (``import_s``), median of the samples.
"""

from __future__ import annotations

import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from ttft import HITS

from cwm_plugin.connector import records
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.identity.authenticator import Identity, hash_key
from cwm_plugin.sidecar.settings import Settings
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.testing.conversations.prompts import conversation_lines
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.windows.engine import WindowEngine
from cwm_plugin.windows.portable import export_window, import_window

KEY = "bench-key"
FACTS = ["Caroline is researching adoption agencies.", "Melanie paints and runs.",
         "Caroline went to an LGBTQ support group on 7 May 2023."]


def _sidecar(server: Any, store_cfg: dict, root: Path) -> ServerThread:
    settings = Settings.model_validate({
        "secret": "bench-secret-0123456789", "tenants": [{"name": "bench",
                                                          "key_sha256": [hash_key(KEY)]}],
        "upstream": {"url": server.base_url, "read_timeout_s": 1800},
        "memory": {"root": str(root), "summary_every_turns": 1, "extract_facts": True,
                   "facts_every_turns": 1},
        "windows": {"store": store_cfg, "wait_s": 60}})
    srv = ServerThread(create_app(settings)).start()
    for fact in FACTS:
        srv.app.state.sidecar.memory.service.add_memory("bench", fact, "fact", 0.9)
    return srv


def _idle(srv: ServerThread, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while srv.app.state.sidecar.background.pending and time.monotonic() < deadline:
        time.sleep(0.1)


def _turns(tokenizer, tokens: int, turns: int) -> list[str]:
    """``turns`` user messages of conversation text, about ``tokens`` tokens in all."""
    per, out, cur, used = tokens // turns, [], [], 0
    for line in conversation_lines():
        cost = len(tokenizer.encode(line, add_special_tokens=False))
        cur.append(line)
        used += cost
        if used >= per:
            out.append("\n".join(cur))
            cur, used = [], 0
            if len(out) == turns:
                return out
    raise RuntimeError("not enough conversation text")


def _stream(client, session: str, messages: list[dict]) -> tuple[float, list[int], list[int]]:
    """Seconds to the first token through the sidecar, the answer's and the prompt's ids."""
    t0 = time.perf_counter()
    ttft, ids, prompt = None, [], []
    for chunk in client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=8, temperature=0.0, stream=True,
            extra_headers={"X-Session-Id": session}, extra_body={"return_token_ids": True}):
        extra = chunk.model_extra or {}
        prompt = extra.get("prompt_token_ids") or prompt
        for choice in chunk.choices:
            toks = (choice.model_extra or {}).get("token_ids") or []
            if toks and ttft is None:
                ttft = time.perf_counter() - t0
            ids.extend(toks)
    return ttft or time.perf_counter() - t0, ids, list(prompt)


def _direct(server: Any, prompt: list[int], salt: str) -> tuple[float, list[int]]:
    """The same prompt's token ids straight to vLLM, streamed: (ttft, answer ids)."""
    import json

    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "stream": True, "return_token_ids": True, "cache_salt": salt}
    t0, ttft, ids = time.perf_counter(), None, []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      timeout=1800) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    toks = choice.get("token_ids") or []
                    if toks and ttft is None:
                        ttft = time.perf_counter() - t0
                    ids.extend(toks)
    return ttft or time.perf_counter() - t0, ids


def measure(server: Any, store_cfg: dict, tokenizer, tokens: int, samples: int,
            work: Path) -> dict[str, Any]:
    from openai import OpenAI

    srv = _sidecar(server, store_cfg, work / "memory")
    client = OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=1800)
    api = httpx.Client(base_url=srv.url, timeout=1800,
                       headers={"Authorization": f"Bearer {KEY}"})
    history: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
    try:
        for text in _turns(tokenizer, tokens, 4):
            history.append({"role": "user", "content": text})
            r = client.chat.completions.create(model="smollm2", messages=history,
                                               max_tokens=8, temperature=0.0,
                                               extra_headers={"X-Session-Id": "talk"})
            history.append({"role": "assistant", "content": r.choices[0].message.content})
            _idle(srv)
        frozen = api.post("/v1/windows", json={"name": "conv", "session": "talk"})
        frozen.raise_for_status()
        window_tokens = frozen.json()["tokens"]
        got: dict[str, list[float]] = {k: [] for k in (
            "memory_thaw_ttft_s", "memory_thaw_hit_fraction", "memory_recompute_ttft_s",
            "memory_prefix_cache_ttft_s")}
        for i in range(samples):
            _idle(srv)  # the last sample's summary and facts ran: the batch is ours alone
            t = api.post("/v1/windows/conv/thaw", json={"session": f"new-{i}"}).json()
            server.reset_prefix_cache()
            nxt = [*t["messages"], {"role": "user", "content": "What did we decide?"}]
            hits0 = server.metric(HITS)
            ttft, ids, prompt = _stream(client, f"new-{i}", nxt)
            got["memory_thaw_hit_fraction"].append((server.metric(HITS) - hits0)
                                                   / window_tokens)
            got["memory_thaw_ttft_s"].append(ttft)
            _idle(srv)  # (a batch shared with background work computes other bf16 sums)
            cold, cold_ids = _direct(server, prompt, f"fresh-{i}-{time.time_ns()}")
            if cold_ids != ids:
                raise SystemExit(f"thaw sample {i}: the answer differs from a recompute")
            got["memory_recompute_ttft_s"].append(cold)
            salt = srv.app.state.sidecar.auth.session_salt(
                Identity(tenant="bench", session=None, cache_salt=""), f"new-{i}")
            got["memory_prefix_cache_ttft_s"].append(_direct(server, prompt, salt)[0])
        out: dict[str, Any] = {k: statistics.median(v) for k, v in got.items()}
        out["memory_window_tokens"] = window_tokens
        out["memory_raw_samples"] = got
        out.update(_portable(srv.app.state.sidecar.windows, store_cfg, window_tokens,
                             samples, work))
        return out
    finally:
        srv.stop()


def _portable(eng: WindowEngine, store_cfg: dict, tokens: int, samples: int,
              work: Path) -> dict[str, Any]:
    times: dict[str, list[float]] = {"export_s": [], "import_s": []}
    size = 0
    for _ in range(samples):
        buf = io.BytesIO()
        t0 = time.perf_counter()
        size = export_window(eng, "bench", "conv", buf)["bytes"]
        times["export_s"].append(time.perf_counter() - t0)
        fresh = KVStore(StoreConfig(disk_path=tempfile.mkdtemp(dir=work), memory_bytes=0),
                        registry=CollectorRegistry())
        for infos in eng.store.list_keys(records.SERVED_PREFIX).values():
            for info in infos:  # the fresh store's vLLM would serve the same model
                fresh.put_blob(info.key, eng.store.get_blob(info.key), replace=True).result()
        buf.seek(0)
        t0 = time.perf_counter()
        import_window(WindowEngine(fresh), "bench", buf)
        times["import_s"].append(time.perf_counter() - t0)
        fresh.close()
    return {**{k: statistics.median(v) for k, v in times.items()},
            "export_bytes": size, "export_bytes_per_1k_tokens": size * 1000 / tokens}
