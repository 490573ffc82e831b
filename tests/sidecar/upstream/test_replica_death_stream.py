"""A sidecar replica killed (SIGKILL) in the middle of streaming an answer: the client's stream
breaks, the client sends the turn again to the other replica, and the memory (one PostgreSQL,
session state in one Redis) holds every turn exactly once: the turns before the kill, the
retried turn with its whole answer (no half answer from the dead replica), the turns after.
The retry's prompt is the one the dead replica had sent (the pinned memory came from Redis).
Replicas are ``cwm serve`` processes; the upstream is ``cwm_plugin.testing.fake_upstream``
streaming a word every 0.2 s."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from sidecar_helpers import KEYS, SECRET, replica_config

from cwm_plugin import pg_scope
from cwm_plugin.memory.postgres.truth import PostgresTruth
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.testing.sidecar_process import SidecarProcess

pytestmark = pytest.mark.postgres
ANSWER = " ".join(f"word{i}" for i in range(30))
STREAMED = ANSWER + " "  # the fake streams a space after every word
HEADERS = {"Authorization": f"Bearer {KEYS['acme']}", "X-Session-Id": "s1"}


def _stream(url: str, messages: list[dict], *, kill=None) -> str:
    """Stream one turn; ``kill()`` is called after the third chunk (the stream then breaks)."""
    text, chunks = "", 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=HEADERS, timeout=60,
                      json={"model": "tiny", "messages": messages, "stream": True,
                            "max_tokens": 40}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
            chunks += 1
            if chunks == 3 and kill is not None:
                kill()
    return text


def test_a_replica_killed_mid_stream_loses_no_turn_and_keeps_no_half_answer(
        postgres_url: str, redis_server, tmp_path: Path) -> None:
    fake = FakeUpstream(model="tiny", script=lambda body: {"content": ANSWER})
    fake.stream_delay = 0.2
    history = [{"role": "system", "content": "You are brief."},
               {"role": "user", "content": "My bees live on the roof."}]
    with ServerThread(fake.app) as up, \
            SidecarProcess(replica_config(tmp_path / "a", postgres_url, redis_server.url), up.url,
                           tmp_path / "a", SECRET) as a, \
            SidecarProcess(replica_config(tmp_path / "b", postgres_url, redis_server.url), up.url,
                           tmp_path / "b", SECRET) as b:
        history.append({"role": "assistant", "content": _stream(a.url, history)})
        history.append({"role": "user", "content": "How many hives should I add?"})
        with pytest.raises(httpx.HTTPError):  # the replica dies under the client's stream
            _stream(a.url, history, kill=a.kill)
        sent_by_a = fake.last()["messages"]
        again = _stream(b.url, history)  # the client sends the turn again, to B
        assert again == STREAMED
        assert fake.last()["messages"] == sent_by_a  # the same prompt the dead one sent
        history.append({"role": "assistant", "content": again})
        history.append({"role": "user", "content": "And in winter?"})
        assert _stream(b.url, history) == STREAMED

    truth = PostgresTruth(postgres_url, tmp_path / "reader")
    try:
        with pg_scope.scoped(pg_scope.EVERYTHING):  # (the test's own look: every row)
            kept = [(t.role, t.content) for f in truth.folders() for s in truth.sessions(f)
                    for t in truth.read_turns(f, s)]
    finally:
        truth.close()
    assert kept == [(m["role"], m["content"]) for m in history[1:]] + [("assistant", STREAMED)]
