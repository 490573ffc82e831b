"""Rotating the sidecar's secret (``secret_versions.py``): the newest version derives salts and
user names, a user's memory named with an older version in its grace period is found and moved
to the newest name (over real HTTP, across a restart), and one past its grace is not looked up.
The upstream is ``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import yaml
from sidecar_helpers import KEYS, make_settings, wait_idle

from cwm_plugin.errors import ConfigError
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.identity.authenticator import Authenticator, hash_key
from cwm_plugin.sidecar.settings import Settings, TenantConfig, load_settings
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
OLD, NEW = "old-secret-0123456789abcdef", "new-secret-0123456789abcdef"


def user_name(secret: str, tenant: str, user: str) -> str:
    mac = hmac.new(secret.encode(), f"user\x00{tenant}\x00{user}".encode(), hashlib.sha256)
    return "u-" + mac.hexdigest()[:32]


def versions(*items: tuple[str, str, datetime | None]) -> list[dict]:
    return [{"id": i, "value": v, **({"until": u} if u else {})} for i, v, u in items]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeUpstream]:
    yield FakeUpstream(model="tiny", max_model_len=4096)


def serve(fake: FakeUpstream, root: Path, secrets: list[dict]):
    up = ServerThread(fake.app).start()
    settings = make_settings(up.url, root, "tiktoken:cl100k_base", secrets=secrets)
    return up, ServerThread(create_app(settings)).start()


def ask(srv: ServerThread, user: str, text: str) -> httpx.Response:
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {KEYS['acme']}"},
                   json={"model": "tiny", "max_tokens": 4, "user": user,
                         "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    return r


def test_a_rotation_finds_and_moves_a_users_memory_within_grace(fake, tmp_path):
    root = tmp_path / "mem"
    later = datetime.now(UTC) + timedelta(days=7)
    up, srv = serve(fake, root, versions(("v1", OLD, None)))
    try:
        ask(srv, "alice@example.com", "My locker code is ZX-4417.")
        ask(srv, "bob@example.com", "My bike is a red Cinelli.")
        wait_idle(srv)
    finally:
        srv.stop()
        up.stop()
    a_old, a_new = (user_name(s, "acme", "alice@example.com") for s in (OLD, NEW))
    assert (root / a_old / "sessions" / f"{a_old}.md").exists()
    # rotated: v2 newest, v1 in its grace period for a week
    up, srv = serve(fake, root, versions(("v2", NEW, None), ("v1", OLD, later)))
    try:
        ask(srv, "alice@example.com", "What is my locker code?")
        sent = fake.last()
        assert "ZX-4417" in str(sent["messages"])  # found under the old name ...
        assert not (root / a_old).exists()  # ... and moved to the new one
        turns = (root / a_new / "sessions" / f"{a_new}.md").read_text()
        assert "ZX-4417" in turns and "What is my locker code?" in turns
        # the salt is the newest version's, for the session's new name and its user
        want = hmac.new(NEW.encode(), f"kv-user\x00acme\x00{a_new}\x00{a_new}".encode(),
                        hashlib.sha256).hexdigest()
        assert sent["cache_salt"] == want
        wait_idle(srv)
    finally:
        srv.stop()
        up.stop()
    # past bob's grace: v1 is no longer looked up, his memory under the v1 name stays there
    b_old = user_name(OLD, "acme", "bob@example.com")
    up, srv = serve(fake, root, versions(("v2", NEW, None),
                                         ("v1", OLD, datetime.now(UTC) - timedelta(days=1))))
    try:
        ask(srv, "bob@example.com", "Which bike do I ride?")
        assert "Cinelli" not in str(fake.last()["messages"])
        assert (root / b_old).exists()
    finally:
        srv.stop()
        up.stop()


def test_versions_in_grace_newest_first(monkeypatch):
    monkeypatch.setenv("CWM_TEST_NEWEST", NEW)
    now = datetime(2026, 11, 23, tzinfo=UTC)
    s = Settings.model_validate({"secrets": [
        {"id": "v3", "env": "CWM_TEST_NEWEST"},
        {"id": "v2", "value": OLD, "until": "2026-12-01T00:00:00Z"},
        {"id": "v1", "value": "older-secret-0123456789", "until": "2026-11-01T00:00:00Z"}]})
    assert s.server_secrets(now) == [NEW.encode(), OLD.encode()]
    assert s.server_secret() == NEW.encode()
    assert OLD not in repr(s) and NEW not in repr(s)
    a = Authenticator([TenantConfig(name="acme", key_sha256=[hash_key("k")])], NEW.encode(),
                      previous=[OLD.encode()], locate=lambda names: names[-1])
    assert a.user_folder("acme", "alice") == user_name(OLD, "acme", "alice")  # asks locate
    assert a.user_session("acme", "alice") == user_name(NEW, "acme", "alice")


@pytest.mark.parametrize(("secrets", "says"), [
    ([{"id": "v1", "value": OLD}, {"id": "v1", "value": NEW}], "secret ids must be unique"),
    ([{"id": "v1", "value": OLD, "env": "X"}], "exactly one of `value` and `env`"),
    ([{"id": "v 1", "value": OLD}], "secret id 'v 1'"),
])
def test_bad_secret_versions_are_clear_errors(tmp_path, secrets, says):
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump({"secrets": secrets}))
    with pytest.raises(ConfigError) as exc:
        load_settings(path)
    assert says in str(exc.value) and OLD not in str(exc.value)


def test_a_short_or_missing_newest_secret_is_refused(monkeypatch):
    monkeypatch.delenv("CWM_TEST_MISSING", raising=False)
    s = Settings.model_validate({"secrets": [{"id": "v1", "env": "CWM_TEST_MISSING"}]})
    with pytest.raises(ConfigError, match="CWM_TEST_MISSING"):
        s.server_secret()
