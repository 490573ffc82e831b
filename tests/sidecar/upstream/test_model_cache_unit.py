"""The upstreams' model lists, over real HTTP: a flood of model names no upstream serves costs
the upstream at most one ``/v1/models`` an interval (a negative cache), a request for a served
model never waits for a model list being fetched, and a model added upstream is found once
the interval has passed. The upstream is ``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sidecar_helpers import KEYS, chat, make_settings

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit


def sidecar(up: ServerThread, root: Path, **upstream: Any) -> ServerThread:
    """No periodic health checks (they would ask for model lists too); a request rate far
    above what the tests send, so that only the model lists bound what reaches the upstream."""
    return ServerThread(create_app(make_settings(
        up.url, root, "tiktoken:cl100k_base", upstream=upstream,
        routing={"health": {"interval_s": 0}}, rate_limits={"rate_limit": "1000/second"})))


def test_a_flood_of_unknown_model_names_costs_the_upstream_one_model_list(tmp_path):
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as up, sidecar(up, tmp_path, models_recheck_s=60) as srv:
        assert chat(srv, "acme", "hello").status_code == 200
        before = fake.model_lists
        with ThreadPoolExecutor(8) as pool:  # at once, from another tenant
            codes = list(pool.map(lambda i: chat(srv, "beta", "hi", model=f"nope-{i}")
                                  .status_code, range(24)))
        codes += [chat(srv, "beta", "hi", model=f"late-{i}").status_code for i in range(8)]
        assert codes == [404] * 32
        assert fake.model_lists - before <= 1, fake.model_lists - before
        assert chat(srv, "acme", "still here").status_code == 200


def test_a_served_model_never_waits_for_a_model_list_being_fetched(tmp_path):
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as up, \
            sidecar(up, tmp_path, models_recheck_s=0, models_ttl_s=0) as srv:
        assert chat(srv, "acme", "hello").status_code == 200
        fake.models_gate = threading.Event()  # the upstream's /v1/models hangs from now on
        asked = fake.model_lists
        unknown: list[int] = []
        t = threading.Thread(target=lambda: unknown.append(
            chat(srv, "beta", "hi", model="nope").status_code))
        t.start()
        try:
            deadline = time.monotonic() + 30
            while fake.model_lists == asked:  # the unknown name's fetch reached the upstream
                assert time.monotonic() < deadline, "the unknown model was never looked up"
                time.sleep(0.02)
            # served: answered from the list it has (stale: refreshed later, never waited for)
            for _ in range(3):
                r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=10, headers={
                    "Authorization": f"Bearer {KEYS['acme']}"}, json={
                    "model": "tiny", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "served?"}]})
                assert r.status_code == 200
            assert fake.model_lists == asked + 1  # the one fetch, shared
        finally:
            fake.models_gate.set()
            t.join(30)
        assert unknown == [404]


def test_a_model_added_upstream_is_found_after_the_recheck_interval(tmp_path):
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as up, sidecar(up, tmp_path, models_recheck_s=0.3) as srv:
        assert chat(srv, "acme", "hello").status_code == 200
        fake.model = "newer"
        time.sleep(0.4)
        assert chat(srv, "acme", "hi", model="newer").status_code == 200


def test_a_failing_model_list_is_not_asked_again_on_every_request(tmp_path):
    """The upstream's /v1/models fails: the failure is stamped like an answer, so requests
    in the next ``models_recheck_s`` get it (a clear 502) without asking the upstream again."""
    fake = FakeUpstream(model="tiny")
    fake.models_status = 503
    with ServerThread(fake.app) as up, sidecar(up, tmp_path, models_recheck_s=60) as srv:
        answers = [chat(srv, "acme", "hello") for _ in range(8)]
        answers += [chat(srv, "beta", "hi", model=f"nope-{i}") for i in range(4)]
        assert {r.status_code for r in answers} == {502}, answers[0].text
        assert "/v1/models answered HTTP 503" in answers[-1].json()["error"]["message"]
        # the first request's fetch and the health check its failure started, no more
        assert fake.model_lists <= 2, fake.model_lists
        assert fake.bodies() == []  # nothing went up
