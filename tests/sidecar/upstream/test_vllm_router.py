"""The sidecar in front of a real ``vllm-router`` (vLLM's balancer, from its wheel) over two
workers: each session's requests carry its routing key (``routing.session_header``, an HMAC of
its cache_salt, never the client's session name), and the router's session affinity keeps every
turn of a session on one worker while sessions spread over both -- with ``consistent_hash``, and
with ``kv_aware`` plus its session affinity. The workers are ``fake_upstream`` (what is routed
is under test, not what a worker computes).

Also pinned here, because the deployment's docs rest on it: ``kv_aware`` gives a request that
carries a ``cache_salt`` (every request through the sidecar) no prefix credit at all (its
decision reads ``cache_salt``), which is why the sidecar leans on session affinity
(``docs/router.md``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sidecar_helpers import KEYS, chat, make_settings, salt

from cwm_plugin.salts import route_key
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.settings import load_settings
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.procs import answers, free_port, tail, terminate, wait_until
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.testing.vllm_router import VllmRouter

SESSIONS = 12  # (all twelve on one worker by chance: 2 in 4,096)


def _keys_by_worker(workers: list[FakeUpstream]) -> list[dict[str, int]]:
    """For each worker: routing key -> chats it got."""
    out = []
    for w in workers:
        seen: dict[str, int] = defaultdict(int)
        for path, _, headers in w.calls:
            if path == "/v1/chat/completions":
                seen[headers.get("x-session-id", "")] += 1
        out.append(dict(seen))
    return out


@pytest.mark.parametrize("policy", ["consistent_hash", "kv_aware"])
def test_each_session_stays_on_one_worker_and_sessions_spread(policy: str,
                                                             tmp_path: Path) -> None:
    workers = [FakeUpstream(model="tiny"), FakeUpstream(model="tiny")]
    for w in workers:
        w.chat_delay = 0.3  # (a request is in flight while the others are placed)
    args = ["--kv-aware-session-affinity-ttl-secs", "600"] if policy == "kv_aware" else []
    with ServerThread(workers[0].app) as a, ServerThread(workers[1].app) as b, \
            VllmRouter([a.url, b.url], policy=policy, args=args, debug=True) as router, \
            ServerThread(create_app(make_settings(
                router.url, tmp_path / "memory", "tiktoken:cl100k_base",
                routing={"health": {"interval_s": 0}}))) as srv:
        for turn in range(3):  # the sessions' turns at once, as their users type (kv_aware
            # places a new session by the workers' load: sent one by one, all would go to one)
            with ThreadPoolExecutor(SESSIONS) as pool:
                answers = list(pool.map(lambda i, t=turn: chat(
                    srv, "acme", f"Turn {t} of session {i}", session=f"s{i}"), range(SESSIONS)))
            assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        by_worker = _keys_by_worker(workers)
        want = {route_key(salt("acme", f"s{i}")) for i in range(SESSIONS)}
        assert set(by_worker[0]) | set(by_worker[1]) == want  # the routing keys, and only them
        assert not set(by_worker[0]) & set(by_worker[1])  # a session on one worker only
        assert all(n == 3 for side in by_worker for n in side.values())  # every turn there
        assert by_worker[0] and by_worker[1]  # sessions spread over both
        if policy == "kv_aware":  # a chat is not tokenized by the router (HTTP workers): no
            # prefix credit, the session's binding alone
            decisions = router.decisions()
            assert decisions and {d["outcome"] for d in decisions} <= \
                {"missing_tokens", "sticky_hit"}
            assert all(d["credited_prefix_tokens"] == "0" for d in decisions)
            # a completion of token ids may be matched by prefix -- unless it has a cache_salt
            for body_salt in (None, "some-salt"):
                body = {"model": "tiny", "prompt": list(range(1, 65)), "max_tokens": 1,
                        **({"cache_salt": body_salt} if body_salt else {})}
                assert httpx.post(f"{router.url}/v1/completions", json=body,
                                  timeout=30).status_code == 200
                outcome = router.decisions()[-1]["outcome"]
                assert (outcome == "cache_salt") == (body_salt is not None), outcome


def test_the_key_is_not_the_session_name_and_can_be_turned_off(tmp_path: Path) -> None:
    up = FakeUpstream(model="tiny")
    with ServerThread(up.app) as u:
        for header, sent in (("X-Session-Id", True), ("", False)):
            with ServerThread(create_app(make_settings(
                    u.url, tmp_path / header, "tiktoken:cl100k_base",
                    routing={"health": {"interval_s": 0}, "session_header": header}))) as srv:
                assert chat(srv, "acme", "hello", session="visible-name").status_code == 200
                got = up.headers().get("x-session-id")
                if sent:
                    assert got == route_key(salt("acme", "visible-name")) and \
                        "visible-name" not in got and salt("acme", "visible-name") not in got
                else:
                    assert got is None


def test_the_shipped_router_script_and_sidecar_config_work(tmp_path: Path, monkeypatch) -> None:
    """configs/router/: the sidecar's file loads with the router as its one upstream, and the
    router's script starts vllm-router with its flags over two workers."""
    root = Path(__file__).resolve().parents[3] / "configs" / "router"
    monkeypatch.setenv("CWM_SIDECAR_SECRET", "x" * 32)
    s = load_settings(root / "sidecar.yaml")
    assert [e.name for e in s.endpoints()] == ["vllm-router"]
    assert s.routing.session_header == "X-Session-Id"
    assert s.endpoints()[0].balancer  # a cut stream resumes through the router
    workers = [FakeUpstream(model="smollm2"), FakeUpstream(model="smollm2")]
    with ServerThread(workers[0].app) as a, ServerThread(workers[1].app) as b:
        port = free_port()
        env = {**os.environ, "VLLM_1": a.url, "VLLM_2": b.url, "PORT": str(port),
               "EVENTS_1": f"tcp://127.0.0.1:{free_port()}",
               "EVENTS_2": f"tcp://127.0.0.1:{free_port()}",
               "PROMETHEUS_PORT": str(free_port()),
               "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        log = tmp_path / "router.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["bash", str(root / "vllm-router.sh")], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(lambda: answers(f"http://127.0.0.1:{port}/health"), timeout=60,
                       interval=0.2, alive=lambda: proc.poll() is None,
                       what="configs/router/vllm-router.sh", log_tail=lambda: tail(log))
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                           json={"model": "smollm2", "messages": [{"role": "user",
                                                                   "content": "hi"}]},
                           headers={"X-Session-Id": "k1"})
            assert r.status_code == 200, r.text
        finally:
            terminate(proc)


