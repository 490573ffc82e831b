"""Isolation under concurrent writers: two providers and a tenant, for several users, record
turns, facts and activity entries at once over real HTTP (threads); afterwards every
namespace holds only its own writes, the activity log holds every entry under its writer's
name and its hash chain verifies, and retrieval injects nothing a principal may not read.
The upstream is ``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sidecar_helpers import make_settings, runtime, wait_idle

from cwm_plugin.activity.log import ActivityLog
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.identity.authenticator import hash_key
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
KEYS = {"claude": "key-claude", "llama": "key-llama", "acme": "key-acme"}
PROVIDERS = {"claude", "llama"}
WRITERS = [("claude", "alice"), ("claude", "bob"), ("llama", "alice"), ("llama", None),
           ("acme", "carol"), ("acme", "alice"), ("acme", None)]
TURNS = 4  # per writer, each with a fact and an activity entry
MARK = re.compile(r"mark-(\w+)-(\w+)-\d")


def mark(principal: str, user: str | None, i: int) -> str:
    return f"mark-{principal}-{user or 'none'}-{i}"


def may_read(reader: tuple[str, str | None], writer: tuple[str, str | None]) -> bool:
    """The design's defaults, by hand: a principal reads its own namespace and (for the same
    user) its user's; a provider reads the other providers' the same way; a user's namespace
    is reached only by requests for that user; a tenant reads no one else's."""
    (rp, ru), (wp, wu) = reader, writer
    if wu is not None and wu != ru:
        return False
    return rp == wp or (rp in PROVIDERS and wp in PROVIDERS)


def headers(principal: str, user: str | None, session: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[principal]}",
            **({"X-CWM-User": user} if user else {}),
            **({"X-Session-Id": session} if session else {})}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeUpstream]:
    yield FakeUpstream(model="tiny", max_model_len=8192)


@pytest.fixture(scope="module")
def srv(fake, tmp_path_factory) -> Iterator[ServerThread]:
    root: Path = tmp_path_factory.mktemp("concurrent")
    with ServerThread(fake.app) as up:
        settings = make_settings(
            up.url, root / "memory", "tiktoken:cl100k_base",
            tenants=[{"name": "acme", "key_sha256": [hash_key(KEYS["acme"])]}],
            providers=[{"name": n, "key_sha256": [hash_key(KEYS[n])], "model": "tiny",
                        "context_limit": 8192} for n in sorted(PROVIDERS)],
            access={"grants": {}}, activity={"root": str(root / "activity"),
                                             "log_turns": True},
            # writers as fast as they can: the request rate is not what is checked
            rate_limits={"rate_limit": "none"})
        with ServerThread(create_app(settings)) as sidecar:
            yield sidecar


def write_all(srv: ServerThread, principal: str, user: str | None) -> list[int]:
    """One writer's turns, facts and activity entries, in order (statuses)."""
    codes = []
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        for i in range(TURNS):
            m = mark(principal, user, i)
            h = headers(principal, user, f"s{i % 2}")
            codes.append(c.post("/v1/chat/completions", headers=h, json={
                "model": "tiny", "max_tokens": 4, "messages": [
                    {"role": "user", "content": f"Remember {m}: the secret word."}]}
            ).status_code)
            codes.append(c.post("/v1/memory/facts", headers=h, json={
                "text": f"The secret word of {m} is known.", "importance": 0.9}).status_code)
            codes.append(c.post("/v1/activity", headers=h,
                                json={"what": f"wrote {m}"}).status_code)
    return codes


def test_concurrent_writers_stay_in_their_namespaces(srv):
    with ThreadPoolExecutor(len(WRITERS)) as pool:
        results = list(pool.map(lambda w: write_all(srv, *w), WRITERS))
    assert all(code in (200, 201) for codes in results for code in codes), results
    wait_idle(srv)
    sc = runtime(srv)
    svc = sc.memory.now
    for writer in WRITERS:
        folder = sc.auth.perms.home(writer[0], writer[1]).folder
        seen = {m.group(0) for s in svc.files.sessions(folder)
                for t in svc.transcript(folder, s) for m in MARK.finditer(t["content"])}
        facts = {m.group(0) for f in svc.memories(folder) for m in MARK.finditer(f.text)}
        want = {mark(*writer, i) for i in range(TURNS)}
        assert seen == want and facts == want, writer
    # the activity log: every entry under its writer's name, the chain intact
    log = ActivityLog(sc.settings.activity.root)
    assert log.verify() == []
    entries = log.entries()
    posted = [e for e in entries if e.what.startswith("wrote ")]
    turns = [e for e in entries if e.what.startswith("chat: ")]
    assert len(posted) == len(turns) == len(WRITERS) * TURNS == len(entries) // 2
    # every entry under its writer: the principal's, or its user's inside it (tenant/u-...)
    for e in entries:
        principal, user = MARK.search(e.what).groups()
        want = principal if user == "none" else \
            f"{principal}/{sc.auth.perms.home(principal, user).folder}"
        assert e.principal == want, (e.principal, e.what)


def test_retrieval_after_concurrent_writes_never_leaks(srv, fake):
    """Each writer asks in a new session: the memory merged into its prompt (facts from every
    namespace it may read, passages from its own) names only writers it may read."""
    for reader in WRITERS:
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120,
                       headers=headers(*reader, "ask"),
                       json={"model": "tiny", "max_tokens": 4, "messages": [
                           {"role": "user", "content": "What is the secret word?"}]})
        assert r.status_code == 200
        first = fake.last()["messages"][0]
        merged = first["content"] if first["role"] == "system" else ""
        found = {(p, None if u == "none" else u) for p, u in MARK.findall(merged)}
        assert reader in found, (reader, found)  # its own memories at least
        assert all(may_read(reader, w) for w in found), (reader, found)
