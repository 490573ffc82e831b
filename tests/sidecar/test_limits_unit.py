"""Nothing unbounded, over real HTTP: a tenant over its request rate or token quota gets an
OpenAI-shaped 429 with Retry-After, counted in metrics, while the others are served; a
background summary whose input is over the background model's context moves on instead of
failing for ever. The upstream is ``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

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


def test_a_tenant_over_its_token_quota_gets_429_until_the_window_frees(tmp_path):
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp_path, "tiktoken:cl100k_base",
            tenants=tenants(gamma={"token_quota": "40/hour"})))) as srv:
        first = chat(srv, "gamma", "one two three four five six seven eight nine ten")
        used = first.json()["usage"]["total_tokens"]
        assert first.status_code == 200 and used < 40
        while used < 40:  # spent as the answers report their usage
            r = chat(srv, "gamma", "one two three four five six seven eight nine ten")
            assert r.status_code == 200
            used += r.json()["usage"]["total_tokens"]
        r = chat(srv, "gamma")
        assert r.status_code == 429 and "tokens limit" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) > 60  # the hour's window
        # routes that spend no tokens still answer; the other tenants are not limited
        usage = httpx.get(f"{srv.url}/v1/usage", timeout=30,
                          headers={"Authorization": f"Bearer {KEYS['gamma']}"})
        assert usage.status_code == 200 and usage.json()["total"]["prompt_tokens"] > 0
        assert chat(srv, "acme").status_code == 200
        assert metric_value(srv, LIMITED, tenant="gamma", limit="tokens") == 1


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
