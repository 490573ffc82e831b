"""Failover between two upstreams serving one model, over real HTTP: on a 5xx or a dead
upstream (streamed or not), an answer resumed on the other upstream when its server dies
mid-stream, a timeout never retried elsewhere, and health checks that bring an upstream back.

Each upstream is a small real OpenAI-compatible server (``cwm_plugin.testing.fake_upstream``),
so where a request went is visible in what each one received.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sidecar_helpers import ADMIN, chat, make_settings, metric_value, runtime, sse_events

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.procs import wait_until
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
TOKENIZER = "tiktoken:cl100k_base"


def pair(tmp_path, interval: float = 0.0, affinity: str = "session", **upstream: Any):
    a, b = FakeUpstream(model="tiny"), FakeUpstream(model="tiny")
    sa, sb = ServerThread(a.app).start(), ServerThread(b.app).start()
    settings = make_settings(sa.url, tmp_path, TOKENIZER, memory_enabled=False,
                             upstreams=[{"name": "a", "url": sa.url, **upstream},
                                        {"name": "b", "url": sb.url, **upstream}],
                             routing={"health": {"interval_s": interval},
                                      "affinity": affinity})
    return a, b, sa, sb, ServerThread(create_app(settings)).start()


def health(srv: ServerThread) -> httpx.Response:
    return httpx.get(f"{srv.url}/health", timeout=30, headers=ADMIN)


def test_a_5xx_or_a_dead_upstream_fails_over_streamed_or_not(tmp_path):
    a, b, sa, sb, srv = pair(tmp_path)
    try:
        assert chat(srv, "acme", "one").headers["x-cwm-upstream"] == "a"
        a.chat_status = 500  # its engine died; /v1/models still answers
        r = chat(srv, "acme", "two")
        assert r.status_code == 200 and r.headers["x-cwm-upstream"] == "b"
        assert metric_value(srv, "cwm_sidecar_upstream_errors_total", upstream="a",
                            code="http_500") >= 1
        r = chat(srv, "acme", "three", stream=True)
        assert r.headers["x-cwm-upstream"] == "b" and sse_events(r.text)[-1] == "[DONE]"
        a.chat_status = 200
        sa.stop()  # now nothing listens there: connect errors
        r = chat(srv, "acme", "four", stream=True)
        assert r.status_code == 200 and r.headers["x-cwm-upstream"] == "b"
        assert [b_["messages"][-1]["content"] for b_ in b.bodies()] == ["two", "three", "four"]
        assert metric_value(srv, "cwm_sidecar_upstream_failovers_total", upstream="a",
                            to="b") >= 2
        h = health(srv)
        assert h.status_code == 200 and h.json()["status"] == "degraded"
        assert {u["name"]: u["up"] for u in h.json()["upstreams"]} == {"a": False, "b": True}
        assert metric_value(srv, "cwm_sidecar_upstream_up", upstream="a") == 0
        # both gone: a clear 502
        sb.stop()
        r = chat(srv, "acme", "five")
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
        assert "unreachable" in r.json()["error"]["message"]
        assert health(srv).status_code == 503
        # a is back on its port: the next check says so and it answers again
        sa = ServerThread(a.app, port=sa.port).start()
        assert health(srv).json()["upstream"]["ok"] is True
        assert chat(srv, "acme", "six").headers["x-cwm-upstream"] == "a"
        assert metric_value(srv, "cwm_sidecar_upstream_up", upstream="a") == 1
    finally:
        for s in (srv, sa, sb):
            s.stop()


def cut_after_two(srv: ServerThread, a: FakeUpstream) -> tuple[list[dict], list[int]]:
    """A streamed answer counted by ``continuous_usage_stats`` whose server ``a`` dies after
    two chunks: its events, and the completion tokens each usage said."""
    a.stream_cut_after = 2
    r = chat(srv, "acme", "tell me", stream=True, max_tokens=8,
             stream_options={"include_usage": True, "continuous_usage_stats": True})
    events = [e for e in sse_events(r.text) if isinstance(e, dict)]
    assert r.headers["x-cwm-upstream"] == "a" and not any("error" in e for e in events)
    return events, [e["usage"]["completion_tokens"] for e in events if e.get("usage")]


def test_a_resumed_answers_usage_counts_the_whole_answer(tmp_path):
    """A client counting tokens by ``continuous_usage_stats`` (as ``bench/serving.py`` does)
    sees the count go on across the resume, never back: the continuation's usage plus the
    tokens relayed before it, and the prompt as the first upstream counted it. Before, it saw
    the continuation's own count restart at 1 and counted "2 of 4 tokens"."""
    a, b, sa, sb, srv = pair(tmp_path, affinity="first")
    a.script = lambda body: {"content": "alpha beta gamma delta"}
    b.script = lambda body: {"content": "gamma delta"}
    try:
        events, counts = cut_after_two(srv, a)
        assert counts == sorted(counts) and counts[-1] == 4, counts
        prompts = {e["usage"]["prompt_tokens"] for e in events if e.get("usage")}
        assert len(prompts) == 1, prompts  # the first upstream's, before and after
        last = events[-1]["usage"]
        assert last["total_tokens"] == last["prompt_tokens"] + 4
        assert metric_value(srv, "cwm_sidecar_streams_resumed_total", upstream="a", to="b") == 1
    finally:
        for s in (srv, sa, sb):
            s.stop()


