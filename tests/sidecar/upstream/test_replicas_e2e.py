"""Two sidecar replicas in front of a real ``vllm serve`` (tiny model): one PostgreSQL memory,
session state in one Redis. A conversation whose turns alternate between the replicas gets the
same injected memory and the same prompts as on one sidecar, and vLLM's prefix cache hits as
much on every turn; without shared session state the second replica's prompt changes and the
hits fall (the negative control)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from sidecar_helpers import ADMIN, chat, make_settings

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]
SYSTEM = ("You are the travel desk assistant of the Alpine Rail company. Answer briefly. "
          "Rules: never invent timetables; prefer scenic routes; mention luggage limits. ") * 8
FACTS = ["The Bernina Express crosses the Bernina pass at 2253 metres.",
         "Luggage: two suitcases and one hand bag per passenger.",
         "The user prefers window seats facing forward."]
QUESTIONS = ["Which pass does the Bernina line cross?", "How much luggage may I bring?",
             "Is the Glacier Express scenic in winter?", "Where do I change for Tirano?",
             "Can I bring my bicycle on board?", "Which seat should I book?"]
LEARNT = "Bicycles need a reservation on panorama trains, and seats face forward in car 3."


@contextmanager
def _replicas(upstream: str, tiny_model: Path, postgres_server, tmp_path: Path, n: int,
              shared: str | None) -> Iterator[list[ServerThread]]:
    url = postgres_server.new_database()
    name = url.rsplit("/", 1)[1]
    with ExitStack() as stack:
        srvs = [stack.enter_context(ServerThread(create_app(make_settings(
            upstream, tmp_path / f"{name}-{i}", tiny_model,
            memory={"backend": "postgres", "postgres_url": url, "budget_tokens": 200},
            sessions={"shared_url": shared})))) for i in range(n)]
        for fact in FACTS:
            r = httpx.post(f"{srvs[0].url}/v1/memory/facts", headers=ADMIN, timeout=60,
                           json={"text": fact})
            assert r.status_code == 201, r.text
        yield srvs


def _run(srvs: list[ServerThread], rec, tiny_vllm) -> tuple[list[int], list[list[dict]]]:
    """The conversation, turn i on ``srvs[i % n]`` (a fact learnt after the first turn, which a
    fresh selection would take); vLLM's prefix-cache hits per turn and the prompts it got."""
    session = f"rep-{uuid.uuid4().hex[:8]}"  # a salt of its own: a reused vLLM holds older KV
    history = [{"role": "system", "content": SYSTEM}]
    hits, prompts = [], []
    for i, q in enumerate(QUESTIONS):
        history.append({"role": "user", "content": q})
        before = tiny_vllm.metric("vllm:prefix_cache_hits")
        r = chat(srvs[i % len(srvs)], "acme", history, session=session, max_tokens=6)
        assert r.status_code == 200, r.text
        hits.append(int(tiny_vllm.metric("vllm:prefix_cache_hits") - before))
        prompts.append(rec.last()["messages"])
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]
                        ["content"]})
        if i == 0:
            httpx.post(f"{srvs[0].url}/v1/memory/facts", headers=ADMIN, timeout=60,
                       json={"text": LEARNT})
    return hits, prompts


def test_alternating_replicas_hit_the_prefix_cache_like_one_sidecar(
        recorder, tiny_vllm, tiny_model, postgres_server, redis_server, tmp_path,
        record_property) -> None:
    rec, rec_srv = recorder
    with _replicas(rec_srv.url, tiny_model, postgres_server, tmp_path, 1, None) as srvs:
        one_hits, one = _run(srvs, rec, tiny_vllm)
    with _replicas(rec_srv.url, tiny_model, postgres_server, tmp_path, 2,
                   redis_server.url) as srvs:
        two_hits, two = _run(srvs, rec, tiny_vllm)
    with _replicas(rec_srv.url, tiny_model, postgres_server, tmp_path, 2, None) as srvs:
        alone_hits, alone = _run(srvs, rec, tiny_vllm)
    record_property("prefix_hits", {"one": one_hits, "two": two_hits, "unshared": alone_hits})
    print(f"\nprefix-cache hits per turn: one sidecar {one_hits}, two replicas {two_hits}, "
          f"two replicas sharing nothing {alone_hits}")
    assert "Bernina pass at 2253" in one[0][0]["content"] and LEARNT not in str(one)
    assert two == one  # the same memory, the same prompts, turn for turn
    for a, b in zip(one_hits[1:], two_hits[1:], strict=True):
        assert abs(a - b) <= 0.05 * a
    assert one_hits[1] > 0 and all(h > 0 for h in one_hits[1:])
    # the control: the second replica, sharing nothing, selects anew and takes the new fact
    assert LEARNT in alone[1][0]["content"] and alone_hits[1] < 0.95 * one_hits[1]
