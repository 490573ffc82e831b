"""Sidecar replicas that hold nothing alone: a conversation whose turns alternate between two
sidecars (one PostgreSQL memory, session state in one Redis) sends upstream, turn for turn,
the prompts one sidecar sends: the memory pinned to the conversation stays the same block,
so vLLM's prefix cache keeps hitting. Without the shared state the second replica selects anew
(the negative control). Real HTTP, real PostgreSQL and Redis; the upstream is
``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sidecar_helpers import ADMIN, KEYS, chat, replicas_over_fake, runtime

from cwm_plugin.sidecar.turn.session import Compaction, SessionState
from cwm_plugin.sidecar.turn.shared_state import SharedSessions, apply, snapshot
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.postgres
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
QUESTIONS = ["Tell me about my sister Ines.", "What does Ines do for work?",
             "Where did Ines study?", "Is Ines visiting soon?"]
LATER_FACT = "Ines works as a marine biologist at the Nairobi aquarium."


def _sidecars(postgres_server, tmp_path: Path, n: int, shared: str | None):
    return replicas_over_fake(postgres_server.new_database(), tmp_path, n,
                              sessions={"shared_url": shared})


def _conversation(srvs: list[ServerThread], fake: FakeUpstream) -> list[list[dict[str, Any]]]:
    """Four turns of one session, turn i on ``srvs[i % len(srvs)]``; a fact is learnt after
    the first (a fresh selection would take it). Returns what went upstream each turn."""
    httpx.post(f"{srvs[0].url}/v1/memory/facts", headers=ADMIN, timeout=30,
               json={"text": "The user's sister Ines lives in Nairobi.", "key": "sister"})
    messages: list[dict[str, Any]] = [SYSTEM]
    sent = []
    for i, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        r = chat(srvs[i % len(srvs)], "acme", messages, session="s1")
        assert r.status_code == 200, r.text
        sent.append(fake.last()["messages"])
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]
                         ["content"]})
        if i == 0:
            httpx.post(f"{srvs[0].url}/v1/memory/facts", headers=ADMIN, timeout=30,
                       json={"text": LATER_FACT, "key": "job"})
    return sent


def test_turns_alternating_between_replicas_send_what_one_sidecar_sends(
        postgres_server, redis_server, tmp_path: Path) -> None:
    with _sidecars(postgres_server, tmp_path / "one", 1, None) as (fake, srvs):
        one = _conversation(srvs, fake)
    assert "Ines lives in Nairobi" in str(one[0]) and LATER_FACT not in str(one)  # pinned
    with _sidecars(postgres_server, tmp_path / "two", 2, redis_server.url) \
            as (fake, srvs):
        two = _conversation(srvs, fake)
        state = runtime(srvs[1]).tracker.peek("acme", "s1")
        assert state is not None and state.shared_version >= 2
    assert two == one  # every turn's prompt, byte for byte

    with _sidecars(postgres_server, tmp_path / "alone", 2, None) as (fake, srvs):
        alone = _conversation(srvs, fake)  # the control: replicas that share nothing
    assert alone[0] == one[0] and alone[1] != one[1] and LATER_FACT in str(alone[1])


def test_a_redis_that_is_down_costs_the_turn_nothing(postgres_server, tmp_path: Path) -> None:
    dead = "redis://127.0.0.1:1/0"
    with _sidecars(postgres_server, tmp_path, 1, dead) as (fake, (srv,)):
        r = chat(srv, "acme", [SYSTEM, {"role": "user", "content": "Hello?"}], session="s1")
        assert r.status_code == 200, r.text
        failures = runtime(srv).metrics.memory_failures.labels("acme", "session_state")
        assert failures._value.get() >= 1


def test_the_shared_state_carries_a_compaction_and_the_counters(redis_server) -> None:
    import asyncio

    from cwm_plugin.sidecar.metrics import SidecarMetrics
    from cwm_plugin.sidecar.turn.failopen import FailOpen

    async def run() -> None:
        a = SharedSessions(redis_server.url, b"s" * 32, ttl_s=60, timeout_s=1.0,
                           failopen=FailOpen(SidecarMetrics()))
        b = SharedSessions(redis_server.url, b"s" * 32, ttl_s=60, timeout_s=1.0,
                           failopen=FailOpen(SidecarMetrics()))
        other_secret = SharedSessions(redis_server.url, b"t" * 32, ttl_s=60, timeout_s=1.0,
                                      failopen=FailOpen(SidecarMetrics()))
        mine, theirs = SessionState(), SessionState()
        mine.compaction = Compaction(6, "abc", "They talked about Ines.", 2)
        mine.turns_since_facts, mine.compaction_due, mine.calibration = 3, True, 1.25
        await a.push("acme", "acme/u-1", "s1", mine)
        await b.pull("acme", "acme/u-1", "s1", theirs)
        assert snapshot(theirs) == snapshot(mine) and theirs.compaction == mine.compaction
        other = SessionState()
        await b.pull("acme", "acme/u-2", "s1", other)  # another user's session: nothing
        assert other.compaction is None and other.shared_version == 0
        stranger = SessionState()  # another secret (another deployment): sealed, unreadable
        await other_secret.pull("acme", "acme/u-1", "s1", stranger)
        assert stranger.compaction is None
        import redis

        raw = redis.Redis.from_url(redis_server.url).hget(a.key("acme/u-1", "s1"), "s")
        assert b"Ines" not in raw and b"They talked" not in raw  # not readable in Redis
        theirs.turns_since_facts = 0
        await b.push("acme", "acme/u-1", "s1", theirs)
        await a.pull("acme", "acme/u-1", "s1", mine)
        assert mine.turns_since_facts == 0 and mine.compaction is not None
        for s in (a, b, other_secret):
            await s.aclose()

    asyncio.run(run())
    garbled = SessionState()
    apply(garbled, {"prompt": "not a dict"})
    assert snapshot(garbled) == snapshot(SessionState())  # a malformed state changes nothing


def test_usage_on_any_replica_counts_every_replicas_requests(postgres_server, redis_server,
                                                              tmp_path: Path) -> None:
    """``GET /v1/usage`` answers a tenant's (a user's) requests on every replica; another
    tenant's stay out; without Redis a replica answers its own rows."""
    with _sidecars(postgres_server, tmp_path, 2, redis_server.url) as (fake, (a, b)):
        for srv, user in ((a, None), (b, None), (b, "xavier")):
            r = chat(srv, "acme", [{"role": "user", "content": "Hi"}], session="u1",
                     headers={"X-CWM-User": user} if user else None)
            assert r.status_code == 200, r.text
        assert chat(a, "beta", "Hi", session="u2").status_code == 200
        time.sleep(0.5)  # (added in the background)
        for srv in (a, b):
            got = httpx.get(f"{srv.url}/v1/usage", headers=ADMIN, timeout=30).json()
            assert got["total"]["requests"] == 3, got  # acme's own and its user's
            mine = httpx.get(f"{srv.url}/v1/usage", timeout=30,
                             headers={**ADMIN, "X-CWM-User": "xavier"}).json()
            assert mine["total"]["requests"] == 1
        redis_server.stop()
        got = httpx.get(f"{a.url}/v1/usage", headers=ADMIN, timeout=30).json()
        assert got["total"]["requests"] == 1  # A's own, Redis gone


