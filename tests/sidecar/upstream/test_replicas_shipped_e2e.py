"""Two sidecar replicas as the replica configuration ships them (``configs/replicas/``), in
front of a real ``vllm serve`` with the cwm connector whose store writes Redis behind: memory in
PostgreSQL with its background work on (a summary and a fact extraction every other turn, the
local embedder), session state, background jobs and rate limits in one Redis, windows on the
connector's Redis tier.

A conversation whose turns alternate between the replicas sends vLLM the same prompts as one
sidecar does, and every turn's cached prompt tokens (vLLM's ``prompt_tokens_details``, per
request, so the background calls do not blur them) are within 5% of the one-sidecar run's. A
window frozen on one replica thaws on the other, and the next turn there restores its blocks
from Redis (vLLM's ``external_prefix_cache_hits``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sidecar_helpers import KEYS, Recorder, chat, make_settings, wait_idle

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.testing.vllm_server import cwm_connector_args

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]
HITS = "vllm:external_prefix_cache_hits"
SYSTEM = ("You are the travel desk assistant of the Alpine Rail company. Answer briefly. "
          "Rules: never invent timetables; prefer scenic routes; mention luggage limits. ") * 8
QUESTIONS = ["Which pass does the Bernina line cross?", "How much luggage may I bring?",
             "Is the Glacier Express scenic in winter?", "Where do I change for Tirano?",
             "Can I bring my bicycle on board?", "Which seat should I book?"]


def _is_turn(body: dict[str, Any]) -> bool:
    """A client turn, not a background job (those ask the connector not to store)."""
    return ((body.get("kv_transfer_params") or {}).get("cwm") or {}).get("store") is not False


@contextmanager
def _replicas(upstream: str, tiny_model: Path, pg_url: str, redis_url: str, tmp_path: Path,
              n: int) -> Iterator[list[ServerThread]]:
    name = pg_url.rsplit("/", 1)[1]
    with ExitStack() as stack:
        yield [stack.enter_context(ServerThread(create_app(make_settings(
            upstream, tmp_path / f"{name}-{i}", tiny_model,
            memory={"backend": "postgres", "postgres_url": pg_url, "budget_tokens": 300,
                    "embedder": {"kind": "local"}, "summary_every_turns": 2,
                    "extract_facts": True, "facts_every_turns": 2},
            sessions={"shared_url": redis_url},
            rate_limits={"storage": redis_url},
            windows={"store": {"memory_bytes": 0, "redis_url": redis_url,
                               "redis_prefix": "cwm"}, "wait_s": 30})))) for i in range(n)]


def _converse(srvs: list[ServerThread], rec: Recorder, session: str
              ) -> tuple[list[int], list[list[dict]], list[dict]]:
    """The conversation, turn i on ``srvs[i % n]``, each turn's background work done before
    the next: the cached prompt tokens of every turn, the prompts vLLM got, the history."""
    history = [{"role": "system", "content": SYSTEM}]
    cached, prompts, asked = [], [], len(rec.bodies)
    for i, q in enumerate(QUESTIONS):
        history.append({"role": "user", "content": q})
        r = chat(srvs[i % len(srvs)], "acme", history, session=session, max_tokens=6)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        cached.append(int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
        prompts.append(rec.last(where=_is_turn)["messages"])
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]
                        ["content"]})
        for srv in srvs:
            wait_idle(srv)
    jobs = sum(not _is_turn(b) for _, b in rec.bodies[asked:])
    assert jobs >= len(QUESTIONS), "a summary and a fact extraction every other turn"
    return cached, prompts, history


def test_replicas_as_shipped_prompt_and_hit_like_one_sidecar_and_share_windows(
        vllm_factory, tiny_model, postgres_server, redis_server, tmp_path, record_property):
    vllm = vllm_factory(tiny_model, extra_args=[
        "--enable-prompt-tokens-details",
        *cwm_connector_args({"disk_path": str(tmp_path / "kv"), "redis_url": redis_server.url,
                             "redis_prefix": "cwm", "redis_write": "behind"})])
    vllm.start()
    rec = Recorder(vllm.base_url)
    with ServerThread(rec.app) as relay:
        # one sidecar, then two alternating: each with a fresh memory and session (a salt of
        # its own, so the second run finds none of the first's KV)
        with _replicas(relay.url, tiny_model, postgres_server.new_database(), redis_server.url,
                       tmp_path, 1) as one:
            one_hits, one_prompts, _ = _converse(one, rec, f"one-{uuid.uuid4().hex[:8]}")
        with _replicas(relay.url, tiny_model, postgres_server.new_database(), redis_server.url,
                       tmp_path, 2) as two:
            two_hits, two_prompts, history = _converse(two, rec,
                                                       session := f"two-{uuid.uuid4().hex[:8]}")
            record_property("cached_tokens", {"one": one_hits, "two": two_hits})
            print(f"\ncached prompt tokens per turn: one sidecar {one_hits}, "
                  f"two replicas {two_hits}")
            assert two_prompts == one_prompts  # the same memory and prompt, turn for turn
            assert all(h > 0 for h in one_hits[1:])
            for a, b in zip(one_hits, two_hits, strict=True):
                assert abs(a - b) <= 0.05 * a, (one_hits, two_hits)

            # a window frozen on replica 0 (the last turn ran on replica 1) thaws on replica 1
            a, b = (httpx.Client(base_url=s.url, timeout=300, headers={
                "Authorization": f"Bearer {KEYS['acme']}"}) for s in two)
            r = a.post("/v1/windows", json={"name": "trip", "session": session})
            assert r.status_code == 200, r.text
            assert r.json()["turn"] == len(QUESTIONS)
            assert [w["name"] for w in b.get("/v1/windows").json()["data"]] == ["trip"]
            t = b.post("/v1/windows/trip/thaw", json={"session": "bob"})
            assert t.status_code == 200, t.text
            assert t.json()["messages"] == history
            assert t.json()["blocks_found"] == t.json()["blocks_expected"] > 0
            before = vllm.metric(HITS)
            nxt = [*history, {"role": "user", "content": "And what should I pack?"}]
            r = chat(two[1], "acme", nxt, session="bob", max_tokens=6)
            assert r.status_code == 200, r.text
            assert vllm.metric(HITS) - before >= 128 * t.json()["blocks_expected"]
