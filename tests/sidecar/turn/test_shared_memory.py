"""Two sidecars on one PostgreSQL memory (``memory.backend: postgres``): what a client tells
replica A, a turn on replica B injects; a database that goes away fails open (the chat is
answered, flagged in ``X-CWM-Memory-Status``) and memory comes back with it. Real HTTP both
ways, a real PostgreSQL; the upstream is ``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import httpx
import pytest
from sidecar_helpers import ADMIN, chat, replicas_over_fake

from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.postgres_server import PostgresServer

pytestmark = pytest.mark.postgres


@pytest.fixture
def replicas(postgres_url: str, tmp_path: Path):
    with replicas_over_fake(postgres_url, tmp_path, 2, memory={"postgres_timeout_s": 1.0}) as got:
        yield got


def _injected(fake: FakeUpstream) -> str:
    return " ".join(str(m.get("content")) for m in fake.last()["messages"][:-1])


def test_what_replica_a_learns_replica_b_injects(replicas) -> None:
    fake, (a, b) = replicas
    r = httpx.post(f"{a.url}/v1/memory/facts", headers=ADMIN, timeout=30,
                   json={"text": "The user's sister Ines lives in Nairobi.", "key": "sister"})
    assert r.status_code == 201, r.text
    r = chat(b, "acme", "Where does my sister Ines live?", session="s9")
    assert r.status_code == 200 and "X-CWM-Memory-Status" not in r.headers
    assert "Ines lives in Nairobi" in _injected(fake)

    chat(a, "acme", "I adopted a grey greyhound called Pixel yesterday.", session="s1")
    deadline = time.monotonic() + 15  # B looks for other writers every sync_interval_s
    n = 0
    while "Pixel" not in _injected(fake):  # (a conversation's memory is selected once: a new
        assert time.monotonic() < deadline, "replica B never saw replica A's turn"
        time.sleep(0.3)
        n += 1
        chat(b, "acme", "What is the name of my greyhound?", session=f"s8-{n}")  # session)
    facts = httpx.get(f"{b.url}/v1/memory/facts", headers=ADMIN, timeout=30).json()["data"]
    assert [f["text"] for f in facts] == ["The user's sister Ines lives in Nairobi."]


def test_a_database_that_goes_away_fails_open_and_memory_comes_back(tmp_path: Path) -> None:
    with PostgresServer() as pg, replicas_over_fake(pg.url, tmp_path, 1,
                            memory={"postgres_timeout_s": 1.0}) as (fake, (a,)):
        r = httpx.post(f"{a.url}/v1/memory/facts", headers=ADMIN, timeout=30,
                       json={"text": "The user keeps three beehives on the roof."})
        assert r.status_code == 201, r.text
        pg.kill()
        r = chat(a, "acme", "How many beehives do I keep?", session="s1")
        assert r.status_code == 200, r.text  # answered, without memory
        assert r.headers["X-CWM-Memory-Status"].startswith("unavailable")
        assert "beehives on the roof" not in _injected(fake)
        r = httpx.post(f"{a.url}/v1/memory/facts", headers=ADMIN, timeout=30,
                       json={"text": "The user dislikes wasps."})
        assert r.status_code == 503 and r.json()["error"]["code"] == "memory_unavailable"
        assert "cannot be reached" in r.json()["error"]["message"]
        pg.start()
        new = itertools.count()
        deadline = time.monotonic() + 15
        while "beehives on the roof" not in _injected(fake):
            assert time.monotonic() < deadline, "memory did not come back with its database"
            time.sleep(0.3)
            chat(a, "acme", "How many beehives do I keep?", session=f"s1-{next(new)}")
