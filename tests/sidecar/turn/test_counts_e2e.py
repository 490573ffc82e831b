"""Token counts with the served model's tokenizer, and the values of the sidecar's metrics,
against a real ``vllm serve`` (tiny model) over real HTTP."""

from __future__ import annotations

import json

import httpx
import pytest
from sidecar_helpers import chat, metric_value, runtime, wait_idle

from cwm_plugin.memory.tokens import HFTokenCounter, VLLMCounter

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "system", "content": "You are a terse travel assistant."},
            {"role": "user", "content": "Which pass does the Bernina Express cross?"},
            {"role": "assistant", "content": "The Bernina pass, at 2253 metres."},
            {"role": "user", "content": "And how long does the whole trip take? ✓"}]


def test_counts_match_the_prompt_tokens_vllm_reports(tiny_vllm, tiny_model):
    direct = tiny_vllm.chat(MESSAGES, max_tokens=1, cache_salt="count-test")
    want = direct["usage"]["prompt_tokens"]
    remote = VLLMCounter(tiny_vllm.base_url, "tiny")
    local = HFTokenCounter(tiny_model)
    try:
        assert remote.count_chat(MESSAGES) == want
        assert local.count_chat(MESSAGES) == want  # the folder's chat template, offline
        text = "Zermatt to St. Moritz: eight hours, 291 bridges and 91 tunnels."
        comp = httpx.post(f"{tiny_vllm.base_url}/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": text, "max_tokens": 1}).json()
        assert remote.count(text) == local.count(text) == comp["usage"]["prompt_tokens"]
        calls: list[str] = []
        real = remote._count
        remote._count = lambda t: calls.append(t) or real(t)
        assert remote.count(text) == comp["usage"]["prompt_tokens"] and calls == []  # cached
        assert remote.count(text + " Again.") > 0 and calls == [text + " Again."]
    finally:
        remote.close()


@pytest.mark.parametrize("spec", ["vllm", "auto"])
def test_the_sidecar_counts_with_the_served_model(recorder, sidecar_factory, tiny_model,
                                                  spec):
    _, rec_srv = recorder
    srv = sidecar_factory(rec_srv.url, memory={"tokenizer": spec})
    r = chat(srv, "acme", MESSAGES, session=f"count-{spec}", debug=True)
    assert r.status_code == 200, r.text
    info = json.loads(r.headers["X-CWM-Memory"])
    assert info["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    (counter,) = runtime(srv).counters._counters.values()  # one model, one upstream
    # auto: vLLM's /v1/models names the model folder, which is on this machine
    assert counter.name == ("vllm:tiny" if spec == "vllm" else f"hf:{tiny_model.name}")


def test_metric_values_follow_what_was_sent(recorder, sidecar_factory, tiny_model):
    rec, rec_srv = recorder
    srv = sidecar_factory(rec_srv.url)
    svc = runtime(srv).memory.service
    svc.record_turn("acme", "mv", "user", "My bike is a red Cinelli with a steel frame.")
    svc.record_turn("acme", "mv", "assistant", "Nice: a red steel Cinelli.")
    for i in range(20):  # enough history that replaying it costs more than the memory
        svc.record_turn("acme", "mv", "user", f"Day {i}: we rode along the lake to village {i}.")
        svc.record_turn("acme", "mv", "assistant", f"Noted day {i}, a lovely lakeside ride.")
    svc.add_memory("acme", "The user rides a red Cinelli bicycle.", "fact", 0.8)
    counter = HFTokenCounter(tiny_model)
    turns = svc.transcript("acme", "mv")
    msgs = [MESSAGES[0], {"role": "user", "content": "What colour is my bike?"}]
    # the token-saving mode (memory and recent turns from the session instead of a replay)
    r = chat(srv, "acme", msgs, session="mv", max_tokens=5, headers={"X-CWM-History": "recent"})
    assert r.status_code == 200, r.text
    wait_idle(srv)
    usage = r.json()["usage"]
    sent = rec.last()["messages"]
    assert sent[0]["content"].startswith(MESSAGES[0]["content"] + "\n\n")
    memory_msg = {"content": sent[0]["content"][len(MESSAGES[0]["content"]) + 2:]}
    assert memory_msg["content"].startswith("Relevant memory") and \
        "Cinelli" in memory_msg["content"]

    def value(name: str) -> float:
        return metric_value(srv, name, tenant="acme", model="tiny")

    assert value("cwm_sidecar_prompt_tokens_total") == usage["prompt_tokens"]
    assert value("cwm_sidecar_completion_tokens_total") == usage["completion_tokens"] == 5
    assert value("cwm_sidecar_injected_tokens_total") == counter.count(memory_msg["content"])
    history = counter.count_messages([{"role": t["role"], "content": t["content"]}
                                      for t in turns])
    full = counter.count_messages(msgs) + history
    assert full > counter.count_messages(sent)
    assert value("cwm_sidecar_saved_tokens_total") == full - counter.count_messages(sent)
    assert value("cwm_sidecar_requests_total") == 1
    assert value("cwm_sidecar_context_warnings_total") == 0
    # the memory package's own metrics are on the sidecar's /metrics too
    assert metric_value(srv, "cwm_memory_retrieval_seconds_count", mode="hybrid") >= 1
    assert metric_value(srv, "cwm_memory_retrieval_seconds_count", mode="memories-hybrid") >= 1
    assert metric_value(srv, "cwm_memory_chunks_indexed_total") >= 1
    assert metric_value(srv, "cwm_memory_embedding_cache_total", result="miss") >= 1
