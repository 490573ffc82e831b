"""Identity: hashed keys, sessions, HMAC salts, the client-salt rule, settings loading."""

from __future__ import annotations

import hashlib
import hmac
import re

import pytest

from cwm_plugin.errors import ConfigError, Forbidden, InvalidInput
from cwm_plugin.sidecar.identity.authenticator import (
    Authenticator,
    Unauthorized,
    bearer_key,
    hash_key,
)
from cwm_plugin.sidecar.settings import Settings, TenantConfig, load_settings

pytestmark = pytest.mark.unit
SECRET = b"unit-test-secret-0123456789"


def auth() -> Authenticator:
    tenants = [TenantConfig(name="acme", key_sha256=[hash_key("key-a")]),
               TenantConfig(name="beta", key_sha256=[hash_key("key-b")],
                            allow_client_cache_salt=True)]
    return Authenticator(tenants, SECRET)


def test_keys_map_to_tenants_and_unknown_keys_are_refused():
    a = auth()
    assert a.tenant_for("key-a").name == "acme"
    assert a.tenant_for("key-b").name == "beta"
    for bad in (None, "", "key-c", "key-a "):
        with pytest.raises(Unauthorized):
            a.tenant_for(bad)
    assert bearer_key({"authorization": "Bearer key-a"}) == "key-a"
    assert bearer_key({"x-api-key": "key-b"}) == "key-b"
    assert "key-a" not in repr(a) and hash_key("key-a") not in repr(a)


def test_salt_is_hmac_of_tenant_and_session_and_differs_per_session():
    a = auth()
    t = a.tenant_for("key-a")
    ident = a.identify(t, {"x-session-id": "s1"}, {})
    want = hmac.new(SECRET, b"acme\x00s1", hashlib.sha256).hexdigest()
    assert ident.cache_salt == want and len(want) == 64
    # a user is part of the salt: ("kv-user", tenant, session, the user's u- name)
    uid = "u-" + hmac.new(SECRET, b"user\x00acme\x00alice", hashlib.sha256).hexdigest()[:32]
    alice = a.identify(t, {"x-session-id": "s1"}, {"user": "alice"})
    assert alice.cache_salt == hmac.new(SECRET, f"kv-user\x00acme\x00s1\x00{uid}".encode(),
                                        hashlib.sha256).hexdigest()
    assert ident.cache_salt not in repr(ident)
    other = a.identify(t, {}, {"user": "s1-other"})
    assert other.session == a.user_session("acme", "s1-other") and other.cache_salt != want
    # neither X-Session-Id nor user: stateless, under the tenant's own salt (no shared session)
    stateless = a.identify(t, {}, {})
    assert stateless.session is None
    assert stateless.cache_salt == hmac.new(SECRET, b"acme\x00", hashlib.sha256).hexdigest()
    shared = Authenticator([TenantConfig(name="acme", key_sha256=[hash_key("key-a")])], SECRET,
                           shared_default=True)
    assert shared.identify(shared.tenant_for("key-a"), {}, {}).session == "default"
    # The same session name under another tenant gets another salt.
    b = a.identify(a.tenant_for("key-b"), {"x-session-id": "s1"}, {})
    assert b.cache_salt != want


@pytest.mark.parametrize("session", ["../etc", "a/b", "..", "x" * 65, "-x", "a\x00b", "a:b", "ok\n"])
def test_bad_session_ids_are_refused(session):
    a = auth()
    with pytest.raises(InvalidInput) as exc:
        a.identify(a.tenant_for("key-a"), {"x-session-id": session}, {})
    assert "session id" in str(exc.value) and exc.value.hint


@pytest.mark.parametrize("user", ["alice@example.com", "../etc", "a/b", "x" * 300,
                                  "Ünïcode user", "a\x00b", "ok\n"])
def test_any_user_string_maps_to_a_safe_stable_private_session(user):
    a = auth()
    acme = a.tenant_for("key-a")
    ident = a.identify(acme, {}, {"user": user})
    assert re.fullmatch(r"u-[0-9a-f]{32}", ident.session)
    assert a.identify(acme, {}, {"user": user}) == ident  # stable
    assert a.identify(acme, {}, {"user": user + "!"}).session != ident.session
    assert a.identify(a.tenant_for("key-b"), {}, {"user": user}).session != ident.session
    plain = hashlib.sha256(user.encode()).hexdigest()
    assert plain[:32] not in ident.session  # keyed: the address cannot be guessed back
    # X-Session-Id wins over user
    assert a.identify(acme, {"x-session-id": "s1"}, {"user": user}).session == "s1"


@pytest.mark.parametrize("user", ["", 42, ["x"], "x" * 1025])
def test_a_user_that_is_not_a_string_is_refused(user):
    a = auth()
    with pytest.raises(InvalidInput) as exc:
        a.identify(a.tenant_for("key-a"), {}, {"user": user})
    assert "`user`" in str(exc.value)


def test_client_cache_salt_needs_permission():
    a = auth()
    acme = a.identify(a.tenant_for("key-a"), {}, {})
    with pytest.raises(Forbidden):
        a.salt_for(acme, {"cache_salt": "mine"})
    assert a.salt_for(acme, {}) == acme.cache_salt
    beta = a.identify(a.tenant_for("key-b"), {}, {})
    # forwarded as HMAC(secret, "client", tenant, salt): another tenant's "mine" is another salt
    got = a.salt_for(beta, {"cache_salt": "mine"})
    assert got == hmac.new(SECRET, b"client\x00beta\x00mine", hashlib.sha256).hexdigest()
    assert got != "mine" and got != a.client_salt("acme", "mine")
    with pytest.raises(InvalidInput):
        a.salt_for(beta, {"cache_salt": ""})