ANSWER = " ".join(f"w{i}" for i in range(20))
SHIPPED_FLAGS = ["--cb-failure-threshold", "2"]  # configs/router/vllm-router.sh's (checked)


def _stream_killing(url: str, kill) -> tuple[str, list[str]]:
    """A streamed chat of session s1; ``kill()`` after the third chunk. Its text, and the
    errors its events carried."""
    text, errors, n = "", [], 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEYS['acme']}", "X-Session-Id": "s1"},
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                            "stream": True, "max_tokens": 40}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(str(event["error"]))
            for c in event.get("choices") or []:
                text += c["delta"].get("content") or ""
            n += 1
            if n == 3 and kill is not None:
                kill()
    return text, errors


@pytest.mark.parametrize("balancer", [True, False])
def test_a_worker_killed_mid_answer_is_resumed_through_the_router(balancer: bool,
                                                                 tmp_path: Path) -> None:
    """The worker streaming a session's answer dies after 3 tokens: with ``balancer: true`` the
    sidecar sends the continuation (the 3 tokens as a final assistant message, 37 tokens
    left) through the router again, whose retries -- with the shipped circuit breaker --
    reach the live worker; the client's one stream carries the whole answer and no error.
    Without it the sidecar has no other upstream to resume on, and the stream ends in an
    error."""
    script = (Path(__file__).resolve().parents[3] / "configs" / "router" /
              "vllm-router.sh").read_text()
    assert " ".join(SHIPPED_FLAGS) in script
    workers = [FakeUpstream(model="tiny", script=lambda body: {"content": ANSWER})
               for _ in range(2)]
    for w in workers:
        w.stream_delay = 0.05
    threads = [ServerThread(w.app).start() for w in workers]
    try:
        with VllmRouter([t.url for t in threads], args=SHIPPED_FLAGS) as router, \
                ServerThread(create_app(make_settings(
                    router.url, tmp_path / "memory", "tiktoken:cl100k_base",
                    routing={"health": {"interval_s": 0}},
                    upstream={"url": router.url, "connect_timeout_s": 2.0,
                              "connect_retries": 1, "balancer": balancer}))) as srv:
            first, errors = _stream_killing(srv.url, None)
            assert first == ANSWER + " " and not errors
            home = 0 if workers[0].bodies() else 1  # the session's worker (consistent_hash)

            def kill() -> None:  # as SIGKILL: its stream cut, its port closed, at once
                threads[home].kill()

            text, errors = _stream_killing(srv.url, kill)
            other = workers[1 - home].bodies()
            if balancer:
                assert not errors, errors
                assert len(other) == 1 and other[0]["continue_final_message"] is True
                assert other[0]["messages"][-1] == {"role": "assistant",
                                                    "content": "w0 w1 w2 "}
                assert other[0]["max_tokens"] == 37
                # (the fake answers a continuation with the whole answer; vLLM continues it)
                assert text == "w0 w1 w2 " + ANSWER + " "
            else:
                assert errors and not other and text == "w0 w1 w2 "
    finally:
        for t in threads:
            t.stop()
