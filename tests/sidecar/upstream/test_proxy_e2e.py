"""The sidecar in front of a real ``vllm serve`` (tiny random-weight model), over real HTTP.

One vLLM for the module; the sidecar reaches it through a recording relay so that each test can
read the exact body vLLM received.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from sidecar_helpers import ADMIN, KEYS, chat, metric_value, runtime, salt, sse_events, wait_idle

pytestmark = pytest.mark.e2e

LONG_SYSTEM = ("You are the travel desk assistant of the Alpine Rail company. Answer briefly. "
               "Rules: never invent timetables; prefer scenic routes; mention luggage limits. ") * 12


def _norm(events):
    """Stream events without the per-request fields (id, created)."""
    out = []
    for e in events:
        if isinstance(e, dict):
            e = {k: v for k, v in e.items() if k not in ("id", "created")}
        out.append(e)
    return out


def test_non_streaming_chat_answers_and_records_the_turn(sidecar):
    r = chat(sidecar, "acme", "Hello there, I am planning a trip to Zermatt.", session="ns")
    assert r.status_code == 200, r.text
    data = r.json()
    answer = data["choices"][0]["message"]["content"]
    assert data["usage"]["prompt_tokens"] > 0
    turns = runtime(sidecar).memory.service.transcript("acme", "ns")
    assert [t["role"] for t in turns] == ["user", "assistant"]
    assert "Zermatt" in turns[0]["content"] and turns[1]["content"] == answer


def test_streaming_is_relayed_intact(sidecar, recorder, tiny_vllm):
    rec, _ = recorder
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about the glacier express."}]
    r = chat(sidecar, "acme", messages, session="stream1", stream=True, max_tokens=12)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    via_sidecar = sse_events(r.text)
    forwarded = rec.last()
    assert forwarded["cache_salt"] == salt("acme", "stream1")
    # The same greedy request straight to vLLM, as the client asked for it (no usage event).
    direct_body = {k: v for k, v in forwarded.items() if k != "stream_options"}
    direct = httpx.post(f"{tiny_vllm.base_url}/v1/chat/completions", json=direct_body,
                        timeout=300.0)
    direct_events = sse_events(direct.text)
    assert via_sidecar[-1] == "[DONE]" and len(via_sidecar) > 3
    assert _norm(via_sidecar) == _norm(direct_events)
    text = "".join((e["choices"][0]["delta"].get("content") or "") for e in via_sidecar[:-1]
                   if e["choices"])
    turns = runtime(sidecar).memory.service.transcript("acme", "stream1")
    assert turns[-1]["role"] == "assistant" and turns[-1]["content"] == text
    # A client that asks for usage gets vLLM's usage event.
    r = chat(sidecar, "acme", messages, session="stream1", stream=True, max_tokens=4,
             stream_options={"include_usage": True})
    assert sse_events(r.text)[-2]["usage"]["completion_tokens"] == 4


def test_memory_is_merged_into_the_system_message(sidecar, recorder, tiny_vllm):
    rec, _ = recorder
    sc = runtime(sidecar)
    sc.memory.service.add_memory("acme", "The user's favourite colour is teal.", "preference",
                                 0.9)
    chat(sidecar, "acme", "Remember: my cat is called Biscuit and she is orange.",
         session="mem1")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is my cat called, and my favourite colour?"}]
    r = chat(sidecar, "acme", messages, session="mem2", debug=True)
    assert r.status_code == 200, r.text
    body = rec.last()
    # merged into the client's system message, after its text; nothing else changed
    injected = body["messages"][0]
    assert injected["role"] == "system" and injected["content"].startswith("Be brief.\n\n")
    assert "Biscuit" in injected["content"] and "teal" in injected["content"]
    assert body["messages"][1:] == messages[1:]
    debug = json.loads(r.headers["X-CWM-Memory"])
    assert debug["tokens"] > 0 and debug["mode"] == "full/system/conversation"
    # vLLM really saw the longer prompt: compare with the client's messages sent directly.
    plain = tiny_vllm.chat(messages, max_tokens=1, cache_salt="plain")
    assert r.json()["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 5


def test_tenant_b_never_sees_tenant_a_memory(sidecar, recorder):
    rec, _ = recorder
    chat(sidecar, "acme", "My locker code is ZEBRA-4417, keep it safe.", session="iso")
    r = chat(sidecar, "beta", "What is my locker code ZEBRA?", session="iso", debug=True)
    assert r.status_code == 200
    body = rec.last()
    assert body["cache_salt"] == salt("beta", "iso") != salt("acme", "iso")
    assert "ZEBRA-4417" not in json.dumps(body["messages"])
    hits = runtime(sidecar).memory.service.search("beta", "locker code ZEBRA-4417", k=20)
    assert all("4417" not in getattr(h, "text", str(h)) for h in hits)


def test_bad_requests_get_openai_errors_and_lose_no_memory(sidecar):
    svc = runtime(sidecar).memory.service
    assert chat(sidecar, "acme", "Keep this line: the ferry leaves at nine.",
                session="keep").status_code == 200
    before = svc.transcript("acme", "keep")
    url = f"{sidecar.url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {KEYS['acme']}", "X-Session-Id": "keep"}
    cases = [
        (httpx.post(url, content=b'{"model": "tiny", "messages": [', headers=auth), 400),
        (httpx.post(url, content=b"x" * (300 * 1024), headers=auth), 413),
        (chat(sidecar, "acme", "hi", session="keep", model="no-such-model"), 404),
        (httpx.post(url, json={"model": "tiny", "messages": []}, headers=auth), 400),
        (httpx.post(url, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                    headers={"Authorization": "Bearer wrong"}), 401),
        (chat(sidecar, "acme", "hi", session="keep", cache_salt="mine"), 403),
        (chat(sidecar, "acme", "hi", session="../../etc"), 400),
    ]
    for resp, status in cases:
        assert resp.status_code == status, (status, resp.text)
        err = resp.json()["error"]
        assert err["message"] and err["type"] and err["code"]
    # The upstream's own refusal (max_tokens far beyond the context) comes back OpenAI-shaped.
    r = chat(sidecar, "acme", "hi", session="keep", max_tokens=10**6)
    assert r.status_code == 400 and "error" in r.json()
    assert svc.transcript("acme", "keep") == before
    # A tenant allowed to set cache_salt may.
    assert chat(sidecar, "gamma", "hi", session="g", cache_salt="client-salt").status_code == 200


def test_upstream_down_is_a_quick_502_and_memory_survives(sidecar_factory, tmp_path):
    from cwm_plugin.testing.procs import free_port

    dead = sidecar_factory(f"http://127.0.0.1:{free_port()}", root=tmp_path)
    svc = runtime(dead).memory.service
    svc.record_turn("acme", "down", "user", "written before the outage")
    for stream in (False, True):
        r = chat(dead, "acme", "are you there?", session="down", stream=stream)
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "upstream_error"
    assert [t["content"] for t in svc.transcript("acme", "down")] == ["written before the outage"]
    health = httpx.get(f"{dead.url}/health", timeout=30, headers=ADMIN)
    assert health.status_code == 503 and health.json()["upstream"]["ok"] is False


def test_completions_models_health_and_metrics(sidecar, recorder):
    rec, _ = recorder
    auth = {"Authorization": f"Bearer {KEYS['beta']}", "X-Session-Id": "comp"}
    r = httpx.post(f"{sidecar.url}/v1/completions", headers=auth, timeout=300,
                   json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4,
                         "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    assert rec.last("/v1/completions")["cache_salt"] == salt("beta", "comp")
    usage = httpx.get(f"{sidecar.url}/v1/usage", headers=auth, timeout=30).json()["total"]
    r = httpx.post(f"{sidecar.url}/v1/completions", headers=auth, timeout=300,
                   json={"model": "tiny", "prompt": "Once", "max_tokens": 3, "stream": True,
                         "ignore_eos": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])  # as asked
    assert rec.last("/v1/completions")["stream_options"] == {"include_usage": True}
    r = httpx.post(f"{sidecar.url}/v1/completions", headers=auth, timeout=300,
                   json={"model": "tiny", "prompt": "Once", "max_tokens": 3, "stream": True,
                         "ignore_eos": True, "stream_options": {"include_usage": True}})
    told = [e["usage"] for e in sse_events(r.text)[:-1] if e.get("usage")]
    assert len(told) == 1 and told[0]["completion_tokens"] == 3
    after = httpx.get(f"{sidecar.url}/v1/usage", headers=auth, timeout=30).json()["total"]
    assert after["requests"] - usage["requests"] == 2  # streamed completions are accounted
    assert after["completion_tokens"] - usage["completion_tokens"] == 6
    models = httpx.get(f"{sidecar.url}/v1/models", headers=auth, timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert httpx.get(f"{sidecar.url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{sidecar.url}/health", timeout=30).json()["status"] == "ok"
    assert httpx.get(f"{sidecar.url}/metrics", timeout=30).status_code == 401
    text = httpx.get(f"{sidecar.url}/metrics", timeout=30, headers=ADMIN).text
    for name in ("cwm_sidecar_requests_total", "cwm_sidecar_prompt_tokens_total",
                 "cwm_sidecar_injected_tokens_total", "cwm_sidecar_saved_tokens_total",
                 "cwm_sidecar_retrieval_seconds_bucket", "cwm_upstream_prefix_cache_queries"):
        assert name in text, name
    assert 'tenant="acme"' in text and KEYS["acme"] not in text


def test_context_warning_then_checkpoint_compacts_and_calls_the_hook(recorder, sidecar_factory):
    rec, rec_srv = recorder
    thresholds = {"default": {"warn": 0.05, "checkpoint": 0.15, "keep_turns": 2}}
    srv = sidecar_factory(rec_srv.url, checkpoint=thresholds)
    snaps = []

    async def hook(tenant, session, cache_salt, name):
        snaps.append((tenant, session, cache_salt, name))

    runtime(srv).snapshot_hook = hook
    history = [{"role": "system", "content": "Be brief."}]
    line = "We discussed the route from Chur to Tirano over the Bernina pass in winter. "
    warned = None
    max_len = 2048
    over: list[float] = []  # the turns vLLM saw at or above the warn threshold

    def used(r) -> None:  # the header tells this turn's prompt, not an older one
        header = r.headers.get("X-CWM-Context-Warning")
        real = r.json()["usage"]["prompt_tokens"] / max_len
        if header:
            assert float(header.split("used=")[1]) == pytest.approx(real, abs=0.006)
        else:
            assert real < 0.05
        if real >= 0.05:
            over.append(real)

    for i in range(6):
        history.append({"role": "user", "content": f"({i}) " + line * 4})
        r = chat(srv, "acme", history, session="cp")
        assert r.status_code == 200, r.text
        used(r)
        warned = warned or r.headers.get("X-CWM-Context-Warning")
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]
                         ["content"]})
        wait_idle(srv)
        if snaps:
            break
    assert warned and warned.split(";")[0] in ("warn", "checkpoint")
    assert snaps and snaps[0][:3] == ("acme", "cp", salt("acme", "cp"))
    assert runtime(srv).memory.service.summary("acme", "cp")
    assert metric_value(srv, "cwm_sidecar_checkpoints_total", tenant="acme") == 1
    levels = {lv: metric_value(srv, "cwm_sidecar_context_warnings_total", tenant="acme",
                               level=lv) for lv in ("warn", "checkpoint")}
    assert levels["checkpoint"] == 1 and sum(levels.values()) == len(over)
    # The next turn is compacted: the system message with the summary and memory merged in,
    # the last 2 exchanges (user and assistant messages), the new message; and the turn after
    # it keeps that prefix (the cut and the summary stay fixed until the next compaction).
    history.append({"role": "user", "content": "And in summer?"})
    r = chat(srv, "acme", history, session="cp")
    assert r.status_code == 200
    used(r)
    mine = lambda body: body["messages"][-1] == history[-1]    # noqa: E731 - not a summary's
    sent = rec.last(where=mine)["messages"]
    assert sent[0]["content"].startswith(history[0]["content"])
    assert "Summary of this conversation" in sent[0]["content"]
    assert sent[1:] == history[-5:]
    history += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And in autumn?"}]
    wait_idle(srv)
    state = runtime(srv).tracker.get("acme", "cp")
    checkpoints = metric_value(srv, "cwm_sidecar_checkpoints_total", tenant="acme")
    assert chat(srv, "acme", history, session="cp").status_code == 200
    again = rec.last(where=mine)["messages"]
    if checkpoints == 1:  # under the threshold since: the same prefix, grown at its end
        assert again[:len(sent)] == sent and again[len(sent):] == history[-2:]
    else:  # (these thresholds are tiny: the compacted prompt was over one again)
        assert state.compaction.generation == 2 and again[1:] == history[-5:]


def _conversation_hit_rate(send, tiny_vllm) -> tuple[float, list[list[dict]]]:
    """Run the same 5-turn conversation (the client replays its history each turn) through
    ``send(history) -> (answer, messages vLLM got)``; vLLM's prefix-cache hit rate over it."""
    questions = ["Which pass does the Bernina line cross?", "How much luggage may I bring?",
                 "Is the Glacier Express scenic in winter?", "Where do I change for Tirano?",
                 "Can I bring my bicycle on board?"]
    history = [{"role": "system", "content": LONG_SYSTEM}]
    hits0 = tiny_vllm.metric("vllm:prefix_cache_hits")
    queries0 = tiny_vllm.metric("vllm:prefix_cache_queries")
    prompts = []
    for q in questions:
        history.append({"role": "user", "content": q})
        answer, sent = send(history)
        prompts.append(sent)
        history.append({"role": "assistant", "content": answer})
    hits = tiny_vllm.metric("vllm:prefix_cache_hits") - hits0
    queries = tiny_vllm.metric("vllm:prefix_cache_queries") - queries0
    return hits / queries, prompts


