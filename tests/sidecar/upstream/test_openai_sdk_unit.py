"""The real ``openai`` SDK against the sidecar over real HTTP, a recording upstream behind it.

The upstream is a small real OpenAI-compatible server (``cwm_plugin.testing.fake_upstream``) that
scripts the model's answers (tool calls included, which a random-weight model never makes) and
records exactly what the sidecar sent. With memory off the upstream body must equal the client's
plus the derived salt; with memory on no client message may be dropped, duplicated or reordered: the
only change is the memory merged into the system message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from sidecar_helpers import ADMIN, KEYS, SECRET, make_settings, metric_value, runtime, salt

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.identity.authenticator import Authenticator
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
SYSTEM = {"role": "system", "content": "You are the travel desk's agent. Use the tools."}
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def agent_script(body: dict) -> dict:
    """Call the weather tool until three results are in, then answer; JSON when asked."""
    msgs = body.get("messages") or []  # (none in /v1/completions)
    if body.get("response_format"):
        return {"content": '{"city": "Zurich", "ok": true}'}
    done = sum(m["role"] == "tool" for m in msgs)
    if body.get("tools") and done < 3:
        city = ["Zurich", "Chur", "Tirano"][done]
        return {"tool_calls": [{"id": f"call_{done}", "type": "function", "function": {
            "name": "weather", "arguments": json.dumps({"city": city})}}]}
    return {"content": "Sunny everywhere along the route"}


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeUpstream, ServerThread]]:
    fake = FakeUpstream(script=agent_script)
    with ServerThread(fake.app) as srv:
        yield fake, srv


@pytest.fixture(scope="module")
def sidecars(upstream, tmp_path_factory) -> Iterator[dict[str, ServerThread]]:
    """``on``: memory on (the defaults); ``off``: memory off; both send an upstream API key."""
    _, up = upstream
    made = {}
    for name, over in (("on", {}), ("off", {"memory_enabled": False})):
        settings = make_settings(up.url, tmp_path_factory.mktemp(name), "tiktoken:cl100k_base",
                                 upstream={"api_key": "upstream-key"}, **over)
        made[name] = ServerThread(create_app(settings)).start()
    yield made
    for srv in made.values():
        srv.stop()


def client(srv: ServerThread, session: str | None = "s1", tenant: str = "acme",
           sent: list | None = None) -> openai.OpenAI:
    """The SDK pointed at the sidecar; the JSON bodies it sends are appended to ``sent``."""
    def keep(request: httpx.Request) -> None:
        if sent is not None and request.content:
            sent.append(json.loads(request.content))

    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEYS[tenant], max_retries=0,
                         default_headers={"X-Session-Id": session} if session else None,
                         http_client=httpx.Client(event_hooks={"request": [keep]}, timeout=60))


def test_with_memory_off_the_upstream_gets_exactly_the_clients_body(upstream, sidecars):
    fake, _ = upstream
    sent: list[dict] = []
    sdk = client(sidecars["off"], session="exact", sent=sent)
    history = [SYSTEM, {"role": "user", "content": "Weather in Zurich?"},
               {"role": "assistant", "content": "Let me look."},
               {"role": "user", "content": "And tomorrow?"}]
    r = sdk.chat.completions.create(model="fake", messages=history, temperature=0.3,
                                    max_tokens=20, tools=TOOLS, seed=7, user="u-1")
    assert r.choices[0].message.tool_calls[0].function.name == "weather"
    # plus the salt and, for the connector, the client turn (the session's 2nd user message)
    # and when it arrived
    got = fake.last()
    assert got["kv_transfer_params"]["cwm"].pop("at") > 0
    assert got == {**sent[-1], "cache_salt": salt("acme", "exact", user="u-1"),
                   "kv_transfer_params": {"cwm": {"turn": 2, "keep": 8}}}
    headers = fake.headers()
    assert headers["authorization"] == "Bearer upstream-key"  # never the client's key
    assert KEYS["acme"] not in json.dumps(headers)


def test_chat_and_streaming_with_usage(upstream, sidecars):
    fake, _ = upstream
    srv = sidecars["on"]
    runtime(srv).memory.service.add_memory("acme", "The user's home station is Chur.", "fact",
                                           0.9)
    sdk = client(srv, session="stream")
    messages = [SYSTEM, {"role": "user", "content": "Which station is my home station?"}]
    r = sdk.chat.completions.create(model="fake", messages=messages)
    assert r.choices[0].message.content == "Sunny everywhere along the route"
    body = fake.last()
    assert body["messages"][1:] == messages[1:] and len(body["messages"]) == 2
    assert body["messages"][0]["content"].startswith(SYSTEM["content"])
    assert "home station is Chur" in body["messages"][0]["content"]
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "Thanks. Anything else?"}]
    stream = sdk.chat.completions.create(model="fake", messages=messages, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == "Sunny everywhere along the route"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    # the same memory text as the first turn: the prompt only grew at its end
    assert fake.last()["messages"][0] == body["messages"][0]
    assert fake.last()["messages"][1:] == messages[1:]
    turns = runtime(srv).memory.service.transcript("acme", "stream")
    assert [t["role"] for t in turns] == ["user", "assistant"] * 2


def _assistant(message) -> dict:
    return message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"})


def test_a_three_round_agent_loop_sends_each_message_once(upstream, sidecars):
    fake, _ = upstream
    srv = sidecars["on"]
    runtime(srv).memory.service.add_memory(
        "acme", "The user travels by train from Zurich to Tirano next week.", "fact", 0.8)
    sdk = client(srv, session="agent")
    messages = [SYSTEM, {"role": "user", "content": "Plan my train trip from Zurich to "
                                                    "Tirano: what weather do I get?"}]
    n_before = len(fake.bodies())
    for _ in range(5):
        r = sdk.chat.completions.create(model="fake", messages=messages, tools=TOOLS)
        msg = r.choices[0].message
        sent = fake.last()["messages"]
        assert len(sent) == len(messages) and sent[1:] == messages[1:]  # none lost, none twice
        assert "Zurich to Tirano next week" in sent[0]["content"]  # searched by the request
        if not msg.tool_calls:
            break
        messages.append(_assistant(msg))
        for call in msg.tool_calls:
            city = json.loads(call.function.arguments)["city"]
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": f"{city}: sunny, 21 degrees"})
    assert msg.content == "Sunny everywhere along the route"
    assert len(fake.bodies()) - n_before == 4  # three tool rounds and the answer
    systems = {json.dumps(b["messages"][0]) for b in fake.bodies()[n_before:]}
    assert len(systems) == 1  # one memory text for the whole loop: the prefix never moved
    roles = [t["role"] for t in runtime(srv).memory.service.transcript("acme", "agent")]
    assert roles == ["user", "assistant"] + ["tool", "assistant"] * 3
    calls = runtime(srv).memory.service.transcript("acme", "agent")[1]["content"]
    assert calls.startswith("[tool call weather(") and "Zurich" in calls


def test_a_streamed_tool_call_round_trip(upstream, sidecars):
    fake, _ = upstream
    sdk = client(sidecars["on"], session="toolstream")
    messages = [{"role": "user", "content": "Weather in Zurich?"}]
    calls: dict[int, dict] = {}
    for chunk in sdk.chat.completions.create(model="fake", messages=messages, tools=TOOLS,
                                             stream=True):
        for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            calls.setdefault(c.index, {"id": c.id, "name": c.function.name})
    assert calls[0]["name"] == "weather"
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0]["id"], "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Zurich"}'}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "Zurich: rain"}]
    sdk.chat.completions.create(model="fake", messages=messages, tools=TOOLS)
    sent = fake.last()["messages"]
    assert sent[-3:] == messages  # the tool round once, in order, after the merged memory
    turns = runtime(sidecars["on"]).memory.service.transcript("acme", "toolstream")
    assert [t["role"] for t in turns] == ["user", "assistant", "tool", "assistant"]
    assert "weather" in turns[1]["content"]


def test_n_json_response_format_and_logprobs(upstream, sidecars):
    fake, _ = upstream
    sdk = client(sidecars["on"], session="opts")
    q = [{"role": "user", "content": "Two options please"}]
    r = sdk.chat.completions.create(model="fake", messages=q, n=2, logprobs=True,
                                    top_logprobs=1)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[1].message.content.endswith("#1")
    assert r.choices[0].logprobs.content[0].top_logprobs[0].logprob == -0.5
    assert fake.last()["n"] == 2 and fake.last()["top_logprobs"] == 1
    r = sdk.chat.completions.create(model="fake", messages=q,
                                    response_format={"type": "json_object"})
    assert json.loads(r.choices[0].message.content)["city"] == "Zurich"
    assert fake.last()["response_format"] == {"type": "json_object"}


def test_embeddings_models_responses_and_tokenize_are_forwarded(upstream, sidecars):
    fake, _ = upstream
    srv = sidecars["on"]
    sent: list[dict] = []
    sdk = client(srv, session="fwd", sent=sent)
    emb = sdk.embeddings.create(model="fake", input=["abc", "hello"])
    assert [d.embedding[0] for d in emb.data] == [3.0, 5.0]
    assert fake.last("/v1/embeddings") == sent[-1]  # as the client sent it, no salt
    assert sdk.models.retrieve("fake").id == "fake"
    assert [m.id for m in sdk.models.list()] == ["fake"]
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")
    resp = sdk.responses.create(model="fake", input="Say ok")
    assert resp.output_text == "ok"
    got = fake.last("/v1/responses")  # the session's next turn, and when it arrived
    assert got["kv_transfer_params"]["cwm"].pop("at") > 0
    assert got == {**sent[-1], "cache_salt": salt("acme", "fwd"),
                   "kv_transfer_params": {"cwm": {"turn": 1, "keep": 8}}}
    auth = {"Authorization": f"Bearer {KEYS['acme']}"}
    tok = httpx.post(f"{srv.url}/tokenize", headers=auth, json={"model": "fake",
                                                                "prompt": "a b c"})
    assert tok.json()["count"] == 3
    for n in range(3):  # models nobody serves go to the default upstream, one label for all
        httpx.post(f"{srv.url}/tokenize", headers=auth, json={"model": f"made-up-{n}",
                                                              "prompt": "a"})
    assert metric_value(srv, "cwm_sidecar_requests_total", route="tokenize",
                        model="other") == 3
    assert "made-up" not in httpx.get(f"{srv.url}/metrics", headers=ADMIN).text
    assert httpx.post(f"{srv.url}/v1/embeddings", json={"model": "fake", "input": "x"}
                      ).status_code == 401


def test_streamed_responses_and_completions_are_accounted(upstream, sidecars):
    """Usage of a streamed ``/v1/responses`` comes in its ``response.completed`` event; a
    streamed ``/v1/completions`` is asked for it (and the client still gets the stream it
    asked for). Both reach the tenant's usage."""
    fake, _ = upstream
    srv = sidecars["on"]
    auth = {"Authorization": f"Bearer {KEYS['beta']}", "X-Session-Id": "acct"}
    before = httpx.get(f"{srv.url}/v1/usage", headers=auth).json()["total"]
    r = httpx.post(f"{srv.url}/v1/responses", headers=auth,
                   json={"model": "fake", "input": "Say ok", "stream": True})
    assert r.status_code == 200 and "event: response.completed" in r.text
    got = httpx.get(f"{srv.url}/v1/usage", headers=auth).json()["total"]
    assert (got["requests"] - before["requests"], got["completion_tokens"]
            - before["completion_tokens"], got["prompt_tokens"] - before["prompt_tokens"]) \
        == (1, 5, 2)  # the script's answer, a word a delta
    sdk = client(srv, session="acct", tenant="beta")
    assert sdk.responses.create(model="fake", input="Say ok", stream=True) is not None
    with sdk.completions.create(model="fake", prompt="Say ok", stream=True) as stream:
        chunks = list(stream)
    assert fake.last("/v1/completions")["stream_options"] == {"include_usage": True}
    assert chunks and all(c.usage is None for c in chunks)  # not asked: not shown
    after = httpx.get(f"{srv.url}/v1/usage", headers=auth).json()["total"]
    assert after["requests"] - got["requests"] == 2


