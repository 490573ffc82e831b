"""Requests in flight per principal, over real HTTP in front of a fake upstream: past its
``max_in_flight`` a principal's next request gets a 429 at once (counted as
``limit="in_flight"``) while the other principals are served, and the count a request takes is
given back however its response finishes -- streamed to its end, dropped by the client
mid-stream, refused, failed -- so it returns to 0."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sidecar_helpers import KEYS, drop_stream, make_settings, metric_value, runtime

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.identity.authenticator import hash_key
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
CHAT = "/v1/chat/completions"
LIMITED = "cwm_sidecar_rate_limited_total"
WORDS = " ".join(f"w{i}" for i in range(200))  # a long answer: streamed, it takes a while


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def body(stream: bool = False) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 300, "stream": stream,
            "messages": [{"role": "user", "content": "tell me"}]}


def settled(done: Callable[[], bool]) -> None:
    """Wait until ``done()`` (the server notices a client gone as its next write fails)."""
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, "never settled"
        time.sleep(0.05)


@contextmanager
def sidecar(tmp_path: Path, fake: FakeUpstream, **over: Any) -> Iterator[ServerThread]:
    with ServerThread(fake.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp_path / "memory", "tiktoken:cl100k_base",
            routing={"health": {"interval_s": 0}}, **over))) as srv:
        yield srv


@contextmanager
def streaming(srv: ServerThread, tenant: str) -> Iterator[None]:
    """A streamed chat of ``tenant``'s, in flight (its first event read) while the block runs."""
    with httpx.stream("POST", f"{srv.url}{CHAT}", json=body(stream=True), headers=auth(tenant),
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()  # kept: a dropped iterator would close the stream
        next(lines)
        yield


def test_a_principal_past_its_requests_in_flight_gets_429_and_the_others_are_served(
        tmp_path):
    fake = FakeUpstream(model="tiny", script=lambda b: {"content": WORDS})
    fake.stream_delay = 0.2
    tenants = [{"name": t, "key_sha256": [hash_key(KEYS[t])],
                **({"max_in_flight": 2} if t == "acme" else {})}
               for t in ("acme", "beta", "gamma")]
    with sidecar(tmp_path, fake, tenants=tenants) as srv, ExitStack() as held:
        for _ in range(2):
            held.enter_context(streaming(srv, "acme"))
        assert runtime(srv).in_flight.held("acme") == 2
        r = httpx.get(f"{srv.url}/v1/models", headers=auth("acme"), timeout=30)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.headers["Retry-After"] == "1"
        assert httpx.post(f"{srv.url}{CHAT}", json=body(), headers=auth("beta"),
                          timeout=30).status_code == 200
        held.close()  # the client goes away mid-answer: its slots come back
        settled(lambda: runtime(srv).in_flight.held("acme") == 0)
        assert metric_value(srv, LIMITED, tenant="acme", limit="in_flight") == 1
        assert httpx.get(f"{srv.url}/v1/models", headers=auth("acme"),
                         timeout=30).status_code == 200


def test_requests_in_flight_come_back_to_zero_however_they_finish(tmp_path):
    fake = FakeUpstream(model="tiny", script=lambda b: {"content": WORDS})
    with sidecar(tmp_path, fake, rate_limits={"max_in_flight": 4}) as srv:
        bound = runtime(srv).in_flight
        for _ in range(6):  # streamed to their end
            with httpx.stream("POST", f"{srv.url}{CHAT}", json=body(stream=True),
                              headers=auth("acme"), timeout=60) as r:
                assert r.status_code == 200
                assert r.read().rstrip().endswith(b"data: [DONE]")
            assert bound.held("acme") == 0
        fake.stream_delay = 0.05
        for _ in range(6):  # dropped by the client mid-stream
            drop_stream(srv, CHAT, body(stream=True), auth("acme"), events=2)
        for _ in range(6):  # refused and failed ones: a bad body, an upstream error
            assert httpx.post(f"{srv.url}{CHAT}", content=b"{", headers=auth("acme"),
                              timeout=30).status_code == 400
        fake.chat_status = 500
        for _ in range(6):
            assert httpx.post(f"{srv.url}{CHAT}", json=body(), headers=auth("acme"),
                              timeout=30).status_code >= 500
        assert bound.held("acme") == 0
        fake.chat_status, fake.stream_delay = 200, 0.0
        assert httpx.post(f"{srv.url}{CHAT}", json=body(), headers=auth("acme"),
                          timeout=30).status_code == 200
        assert metric_value(srv, LIMITED, tenant="acme", limit="in_flight") == 0


def test_max_in_flight_none_turns_the_bound_off(tmp_path):
    fake = FakeUpstream(model="tiny", script=lambda b: {"content": WORDS})
    fake.stream_delay = 0.2
    with sidecar(tmp_path, fake, rate_limits={"max_in_flight": "none"}) as srv, \
            ExitStack() as held:
        for _ in range(3):
            held.enter_context(streaming(srv, "acme"))
        assert httpx.get(f"{srv.url}/v1/models", headers=auth("acme"),
                         timeout=30).status_code == 200


def test_by_default_each_principal_may_hold_its_share_of_the_connections(tmp_path):
    """``auto``: a lone principal may use every connection (a plain deployment is not capped
    below what the server takes); several share them; a tenant's own number stands."""
    def bounds(**over: Any) -> dict[str, int | None]:
        return make_settings("http://127.0.0.1:9", tmp_path, "tiktoken:cl100k_base",
                             access={"grants": {}}, **over).in_flight()

    assert bounds() == {"acme": 170, "beta": 170, "gamma": 170}       # 512 // 3
    alone = [{"name": "acme", "key_sha256": [hash_key(KEYS["acme"])]}]
    assert bounds(tenants=alone) == {"acme": 512}
    assert bounds(tenants=alone, server={"max_connections": 64}) == {"acme": 64}
    own = [{**alone[0], "max_in_flight": 3},
           {"name": "beta", "key_sha256": [hash_key(KEYS["beta"])]}]
    assert bounds(tenants=own) == {"acme": 3, "beta": 256}
    assert bounds(rate_limits={"max_in_flight": "none"}, tenants=alone) == {"acme": None}