def test_with_memory_every_turn_the_prefix_cache_hits_like_a_direct_client(
        recorder, sidecar_factory, tiny_vllm, record_property):
    rec, rec_srv = recorder
    facts = ["The Bernina Express crosses the Bernina pass at 2253 metres.",
             "Luggage: two suitcases and one hand bag per passenger.",
             "The Glacier Express runs all year; winter views are famous.",
             "Change at Pontresina or Poschiavo for services to Tirano.",
             "Bicycles need a reservation on panorama trains.",
             "The user prefers window seats facing forward."]
    srv = sidecar_factory(rec_srv.url)
    for f in facts:
        runtime(srv).memory.service.add_memory("acme", f, "fact", 0.8)
    # A fresh session (so a fresh salt) each run: a reused vLLM may hold older runs' KV.
    session = f"pc-{uuid.uuid4().hex[:8]}"

    def via_sidecar(history):
        r = chat(srv, "acme", history, session=session, max_tokens=6)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], rec.last()["messages"]

    direct_salt = f"direct-{uuid.uuid4().hex[:8]}"

    def direct(history):
        out = tiny_vllm.chat(history, max_tokens=6, temperature=0.0, cache_salt=direct_salt)
        return out["choices"][0]["message"]["content"], history

    hits0 = tiny_vllm.metric("vllm:prefix_cache_hits")
    rate, prompts = _conversation_hit_rate(via_sidecar, tiny_vllm)
    # The sidecar's own per-tenant count (from usage.prompt_tokens_details) agrees.
    assert metric_value(srv, "cwm_sidecar_cached_prompt_tokens_total", tenant="acme") == \
        tiny_vllm.metric("vllm:prefix_cache_hits") - hits0
    direct_rate, _ = _conversation_hit_rate(direct, tiny_vllm)
    record_property("prefix_hit_rates", {"sidecar": rate, "direct": direct_rate})
    print(f"\nprefix-cache hit rate over 5 turns: sidecar {rate:.3f}, direct {direct_rate:.3f}")
    # memory in every turn, the same text (one conversation), so each prompt extends the last
    assert all("Bernina pass at 2253" in p[0]["content"] for p in prompts)
    assert all(p[0] == prompts[0][0] for p in prompts)
    assert rate >= 0.9 * direct_rate