def test_a_token_relayed_without_a_chunk_of_its_own_is_carried_across_the_resume(tmp_path):
    """vLLM sends no chunk for a token whose text it holds back (part of a UTF-8 character) but
    counts it in the next chunk's usage. Such tokens relayed before a resume count as relayed:
    the continuation is asked for the rest and the client's count goes on from what it saw.
    Before, CI saw a SIGKILLed server's answer count 52, 53, then 51 (the chunks with text)."""
    a, b, sa, sb, srv = pair(tmp_path, affinity="first")
    a.script = lambda body: {"content": "alpha beta gamma delta"}
    a.held_tokens = {1}  # "beta" comes with "gamma": chunks "alpha " (1), "beta gamma " (3)
    b.script = lambda body: {"content": "delta"}
    try:
        events, counts = cut_after_two(srv, a)
        text = "".join((c["delta"].get("content") or "") for e in events
                       for c in e.get("choices") or [])
        assert text == "alpha beta gamma delta "
        assert b.last()["max_tokens"] == 5  # 8 less the 3 tokens relayed, not less 2 chunks
        assert counts == sorted(counts) and counts[-1] == 4, counts
    finally:
        for s in (srv, sa, sb):
            s.stop()


def test_an_upstream_dying_mid_answer_is_resumed_on_the_other_from_the_relayed_text(tmp_path):
    """A streamed answer whose server dies after two tokens goes on, on the other server, from
    exactly the text the client already has: same salt, the text as a final assistant message
    to continue, the token limits less what was relayed; the client sees one unbroken stream.
    A primary and its standby (``affinity: first``): every session starts on ``a``."""
    a, b, sa, sb, srv = pair(tmp_path, affinity="first")
    a.script = lambda body: {"content": "alpha beta gamma delta"}
    b.script = lambda body: {"content": "gamma delta"}
    try:
        a.stream_cut_after = 2   # "alpha ", "beta ", then the connection drops
        r = chat(srv, "acme", "tell me", stream=True, max_tokens=8, min_tokens=4)
        events = sse_events(r.text)
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in events), events
        text = "".join((c["delta"].get("content") or "") for e in events
                       if isinstance(e, dict) for c in e.get("choices") or [])
        assert text == "alpha beta gamma delta "
        first, cont = a.last(), b.last()
        assert cont["messages"] == [*first["messages"],
                                    {"role": "assistant", "content": "alpha beta "}]
        assert cont["continue_final_message"] is True and cont["add_generation_prompt"] is False
        assert (cont["max_tokens"], cont["min_tokens"]) == (6, 2)
        assert cont["cache_salt"] == first["cache_salt"] and "continue_final_message" not in first
        assert metric_value(srv, "cwm_sidecar_streams_resumed_total", upstream="a", to="b") == 1
        assert metric_value(srv, "cwm_sidecar_streams_cut_total") in (None, 0)
        # killed after its response began but before its first token (a request sent just
        # before the kill): the same request, whole, on the other server
        a.stream_cut_after, b.calls = 0, []
        b.script = lambda body: {"content": "alpha beta gamma delta"}
        runtime(srv).router.endpoints[0].up = True   # a is back (as a health check would say)
        r = chat(srv, "acme", "tell me again", stream=True, max_tokens=8, session="s1")
        events = sse_events(r.text)
        assert r.status_code == 200 and events[-1] == "[DONE]", events
        assert not any(isinstance(e, dict) and "error" in e for e in events), events
        assert "".join((c["delta"].get("content") or "") for e in events if isinstance(e, dict)
                       for c in e.get("choices") or []) == "alpha beta gamma delta "
        first, again = a.last(), b.last()
        assert again == first and again["max_tokens"] == 8, (first, again)
        assert metric_value(srv, "cwm_sidecar_streams_resumed_total", upstream="a", to="b") == 2
        assert metric_value(srv, "cwm_sidecar_streams_cut_total") in (None, 0)
        # a tool call cannot be continued: the client gets the error event
        a.stream_cut_after, b.calls = 1, []
        a.script = lambda body: {"tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}
        runtime(srv).router.endpoints[0].up = True   # a is back (as a health check would say)
        r = chat(srv, "acme", "call", stream=True, session="s2")
        events = sse_events(r.text)
        assert any(isinstance(e, dict) and "error" in e for e in events) and b.bodies() == []
        # the other upstream refuses the continuation: the client gets the error event (what
        # was relayed stays relayed and billed), nothing hangs
        a.script = lambda body: {"content": "alpha beta gamma delta"}
        a.stream_cut_after, b.chat_status = 2, 500
        runtime(srv).router.endpoints[0].up = True
        r = chat(srv, "acme", "again", stream=True, session="s3")
        events = sse_events(r.text)
        assert r.status_code == 200 and any(isinstance(e, dict) and "error" in e for e in events)
        assert b.last()["continue_final_message"] is True
        assert metric_value(srv, "cwm_sidecar_streams_resumed_total", upstream="a", to="b") == 2
        wait_until(lambda: metric_value(srv, "cwm_sidecar_streams_cut_total") >= 1,
                   timeout=10, what="the cut stream counted")
    finally:
        for s in (srv, sa, sb):
            s.stop()


def test_a_timeout_is_not_retried_elsewhere(tmp_path):
    """The request reached a server that may still be working on it: a 504, not a second
    generation on another server."""
    a, b, sa, sb, srv = pair(tmp_path, read_timeout_s=0.5)
    try:
        a.chat_delay = 5.0
        r = chat(srv, "acme", "slow")
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        assert b.bodies() == [] and runtime(srv).router.endpoints[0].up
    finally:
        for s in (srv, sa, sb):
            s.stop()


def test_periodic_checks_bring_a_recovered_upstream_back(tmp_path):
    a, b, sa, sb, srv = pair(tmp_path, interval=0.2)
    try:
        sa.stop()
        assert chat(srv, "acme", "one").headers["x-cwm-upstream"] == "b"
        assert not runtime(srv).router.endpoints[0].up
        sa = ServerThread(a.app, port=sa.port).start()
        # no request and no /health: only the periodic check can see it is back
        wait_until(lambda: runtime(srv).router.endpoints[0].up, timeout=60, interval=0.05,
                   what="the periodic health check")
        assert chat(srv, "acme", "two").headers["x-cwm-upstream"] == "a"
    finally:
        for s in (srv, sa, sb):
            s.stop()
