"""Background work across sidecar replicas (``cwm serve`` processes, one PostgreSQL memory,
one Redis): a replica killed (SIGKILL) while its fact extraction waits on the model loses
neither the turn nor the fact, and the fact is not extracted twice: the other replica takes the
job over once its claim has lapsed. Without shared state the fact is lost with the replica (the
negative control). The upstream is ``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sidecar_helpers import ADMIN, KEYS, SECRET

from cwm_plugin.sidecar.identity.authenticator import hash_key
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.testing.sidecar_process import SidecarProcess

pytestmark = pytest.mark.postgres
FACT = "The user keeps three beehives on the roof."


def _background(body: dict[str, Any]) -> bool:
    return ((body.get("kv_transfer_params") or {}).get("cwm") or {}).get("store") is False


def _answer(body: dict[str, Any]) -> dict[str, Any]:
    if _background(body):  # the fact extraction
        return {"content": json.dumps([{"text": FACT, "category": "fact", "importance": 0.8}])}
    return {"content": "ok"}


def _config(path: Path, pg_url: str, shared: str | None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "tenants": [{"name": "acme", "key_sha256": [hash_key(KEYS["acme"])]}],
        "memory": {"root": str(path.parent / "memory"), "tokenizer": "tiktoken:cl100k_base",
                   "embedder": {"kind": "hashing"}, "warm_on_start": False,
                   "backend": "postgres", "postgres_url": pg_url, "extract_facts": True,
                   "facts_every_turns": 2, "summary_every_turns": 0,
                   "structured_facts": False},
        "sessions": {"shared_url": shared, "shared_job_grace_s": 1.0,
                     "shared_job_lease_s": 3.0},
        "routing": {"health": {"interval_s": 0}}}))
    return path


def _facts(srv: SidecarProcess) -> list[str]:
    r = httpx.get(f"{srv.url}/v1/memory/facts", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return [f["text"] for f in r.json()["data"]]


def _kill_mid_job(tmp_path: Path, pg_url: str, shared: str | None,
                  wait_s: float) -> tuple[list[str], list[str], int]:
    """Replica A takes a turn and is killed while its extraction waits on the model; what
    replica B's memory holds ``wait_s`` later (facts, the turn), and the extractions asked."""
    fake = FakeUpstream(model="tiny", script=_answer)
    go = threading.Event()
    fake.hold = lambda body: _background(body) and not go.is_set()
    with ServerThread(fake.app) as up, \
            SidecarProcess(_config(tmp_path / "a" / "s.yaml", pg_url, shared), up.url,
                           tmp_path / "a", SECRET) as a, \
            SidecarProcess(_config(tmp_path / "b" / "s.yaml", pg_url, shared), up.url,
                           tmp_path / "b", SECRET) as b:
        r = httpx.post(f"{a.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "I keep three beehives "
                                           "on my roof."}], "max_tokens": 8},
            headers={"Authorization": f"Bearer {KEYS['acme']}", "X-Session-Id": "s1"})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while not any(_background(body) for body in fake.bodies()):
            assert time.monotonic() < deadline, "replica A never started its extraction"
            time.sleep(0.1)
        a.kill()  # mid-job: its extraction is held by the model
        go.set()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and FACT not in _facts(b):
            time.sleep(0.3)
        time.sleep(2.0 if shared else 0.0)  # (a second claim would have run by now)
        turns = httpx.get(f"{b.url}/v1/memory/search", params={"q": "beehives roof"},
                          headers=ADMIN, timeout=30).json()
        return _facts(b), [h["text"] for h in turns["data"] if h["source"] != "memory"], \
            sum(_background(body) for body in fake.bodies())


def test_a_replica_killed_mid_job_loses_no_fact_and_duplicates_none(
        postgres_url: str, redis_server, tmp_path: Path) -> None:
    facts, hits, asked = _kill_mid_job(tmp_path, postgres_url, redis_server.url, 30.0)
    assert facts == [FACT]  # taken over by B, once
    assert any("three beehives" in h for h in hits)  # the turn itself was kept
    assert asked == 2  # A's (killed) and B's


def test_without_shared_jobs_the_fact_dies_with_its_replica(postgres_url: str,
                                                            tmp_path: Path) -> None:
    facts, hits, asked = _kill_mid_job(tmp_path, postgres_url, None, 8.0)
    assert facts == [] and asked == 1 and any("three beehives" in h for h in hits)