def test_invalid_facts_from_the_model_are_retried_once_then_refused(recorder, sidecar_factory):
    rec, rec_srv = recorder
    srv = sidecar_factory(rec_srv.url, memory={"extract_facts": True, "summary_every_turns": 1,
                                               "structured_facts": False,
                                               "facts_every_turns": 2})  # after each turn
    n_before = len(rec.bodies)
    r = chat(srv, "acme", "I am allergic to peanuts and I live in Basel.", session="facts")
    assert r.status_code == 200
    wait_idle(srv)
    # The random model never writes valid JSON: two extraction calls, then a counted refusal.
    calls = rec.bodies[n_before:]
    assert len(calls) == 4  # the turn, the summary, the extraction and its one retry
    assert metric_value(srv, "cwm_sidecar_facts_refused_total", tenant="acme") == 1
    assert metric_value(srv, "cwm_sidecar_background_tasks_total", tenant="acme",
                        kind="summary", outcome="ok") == 1
    assert not runtime(srv).memory.service.memories("acme")
    assert len(runtime(srv).memory.service.transcript("acme", "facts")) == 2


def test_cwm_serve_runs_the_sidecar_from_a_config_file(tiny_vllm, tiny_model, tmp_path):
    """`cwm serve --config FILE --upstream URL` in its own process, secret from the env."""

    import yaml

    from cwm_plugin.sidecar.identity.authenticator import Authenticator, hash_key
    from cwm_plugin.testing.sidecar_process import SidecarProcess

    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump({
        "tenants": [{"name": "acme", "key_sha256": [hash_key(KEYS["acme"])]}],
        "memory": {"root": "mem", "tokenizer": str(tiny_model), "embedder": {"kind": "hashing"},
                   "extract_facts": False, "summary_every_turns": 0},
    }))
    secret = "serve-test-secret-0123456789"
    sidecar = SidecarProcess(config, tiny_vllm.base_url, tmp_path, secret, log_level="info")
    with sidecar:
        for user in ("u1", "alice.smith+tag@example.com"):  # any OpenAI `user`, no 400
            r = httpx.post(f"{sidecar.url}/v1/chat/completions", timeout=300,
                           headers={"Authorization": f"Bearer {KEYS['acme']}"},
                           json={"model": "tiny", "max_tokens": 4, "temperature": 0,
                                 "messages": [{"role": "user", "content": "hello"}],
                                 "user": user})
            assert r.status_code == 200, r.text
            session = Authenticator([], secret.encode()).user_session("acme", user)
            # the user's own namespace: its folder is the session name (access.py)
            assert (tmp_path / "mem" / session / "sessions" / f"{session}.md").exists()
    text = sidecar.log_path.read_text()
    assert KEYS["acme"] not in text and "serve-test-secret" not in text


def test_structured_outputs_make_even_the_random_model_answer_valid_facts(recorder,
                                                                          sidecar_factory):
    rec, rec_srv = recorder
    srv = sidecar_factory(rec_srv.url, memory={"extract_facts": True, "structured_facts": True,
                                               "facts_every_turns": 2})
    assert chat(srv, "acme", "I am allergic to peanuts.", session="sfacts").status_code == 200
    wait_idle(srv)
    assert rec.last()["response_format"]["type"] == "json_schema"
    outcomes = {o: metric_value(srv, "cwm_sidecar_background_tasks_total", tenant="acme",
                                kind="facts", outcome=o) for o in ("ok", "refused")}
    # Constrained decoding gives valid JSON unless the answer is cut off at max_tokens; either
    # way the extraction ends cleanly, and whatever was stored passed parse_facts.
    assert outcomes["ok"] + outcomes["refused"] == 1
    for m in runtime(srv).memory.service.memories("acme"):
        assert m.text and m.category in ("preference", "goal", "decision", "fact")