def test_request_ids_and_bad_bodies(upstream, sidecars):
    fake, _ = upstream
    srv = sidecars["on"]
    url = f"{srv.url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {KEYS['acme']}", "x-request-id": "req-42"}
    ok = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(url, headers=auth, json=ok, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-42"
    assert fake.headers()["x-request-id"] == "req-42"
    assert "total;dur=" in r.headers["server-timing"]
    deep = b'{"model": "fake", "messages": [{"role": "user", "content": ' + b"[" * 5000 + \
        b"]" * 5000 + b"}]}"
    for raw in (deep, b'{"model": "fake", "messages": [{"role": "user", "content": ' +
                b"[" * 100 + b"]" * 100 + b"}]}", b"[1, 2]", b'{"model": '):
        r = httpx.post(url, headers=auth, content=raw, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, headers={**auth, "X-CWM-History": "everything"}, json=ok, timeout=30)
    assert r.status_code == 400 and "x-cwm-history" in r.json()["error"]["message"]


def test_crlf_streams_are_parsed(upstream, sidecars):
    fake, _ = upstream
    srv = sidecars["on"]
    fake.crlf = True
    try:
        sdk = client(srv, session="crlf")
        chunks = list(sdk.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hello"}], stream=True))
    finally:
        fake.crlf = False
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == \
        "Sunny everywhere along the route"
    turns = runtime(srv).memory.service.transcript("acme", "crlf")
    assert turns[-1]["content"].strip() == "Sunny everywhere along the route"
    assert metric_value(srv, "cwm_sidecar_completion_tokens_total", tenant="acme") > 0


def test_without_session_or_user_a_request_is_stateless(upstream, sidecars):
    fake, _ = upstream
    srv = sidecars["on"]
    svc = runtime(srv).memory.service
    before = set(svc.files.sessions("beta"))
    sdk = client(srv, session=None, tenant="beta")
    sdk.chat.completions.create(model="fake", messages=[
        {"role": "user", "content": "My locker code is 4417."}])
    sdk.chat.completions.create(model="fake", messages=[
        {"role": "user", "content": "What is my locker code?"}])
    assert "4417" not in json.dumps(fake.last()["messages"])  # nothing shared between callers
    assert set(svc.files.sessions("beta")) == before  # nothing recorded
    assert fake.last()["cache_salt"] == salt("beta", "")  # the tenant's own stateless salt


def test_a_stateless_request_on_every_salted_route_leaves_no_context_record(upstream,
                                                                          sidecars):
    """No session: no conversation turn, so the connector is told to keep no record of it
    (it would become the latest turn of whatever shares its salt: a client's own, say)."""
    fake, _ = upstream
    sdk = client(sidecars["on"], session=None, tenant="gamma")
    for send, path in [
            (lambda: sdk.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "hi"}],
                extra_body={"cache_salt": "team-salt"}), "/v1/chat/completions"),
            (lambda: sdk.completions.create(model="fake", prompt="hi", max_tokens=4,
                                            extra_body={"cache_salt": "team-salt"}),
             "/v1/completions"),
            (lambda: sdk.responses.create(model="fake", input="hi"), "/v1/responses")]:
        send()
        assert fake.last(path)["kv_transfer_params"] == {"cwm": {"record": False}}, path
    # a turn of a session is recorded (the connector's default)
    client(sidecars["on"], session="g", tenant="gamma").completions.create(
        model="fake", prompt="hi", max_tokens=4)
    assert "record" not in fake.last("/v1/completions")["kv_transfer_params"]["cwm"]