def test_a_write_goes_over_the_version_read_and_an_old_value_does_not_replay(redis_server
                                                                             ) -> None:
    import asyncio

    import redis

    from cwm_plugin.sidecar.metrics import SidecarMetrics
    from cwm_plugin.sidecar.turn.failopen import FailOpen

    async def run() -> None:
        a, b = (SharedSessions(redis_server.url, [b"n" * 32, b"o" * 32], ttl_s=60,
                               timeout_s=1.0, failopen=FailOpen(SidecarMetrics()))
                for _ in range(2))
        first, second = SessionState(), SessionState()
        first.turns_since_facts = 4
        await a.push("acme", "acme", "s1", first)
        await b.pull("acme", "acme", "s1", second)
        assert second.turns_since_facts == 4 and second.shared_version == 1
        first.turns_since_facts = 5
        await a.push("acme", "acme", "s1", first)  # v2
        second.turns_since_facts = 0  # written over v1, which is gone: dropped
        await b.push("acme", "acme", "s1", second)
        check = SessionState()
        await a.pull("acme", "acme", "s1", check)
        assert check.turns_since_facts == 5 and check.shared_version == 2
        stale = SessionState()
        stale.shared_pulled = False  # its read failed: it writes nothing
        stale.turns_since_facts = 9
        await b.push("acme", "acme", "s9", stale)
        raw = redis.Redis.from_url(redis_server.url)
        assert not raw.exists(a.key("acme", "s9"))
        key = a.key("acme", "s1")  # an old sealed value replayed under a newer version
        old = raw.hget(key, "s")
        first.turns_since_facts = 6
        await a.push("acme", "acme", "s1", first)  # v3
        raw.hset(key, mapping={"v": 4, "s": old})
        replayed = SessionState()
        await b.pull("acme", "acme", "s1", replayed)
        assert replayed.turns_since_facts == 0  # it did not open: nothing taken
        assert "acme" not in key and "s1" not in key  # names keyed by the secret
        for s in (a, b):
            await s.aclose()

    asyncio.run(run())


