"""Upstream failures vLLM cannot be made to produce on demand, from a misbehaving HTTP server.

A small real server on loopback (in a thread) answers ``/v1/models`` like vLLM, then breaks a
stream halfway, stalls past the read timeout, or fails with HTTP 500. The sidecar must answer
each with an OpenAI-shaped error (or error event), never hang, and keep the memory it had.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from sidecar_helpers import chat, make_settings, metric_value, runtime, sse_events, wait_idle

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.upstream.stream import CUT_MARK
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit


def bad_upstream() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"data": [{"id": "tiny", "max_model_len": 2048}]})

    @app.post("/v1/chat/completions")
    async def chat_route(request: Request):
        body = await request.json()
        what = body["messages"][-1]["content"]
        if what == "stall":
            await asyncio.sleep(5)
        if what == "fail":
            return JSONResponse({"detail": "boom"}, status_code=500)
        if what == "busy":
            return JSONResponse({"error": {"message": "slow down", "type": "rate_limit",
                                           "code": 429}}, status_code=429,
                                headers={"Retry-After": "7", "x-request-id": "up-1"})
        if not body.get("stream"):
            return JSONResponse({"id": "x", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "fine"},
                 "finish_reason": "stop"}]})

        async def broken():
            for piece in ("Hel", "lo"):
                chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            raise RuntimeError("the model server died mid-stream")

        return StreamingResponse(broken(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def sidecar_on_bad_upstream(tmp_path_factory):
    with ServerThread(bad_upstream()) as up:
        settings = make_settings(up.url, tmp_path_factory.mktemp("mem"), "tiktoken:cl100k_base",
                                 upstream={"read_timeout_s": 0.5})
        with ServerThread(create_app(settings)) as srv:
            yield srv


def test_a_stream_broken_midway_ends_with_an_error_event(sidecar_on_bad_upstream):
    srv = sidecar_on_bad_upstream
    svc = runtime(srv).memory.service
    svc.record_turn("acme", "brk", "user", "kept from before")
    r = chat(srv, "acme", "go", session="brk", stream=True)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert [e["choices"][0]["delta"]["content"] for e in events[:2]] == ["Hel", "lo"]
    assert events[-1]["error"]["type"] == "upstream_error" and "[DONE]" not in events
    # The half answer is recorded as far as it came, marked as cut; what was there stays.
    wait_idle(srv)
    assert [t["content"] for t in svc.transcript("acme", "brk")] == \
        ["kept from before", "go", f"Hello\n{CUT_MARK}"]


def test_a_stalled_upstream_is_a_504_and_a_failing_one_a_502(sidecar_on_bad_upstream):
    srv = sidecar_on_bad_upstream
    r = chat(srv, "acme", "stall", session="stall")
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    r = chat(srv, "acme", "stall", session="stall", stream=True)
    assert r.status_code == 504
    r = chat(srv, "acme", "fail", session="fail")
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
    assert runtime(srv).memory.service.transcript("acme", "stall") == []


def test_a_rate_limited_upstream_passes_retry_after_and_the_request_id_back(
        sidecar_on_bad_upstream):
    r = chat(sidecar_on_bad_upstream, "acme", "busy", session="busy",
             headers={"x-request-id": "client-1"})
    assert r.status_code == 429 and r.json()["error"]["message"] == "slow down"
    assert r.headers["retry-after"] == "7" and r.headers["x-request-id"] == "up-1"


def test_an_upstream_without_tokenize_fails_open_and_loses_nothing(tmp_path, caplog):
    """tokenizer `vllm` (or `auto` without a local model folder) needs vLLM's /tokenize: when
    it is missing the request is answered without memory, flagged, counted, logged once."""
    with ServerThread(bad_upstream()) as up:
        settings = make_settings(up.url, tmp_path, "vllm")
        with ServerThread(create_app(settings)) as srv:
            svc = runtime(srv).memory.service
            svc.record_turn("acme", "tok", "user", "kept from before")
            for _ in range(2):
                r = chat(srv, "acme", "hello", session="tok")
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] \
                    == "fine"
                assert r.headers["X-CWM-Memory-Status"] == "unavailable; stage=select"
            assert metric_value(srv, "cwm_sidecar_memory_failures_total", tenant="acme",
                                stage="select") == 2
            assert [t["content"] for t in svc.transcript("acme", "tok")] == \
                ["kept from before", "hello", "fine", "hello", "fine"]
    logged = [r for r in caplog.records if "memory select failed" in r.getMessage()]
    assert len(logged) == 1 and "/tokenize" in str(logged[0].exc_info[1])