def test_a_client_salt_is_hmacd_with_the_tenant(upstream, sidecars):
    fake, _ = upstream
    sdk = client(sidecars["on"], session="g", tenant="gamma")
    sdk.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                extra_body={"cache_salt": "team-salt"})
    want = Authenticator([], SECRET.encode()).client_salt("gamma", "team-salt")
    assert fake.last()["cache_salt"] == want != "team-salt"
    with pytest.raises(openai.PermissionDeniedError):  # acme may not choose its salt
        client(sidecars["on"]).chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}],
            extra_body={"cache_salt": "team-salt"})


@pytest.mark.parametrize("mode", ["full", "recent"])
def test_a_trailing_assistant_tool_or_system_message_is_sent_once(upstream, sidecars, mode):
    fake, _ = upstream
    srv = sidecars["on"]
    hdr = {"X-CWM-History": mode}
    tail_cases = [
        [{"role": "user", "content": "Write a haiku."},
         {"role": "assistant", "content": "Snow on the"}],  # a prefill to continue
        [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "weather",
                                                            "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "rain"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
         {"role": "system", "content": "Now answer in French."}],
    ]
    for i, tail in enumerate(tail_cases):
        messages = [SYSTEM, {"role": "user", "content": "Earlier question"},
                    {"role": "assistant", "content": "Earlier answer"}, *tail]
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, json={
            "model": "fake", "messages": messages},
            headers={"Authorization": f"Bearer {KEYS['acme']}", "X-Session-Id": f"t{i}", **hdr})
        assert r.status_code == 200, r.text
        sent = fake.last()["messages"]
        assert sent[1:] == messages[1:]  # each once, in order (all fits in recent_turns too)
        assert sent[0]["content"].startswith(SYSTEM["content"])


def test_the_token_saving_mode_is_a_tenant_setting_too(upstream, tmp_path):
    fake, up = upstream
    settings = make_settings(up.url, tmp_path, "tiktoken:cl100k_base",
                             memory={"recent_turns": 2})
    settings.tenants[1].history = "recent"  # beta saves tokens by default, acme does not
    talk = [{"role": r, "content": f"{r} {i}"} for i in range(6) for r in ("user", "assistant")]
    messages = [SYSTEM, *talk, {"role": "user", "content": "And now?"}]
    with ServerThread(create_app(settings)) as srv:
        for tenant, want in (("acme", messages[1:]), ("beta", messages[-3:])):
            client(srv, session="ts", tenant=tenant).chat.completions.create(
                model="fake", messages=messages)
            assert fake.last()["messages"][1:] == want
        # and a request asks for the other mode with a header
        client(srv, session="ts2", tenant="beta").chat.completions.create(
            model="fake", messages=messages, extra_headers={"X-CWM-History": "full"})
        assert fake.last()["messages"][1:] == messages[1:]