def test_jobs_keep_a_recorded_checkpoint_and_drop_what_no_secret_opens(redis_server) -> None:
    import asyncio

    from cwm_plugin.sidecar.background.shared_jobs import Claim, SharedJobs
    from cwm_plugin.sidecar.metrics import SidecarMetrics
    from cwm_plugin.sidecar.turn.failopen import FailOpen

    async def run() -> None:
        jobs = SharedJobs(redis_server.url, [b"n" * 32], failopen=FailOpen(SidecarMetrics()),
                          grace_s=0.0, lease_s=5.0, timeout_s=1.0)
        info = {"tenant": "acme", "folder": "acme", "session": "s1", "model": "tiny",
                "salt": "x", "max_model_len": 4096, "owner": "acme"}
        jid = await jobs.record({**info, "checkpoint": True})  # replica A: a checkpoint
        assert await jobs.record({**info, "checkpoint": False}) == jid  # B: facts only
        claim = await jobs.claim("acme", jid)
        assert isinstance(claim, Claim) and claim.checkpoint  # A's checkpoint runs
        assert await jobs.claim("acme", jid) is False  # held by the first claim
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        await jobs.hold("acme", claim, done)
        assert await jobs.claim("acme", jid) is False  # done: nothing left to claim
        other = SharedJobs(redis_server.url, [b"z" * 32], failopen=FailOpen(SidecarMetrics()),
                           grace_s=0.0, timeout_s=1.0)
        await other.record({**info, "session": "s2", "checkpoint": False})
        await asyncio.sleep(0.01)
        assert await jobs.due() == []  # sealed under a secret this one lacks: dropped,
        assert await other.due() == []  # not left at the head of the queue
        for j in (jobs, other):
            await j.aclose()

    asyncio.run(run())


def test_one_tenants_users_cannot_grow_the_shared_usage_without_end(redis_server,
                                                                     monkeypatch) -> None:
    """Past ``MAX_SHARED_ROWS`` rows a tenant's new users are counted in the tenant's own row
    (its total stays whole), whichever replica adds them and however many add at once;
    another tenant's rows are not touched."""
    import asyncio

    from cwm_plugin.sidecar import usage as usage_mod
    from cwm_plugin.sidecar.shared_redis import open_shared
    from cwm_plugin.sidecar.usage import FIGURES, SharedUsage

    monkeypatch.setattr(usage_mod, "MAX_SHARED_ROWS", 3)
    one = {"requests": 1, "prompt_tokens": 10, "completion_tokens": 2, "cached_tokens": 0,
           "cost": 0.5}

    async def go() -> tuple[dict, dict]:
        client = open_shared(redis_server.url, 1.0)
        a, b = SharedUsage(client, timeout_s=1.0), SharedUsage(redis_server.url, timeout_s=1.0)
        await asyncio.gather(*(r._add(f"acme/u-{i}", "tiny", "vllm", "client", one)
                               for i in range(12) for r in (a, b)))
        await b._add("beta", "tiny", "vllm", "client", one)
        got = (await a.rows("acme"))[1], (await b.rows("beta"))[1]
        await a.aclose()
        await b.aclose()
        assert await client.ping()  # a client it was given stays open ...
        await client.aclose()       # ... for its owner to close
        return got

    acme, beta = asyncio.run(go())
    users = [row for row in acme if row[0] != "acme"]
    assert len(users) == 3 and ("acme", "tiny", "vllm", "client") in acme  # 3, and its own
    assert sum(r["requests"] for r in acme.values()) == 24  # nothing lost, only not split
    assert sum(r["cost"] for r in acme.values()) == pytest.approx(12.0)
    assert beta == {("beta", "tiny", "vllm", "client"): {**dict.fromkeys(FIGURES, 0), **one}}


def test_activity_in_postgresql_is_one_log_for_every_replica(postgres_server,
                                                              tmp_path: Path) -> None:
    """With ``activity.backend: postgres`` an entry posted on replica A is read on replica B,
    in one chain with B's own; another tenant reads neither."""
    url = postgres_server.new_database()
    with replicas_over_fake(postgres_server.new_database(), tmp_path, 2, activity={
            "backend": "postgres", "postgres_url": url}) as (_, (a, b)):
        for srv, what in ((a, "drafted on A"), (b, "reviewed on B")):
            r = httpx.post(f"{srv.url}/v1/activity", headers=ADMIN, json={"what": what})
            assert r.status_code == 201, r.text
        got = httpx.get(f"{b.url}/v1/activity?view=full", headers=ADMIN).json()
        assert [e["what"] for e in got["data"]] == ["drafted on A", "reviewed on B"]
        assert got["data"][1]["prev"] == got["data"][0]["hash"]  # one chain
        other = httpx.get(f"{a.url}/v1/activity?view=full", headers={
            "Authorization": f"Bearer {KEYS['beta']}"}).json()
        assert other["data"] == []
