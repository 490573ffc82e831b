"""Nothing unbounded, over real HTTP: a tenant over its request rate or token quota gets an
OpenAI-shaped 429 with Retry-After, counted in metrics, while the others are served; a
background summary whose input is over the background model's context moves on instead of
failing for ever. The upstream is ``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sidecar_helpers import ADMIN, KEYS, make_settings, metric_value, runtime, wait_idle

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.identity.authenticator import hash_key
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
LIMITED = "cwm_sidecar_rate_limited_total"


def tenants(**extra: dict) -> list[dict]:
    return [{"name": t, "key_sha256": [hash_key(KEYS[t])], **extra.get(t, {})}
            for t in ("acme", "beta", "gamma")]


def chat(srv: ServerThread, tenant: str, text: str = "hello there") -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {KEYS[tenant]}",
                               "X-Session-Id": "s1"},
                      json={"model": "tiny", "max_tokens": 4,
                            "messages": [{"role": "user", "content": text}]})


def test_a_tenant_over_its_rate_gets_429_and_the_others_are_served(tmp_path):
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp_path, "tiktoken:cl100k_base", rate_limits={"rate_limit": "100/minute"},
            tenants=tenants(beta={"rate_limit": "5/minute"})))) as srv:
        codes = [chat(srv, "beta").status_code for _ in range(8)]
        assert codes == [200] * 5 + [429] * 3
        r = chat(srv, "beta")
        err = r.json()["error"]
        assert (r.status_code, err["type"], err["code"]) == \
            (429, "rate_limit_error", "rate_limit_exceeded")
        assert "5 per 1 minute" in err["message"] and 1 <= int(r.headers["retry-after"]) <= 60
        # any route counts, and a refusal reads no body (a huge one is refused as fast)
        r = httpx.post(f"{srv.url}/v1/memory/facts", content=b"x" * 2_000_000, timeout=30,
                       headers={"Authorization": f"Bearer {KEYS['beta']}"})
        assert r.status_code == 429
        assert [chat(srv, t).status_code for t in ("acme", "gamma")] == [200, 200]
        assert metric_value(srv, LIMITED, tenant="beta", limit="requests") == 5
        assert metric_value(srv, LIMITED, tenant="acme") == 0
        assert len(fake.bodies()) == 7  # the refused requests never reached the upstream


def test_a_refusal_is_held_so_a_hammering_client_slows_down_and_the_others_are_served(
        tmp_path):
    """A request over its rate waits ``refusal_delay_s`` for its 429, doing no work: the
    others' requests are answered meanwhile, and a client that sends as fast as it is
    answered sends one request per delay instead of thousands of refusals a second."""
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp_path, "tiktoken:cl100k_base",
            rate_limits={"rate_limit": "100/minute", "refusal_delay_s": 5},
            tenants=tenants(beta={"rate_limit": "1/minute"})))) as srv, \
            ThreadPoolExecutor(2) as pool:
        assert chat(srv, "beta").status_code == 200
        refused = pool.submit(chat, srv, "beta")
        while runtime(srv).in_flight.held("beta") == 0:
            time.sleep(0.02)                        # in flight: it is being held now
        assert [chat(srv, t).status_code for t in ("acme", "gamma")] == [200, 200]
        assert not refused.done(), "the refusal was not held"
        r = refused.result()
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60
        assert metric_value(srv, LIMITED, tenant="beta", limit="requests") == 1
        assert len(fake.bodies()) == 3


def test_a_principal_with_no_bound_in_flight_is_refused_at_once(tmp_path):
    """Its held refusals could take the connections every principal shares: none is held."""
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp_path, "tiktoken:cl100k_base",
            rate_limits={"rate_limit": "100/minute", "refusal_delay_s": 10},
            tenants=tenants(beta={"rate_limit": "1/minute", "max_in_flight": "none"})))) as srv:
        assert chat(srv, "beta").status_code == 200
        t0 = time.monotonic()
        assert chat(srv, "beta").status_code == 429
        assert time.monotonic() - t0 < 10      # not held its 10 s


def test_a_tenant_over_its_token_quota_gets_429_and_never_goes_past_it(tmp_path):
    """Each request reserves its estimate (prompt + max_tokens) before it goes up and settles
    to its usage after: the one that would take the tenant past its quota is refused."""
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp_path, "tiktoken:cl100k_base",
            tenants=tenants(gamma={"token_quota": "40/hour"})))) as srv:
        used, answered = 0, 0
        while (r := chat(srv, "gamma", "one two three four five six seven eight nine ten")) \
                .status_code == 200:
            used += r.json()["usage"]["total_tokens"]
            answered += 1
            assert answered < 10, "the quota never refused"
        assert answered >= 2 and used <= 40, (answered, used)
        assert r.status_code == 429 and "tokens limit" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) > 60  # the hour's window
        # routes that spend no tokens still answer; the other tenants are not limited
        usage = httpx.get(f"{srv.url}/v1/usage", timeout=30,
                          headers={"Authorization": f"Bearer {KEYS['gamma']}"})
        total = usage.json()["total"]
        assert usage.status_code == 200 and \
            total["prompt_tokens"] + total["completion_tokens"] == used
        assert chat(srv, "acme").status_code == 200
        assert metric_value(srv, LIMITED, tenant="gamma", limit="tokens") == 1
        # a request that may answer more than the whole quota is refused outright
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, headers={
            "Authorization": f"Bearer {KEYS['beta']}"}, json={
            "model": "tiny", "max_tokens": 100, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200  # beta has the default quota
        r = httpx.post(f"{srv.url}/v1/completions", timeout=30, headers={
            "Authorization": f"Bearer {KEYS['gamma']}"}, json={
            "model": "tiny", "max_tokens": 100, "prompt": "x"})
        assert r.status_code == 429 and "more than its whole tokens limit" in \
            r.json()["error"]["message"]


def test_requests_at_once_never_take_more_than_the_token_quota(tmp_path):
    fake = FakeUpstream(model="tiny")
    fake.chat_delay = 0.5  # every request is still running when the last one arrives
    with ServerThread(fake.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp_path, "tiktoken:cl100k_base",
            tenants=tenants(gamma={"token_quota": "100/hour"})))) as srv:
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda i: chat(srv, "gamma", f"question number {i} here"),
                                    range(12)))
        codes = sorted(r.status_code for r in answers)
        assert 200 in codes and 429 in codes, codes
        billed = httpx.get(f"{srv.url}/v1/usage", timeout=30, headers={
            "Authorization": f"Bearer {KEYS['gamma']}"}).json()["total"]
        total = billed["prompt_tokens"] + billed["completion_tokens"]
        assert 0 < total <= 100, total
        assert total == sum(r.json()["usage"]["total_tokens"] for r in answers
                            if r.status_code == 200)


def test_rate_limits_are_on_by_default(tmp_path):
    """No `rate_limits` in the config: a tenant sending more than 1200 requests a minute is
    refused past them (the default), and the other tenants are not."""
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp_path, "tiktoken:cl100k_base"))) as srv:
        with httpx.Client(base_url=srv.url, timeout=30, headers={
                "Authorization": f"Bearer {KEYS['beta']}"}) as client:
            started = time.monotonic()
            codes = [client.get("/v1/usage").status_code for _ in range(1250)]
            took = time.monotonic() - started
        assert took < 60, "too slow to cross a minute's limit"
        assert codes.count(200) <= 1200 and codes.count(429) >= 50, Counter(codes)
        assert chat(srv, "acme").status_code == 200
        assert metric_value(srv, LIMITED, tenant="beta", limit="requests") >= 50


def test_a_summary_whose_input_is_over_the_context_moves_on(tmp_path):
    """One turn far longer than the background model's context: the summary is written past
    it (cut to fit, or skipped when the model still refuses), never stuck for ever."""
    fake = FakeUpstream(model="tiny", max_model_len=512)
    fake.max_prompt_tokens = 500  # as vLLM: a longer prompt is a 400
    with ServerThread(fake.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp_path, "tiktoken:cl100k_base",
            memory={"summary_every_turns": 1, "background_max_tokens": 64}))) as srv:
        long = " ".join(f"item{i} arrived late" for i in range(1500))
        r = httpx.post(f"{srv.url}/v1/memory/turns", headers=ADMIN, timeout=30,
                       json={"session": "s1", "role": "user", "content": long})
        assert r.status_code == 201
        for i in range(3):
            assert chat(srv, "acme", f"short question {i}").status_code == 200
            wait_idle(srv)
        svc = runtime(srv).memory.service
        ids = [t.get("turn_id") or t.get("id") for t in svc.transcript("acme", "s1")]
        summary, upto = svc.summary_state("acme", "s1")
        assert summary and upto == ids[-1], (upto, ids)
        moved_on = sum(metric_value(srv, "cwm_sidecar_background_tasks_total", tenant="acme",
                                    kind=k, outcome=o)
                       for k, o in (("input", "truncated"), ("summary", "skipped")))
        assert moved_on >= 1