def test_settings_validation_never_echoes_the_secret(tmp_path, monkeypatch):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("secret: short-but-secret-value\ntenants:\n  - name: ../x\n    key_sha256: [abc]\n")
    with pytest.raises(ConfigError) as exc:
        load_settings(cfg)
    assert "short-but-secret-value" not in str(exc.value)
    cfg.write_text(f"tenants:\n  - name: acme\n    key_sha256: ['{hash_key('k')}']\n"
                   "memory:\n  root: mem\n")
    s = load_settings(cfg)
    assert s.memory.root == (tmp_path / "mem").resolve()
    monkeypatch.delenv("CWM_SIDECAR_SECRET", raising=False)
    with pytest.raises(ConfigError):
        s.server_secret()
    monkeypatch.setenv("CWM_SIDECAR_SECRET", "x" * 32)
    assert s.server_secret() == b"x" * 32
    assert "x" * 32 not in repr(Settings(secret="y" * 32))


def test_the_documented_example_config_loads():
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / "configs" / "sidecar.yaml"
    s = load_settings(example)
    assert [t.name for t in s.tenants] == ["acme", "beta"]
    assert (s.prompt.history, s.prompt.placement, s.prompt.refresh) == \
        ("full", "system", "conversation")
    assert s.prompt.sessionless == "stateless" and s.upstream.key() is None
    assert s.checkpoint.for_model("smollm2").checkpoint == 0.80
    assert s.checkpoint.for_model("other").warn == 0.70


def test_search_settings_from_yaml_reach_the_memory_service(tmp_path, monkeypatch):
    from cwm_plugin.sidecar.app import create_app

    cfg = tmp_path / "s.yaml"
    cfg.write_text(f"""
secret: "{'s' * 32}"
tenants: [{{name: acme, key_sha256: ['{hash_key('k')}']}}]
memory:
  root: mem
  embedder: {{kind: hashing}}
  chunk_tokens: 120
  chunk_overlap: 20
  search: {{bm25_weight: 0.2, vector_weight: 0.8, chunk_vector_weight: 0.0,
            candidate_multiplier: 7, mmr_lambda: 0.6, recency_half_life_days: 10,
            max_facts: 3}}
""")
    app = create_app(load_settings(cfg))
    c = app.state.sidecar.memory.service.config
    assert (c.bm25_weight, c.vector_weight, c.chunk_vector_weight, c.candidate_multiplier,
            c.mmr_lambda, c.recency_half_life_days, c.max_facts) == (0.2, 0.8, 0.0, 7, 0.6,
                                                                    10.0, 3)
    assert (c.chunk_tokens, c.chunk_overlap) == (120, 20)
    cfg.write_text(cfg.read_text().replace("max_facts: 3", "max_facts: 3, typo: 1"))
    with pytest.raises(ConfigError) as exc:
        load_settings(cfg)
    assert "memory.search.typo" in str(exc.value)


def test_a_user_acts_in_its_own_namespace_header_first():
    a = auth()
    acme = a.tenant_for("key-a")
    plain = a.identify(acme, {"x-session-id": "s1"}, {})
    assert (plain.namespace, plain.folder, plain.user) == ("acme", "acme", None)
    ident = a.identify(acme, {"x-cwm-user": "alice"}, {"user": "bob"})
    assert ident.user == "alice" and ident.namespace == "acme/user"
    assert ident.folder == ident.session == a.user_session("acme", "alice")
    assert "alice" not in repr(ident)
    # X-Session-Id names the session; the user still decides the namespace
    both = a.identify(acme, {"x-session-id": "s1", "x-cwm-user": "alice"}, {})
    assert (both.session, both.folder) == ("s1", ident.folder)
    bob = a.identify(acme, {"x-session-id": "s1", "x-cwm-user": "bob"}, {})
    # the user is part of the salt: users sending one X-Session-Id never share KV ...
    assert len({both.cache_salt, bob.cache_salt, plain.cache_salt}) == 3
    # ... unless their tenant shares it on purpose (a tenant-wide shared prefix)
    shared = Authenticator([TenantConfig(name="acme", key_sha256=[hash_key("key-a")],
                                         users_share_kv=True)], SECRET)
    t = shared.tenant_for("key-a")
    assert shared.identify(t, {"x-session-id": "s1", "x-cwm-user": "alice"}, {}).cache_salt \
        == shared.identify(t, {"x-session-id": "s1", "x-cwm-user": "bob"}, {}).cache_salt \
        == plain.cache_salt
    with pytest.raises(InvalidInput):
        a.identify(acme, {"x-cwm-user": ""}, {})


def test_an_owner_is_a_tenant_or_one_of_its_users_written_by_one_rule():
    """Windows, sessions, activity chains and usage rows name their owner the same way:
    ``cwm_plugin.salts`` writes and reads it, and a request's owner is that rule's."""
    from cwm_plugin.salts import owner_of, owner_salt, tenant_of, user_of
    from cwm_plugin.sidecar.identity.authenticator import owner_of as owner_of_request

    a = auth()
    t = a.tenant_for("key-a")
    alice = a.identify(t, {"x-session-id": "s1"}, {"user": "alice"})
    folder = a.user_session("acme", "alice")
    assert owner_of_request(alice) == owner_of("acme", folder) == f"acme/{folder}"
    assert owner_of_request(a.identify(t, {"x-session-id": "s1"}, {})) == owner_of("acme")
    assert (tenant_of(owner_of("acme", folder)), user_of(owner_of("acme", folder))) == \
        ("acme", folder)
    assert (tenant_of("acme"), user_of("acme")) == ("acme", None)
    assert owner_salt(owner_of("acme", folder), "s1") == ("acme", "s1", folder)
