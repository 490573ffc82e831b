"""Context windows in the configuration users run: memory on with its background work (a
summary and a fact extraction after every turn), windows configured, a real ``vllm serve``
with the cwm connector behind a real ``cwm serve``, the ``openai`` SDK as the client.

Five turns, the background work done after the last of them, freeze: the window holds the
conversation (its tokens are the last client prompt's and answer's), not a background prompt.
Both servers restart; the window thaws into a new session; the next turn -- its prompt
assembled with the memory the frozen conversation had -- restores at least 90 % of the
window's tokens from the store and answers exactly what a cold run of the same prompt does.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from sidecar_helpers import KEYS, make_settings, metric_value, runtime, wait_idle

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.e2e
HITS = "vllm:external_prefix_cache_hits"
FACTS = ["The user's sister Anna lives in Chur and keeps bees.",
         "The user plans a hiking trip over the Albula pass in August.",
         "The user prefers trains to cars and travels with a folding bike."]




def default_sidecar(url: str, root: Path, tiny_model: Path, store_dir: Path,
                    **over) -> ServerThread:
    """Memory as shipped (the local embedder, summaries and facts on, here due every turn),
    windows on the store vLLM's connector writes."""
    settings = make_settings(url, root, tiny_model, windows={
        "store": {"disk_path": str(store_dir)}, "wait_s": 30},
        memory={"embedder": {"kind": "local"}, "summary_every_turns": 1,
                "extract_facts": True, "facts_every_turns": 1, "budget_tokens": 300}, **over)
    srv = ServerThread(create_app(settings)).start()
    for fact in FACTS:
        runtime(srv).memory.service.add_memory("acme", fact, "fact", 0.9)
    return srv


def words(n: int, seed: int) -> str:
    vocab = ["river", "mountain", "coffee", "letter", "garden", "window", "bees", "train",
             "pass", "August", "sister", "bike"]
    return " ".join(vocab[(i * 7 + seed) % len(vocab)] for i in range(n))


def turn(client, session: str, messages: list[dict]) -> tuple[dict, object]:
    """One chat turn; the answer message as the client keeps it, and the raw completion."""
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0.0,
        extra_headers={"X-Session-Id": session}, extra_body={"return_token_ids": True})
    msg = r.choices[0].message
    return {"role": "assistant", "content": msg.content}, r


def test_a_window_frozen_with_memory_and_background_work_on_thaws_with_its_hits(
        kv_vllm, store_dir, tiny_model, tmp_path):
    from openai import OpenAI

    root = tmp_path / "memory"
    srv = default_sidecar(kv_vllm.base_url, root, tiny_model, store_dir)
    acme = OpenAI(base_url=f"{srv.url}/v1", api_key=KEYS["acme"], max_retries=0)
    history = [{"role": "system", "content": "You are a helpful travel assistant."}]
    for i in range(5):
        history.append({"role": "user", "content": f"About my trip, note {i}: "
                                                   f"{words(110, i)}"})
        answer, last = turn(acme, "alice", history)
        history.append(answer)
        wait_idle(srv)       # the summary and the fact extraction of this turn ran
    summaries = metric_value(srv, "cwm_sidecar_background_tasks_total", kind="summary")
    facts = metric_value(srv, "cwm_sidecar_background_tasks_total", kind="facts")
    assert summaries >= 5 and facts >= 5, "the background work ran after every turn"
    api = httpx.Client(base_url=srv.url, timeout=300,
                       headers={"Authorization": f"Bearer {KEYS['acme']}"})
    r = api.post("/v1/windows", json={"name": "trip", "session": "alice"})
    assert r.status_code == 200, r.text
    frozen = r.json()
    assert frozen["turn"] == 5 and frozen["messages"] == len(history)
    assert frozen["memory_merged"], "the window carries the memory merged into its prompt"
    m = runtime(srv).windows.get("acme", "trip")
    prompt_ids = list(last.prompt_token_ids)
    # the conversation's last client prompt and its answer, not the background's prompt
    assert m.tokens[:len(prompt_ids)] == prompt_ids
    assert m.tokens[len(prompt_ids):] == list(last.choices[0].token_ids)
    assert m.prompt["pinned"]["memory_block"]     # memory was merged into this conversation

    srv.stop()                                   # restart both
    kv_vllm.restart()
    srv = default_sidecar(kv_vllm.base_url, root, tiny_model, store_dir)
    api = httpx.Client(base_url=srv.url, timeout=300,
                       headers={"Authorization": f"Bearer {KEYS['acme']}"})
    acme = OpenAI(base_url=f"{srv.url}/v1", api_key=KEYS["acme"], max_retries=0)
    thawed = api.post("/v1/windows/trip/thaw", json={"session": "bob"})
    assert thawed.status_code == 200, thawed.text
    t = thawed.json()
    assert t["messages"] == history and t["blocks_found"] == t["blocks_expected"]
    nxt = [*t["messages"], {"role": "user", "content": "And what should I pack?"}]
    before = kv_vllm.metric(HITS)
    _, reply = turn(acme, "bob", nxt)
    hits = kv_vllm.metric(HITS) - before
    # every full block of the window's tokens (a partial last block is never stored)
    assert hits >= 128 * (len(m.tokens) // 128), (hits, len(m.tokens))
    # the same prompt recomputed cold (a fresh salt, straight to vLLM): identical tokens
    cold = kv_vllm.post("/v1/completions", {
        "model": "tiny", "prompt": list(reply.prompt_token_ids), "max_tokens": 8,
        "temperature": 0.0, "cache_salt": "cold-recompute", "return_token_ids": True})
    assert cold["choices"][0]["token_ids"] == list(reply.choices[0].token_ids)
    # the thawed session froze again at once: the same conversation
    again = api.post("/v1/windows", json={"name": "trip-2", "session": "bob"}).json()
    assert again["turn"] == 6 and again["messages"] == len(nxt) + 1
    srv.stop()
