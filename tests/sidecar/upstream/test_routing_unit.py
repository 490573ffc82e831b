"""Routing across several upstreams, over real HTTP: the classifier's decisions, an explicit
model winning, a default upstream while a role's are down, the context limit of the upstream
that answered, background work on its own upstream (failover: ``test_failover_unit.py``).

Each upstream is a small real OpenAI-compatible server (``cwm_plugin.testing.fake_upstream``)
serving one model under its own name, so where a request went is visible in what each one
received.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sidecar_helpers import (
    KEYS,
    chat,
    make_settings,
    metric_value,
    runtime,
    wait_idle,
)

from cwm_plugin.errors import ConfigError
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.settings import DEFAULT_RULES, Settings, load_settings
from cwm_plugin.sidecar.upstream.routing import Classifier
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
TOKENIZER = "tiktoken:cl100k_base"


def ask(text: str, **body: Any) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": text}], **body}


@pytest.mark.parametrize("text,role,why", [
    ("Please implement a function that parses ISO dates", "code", "keyword 'implement'"),
    ("Why does this fail?\n```\nx = 1/0\n```", "code", "pattern '```'"),
    ("Analyze the trade-offs of both plans", "large", "keyword 'analyze'"),
    ("word " * 40_000, "large", "~50002 tokens >= 8000"),  # system + user text / 4
    ("Hello! How is the weather in Chur?", "default", "no rule matched"),
    ("My encoder is broken", "default", "no rule matched"),  # 'code' only as a whole word
])
def test_the_default_rules_route_code_long_and_complex_work(text, role, why):
    d = Classifier(DEFAULT_RULES, ["default", "code", "large"]).classify(ask(text))
    assert d.role == role and why in d.reason, d


def test_rules_for_roles_no_upstream_has_are_inactive_and_conditions_combine():
    only_default = Classifier(DEFAULT_RULES, ["default"])
    assert only_default.classify(ask("implement a function")).role == "default"
    rules = Settings.model_validate({"routing": {"rules": [
        {"role": "tools", "tools": True, "min_messages": 3},
        {"role": "code", "keywords": ["sql"], "min_tokens": 5}]}}).routing.rules
    c = Classifier(rules, ["default", "tools", "code"])
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert c.classify(ask("hi", tools=tools)).role == "default"  # 2 messages, not 3
    long_ask = ask("hi", tools=tools)
    long_ask["messages"].append({"role": "user", "content": "again"})
    assert c.classify(long_ask).role == "tools"
    assert c.classify(ask("sql")).role == "default"  # the keyword, but not 5 tokens
    assert c.classify(ask("write the sql for a monthly report please")).role == "code"


def test_upstreams_inherit_connection_settings_and_bad_routing_is_refused(tmp_path):
    s = Settings.model_validate({
        "upstream": {"url": "http://a", "connect_timeout_s": 7, "api_key_env": "K", "name": "x"},
        "upstreams": [{"name": "a", "url": "http://a"},
                      {"name": "b", "url": "http://b", "connect_timeout_s": 1,
                       "roles": ["code"], "models": ["m"], "context_limit": 4096}]})
    a, b = s.endpoints()
    assert (a.name, a.connect_timeout_s, a.api_key_env, a.roles) == ("a", 7, "K", ["default"])
    assert (b.connect_timeout_s, b.models, b.context_limit) == (1, ["m"], 4096)
    assert Settings().endpoints()[0].name == "default"  # the single `upstream:`
    for bad in ({"upstreams": [{"name": "a"}, {"name": "a"}]},
                {"routing": {"rules": [{"role": "code"}]}},
                {"routing": {"rules": [{"role": "code", "patterns": ["("]}]}},
                {"upstreams": [{"name": "a", "roles": ["bad role"]}]}):
        cfg = tmp_path / "bad.yaml"
        cfg.write_text(json.dumps(bad))
        with pytest.raises(ConfigError):
            load_settings(cfg)


# --- a fleet of upstreams behind one sidecar ------------------------------------------------

@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, tuple[FakeUpstream, ServerThread]]]:
    made = {name: FakeUpstream(model=name, max_model_len=limit)
            for name, limit in (("small", 4096), ("coder", 8192), ("big", 32768))}
    servers = {n: ServerThread(f.app).start() for n, f in made.items()}
    yield {n: (made[n], servers[n]) for n in made}
    for srv in servers.values():
        srv.stop()


def fleet_upstreams(fleet) -> list[dict[str, Any]]:
    return [{"name": "small", "url": fleet["small"][1].url},
            {"name": "coder", "url": fleet["coder"][1].url, "roles": ["code"],
             "models": ["coder"]},
            {"name": "big", "url": fleet["big"][1].url, "roles": ["large"]}]


@pytest.fixture(scope="module")
def routed(fleet, tmp_path_factory) -> Iterator[ServerThread]:
    settings = make_settings(fleet["small"][1].url, tmp_path_factory.mktemp("routed"), TOKENIZER,
                             memory_enabled=False, upstreams=fleet_upstreams(fleet),
                             pricing={"models": {"small": {"input_per_1m": 1e6,
                                                           "output_per_1m": 2e6}}})
    with ServerThread(create_app(settings)) as srv:
        yield srv


def test_auto_is_classified_and_an_explicit_model_wins(fleet, routed):
    cases = [("Please implement a function that parses dates", "auto", "coder"),
             ("Analyze the architecture of this system in depth", "auto", "big"),
             ("Hello, how are you today?", "auto", "small"),
             ("Please implement a function that parses dates", "big", "big"),
             ("Hello again", "coder", "coder")]
    for text, model, where in cases:
        r = chat(routed, "acme", text, model=model, session="route")
        assert r.status_code == 200, r.text
        assert r.headers["x-cwm-upstream"] == where
        assert fleet[where][0].last()["model"] == where  # `auto` replaced by the model
        assert fleet[where][0].last()["messages"][-1]["content"] == text
        assert r.json()["model"] == where
        assert ("x-cwm-route" in r.headers) == (model == "auto")
    r = chat(routed, "acme", "Please implement a function", model="auto", session="route")
    assert r.headers["x-cwm-route"] == "code; rule 1 (code): keyword 'implement'"
    assert metric_value(routed, "cwm_sidecar_routed_requests_total", role="code") == 2
    r = chat(routed, "acme", "hi", model="nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # completions are routed the same way; the model list is every upstream's
    r = httpx.post(f"{routed.url}/v1/completions", headers={"Authorization": f"Bearer "
                   f"{KEYS['acme']}"}, json={"model": "auto", "prompt": "```py\nx = 1\n```"})
    assert r.status_code == 200 and r.headers["x-cwm-upstream"] == "coder"
    models = httpx.get(f"{routed.url}/v1/models", headers={"Authorization": f"Bearer "
                       f"{KEYS['acme']}"}).json()
    assert sorted(m["id"] for m in models["data"]) == ["big", "coder", "small"]


def test_auto_goes_to_a_default_upstream_while_its_roles_are_down(tmp_path):
    main, coder = FakeUpstream(model="small"), FakeUpstream(model="coder")
    with ServerThread(main.app) as m:
        c = ServerThread(coder.app).start()
        settings = make_settings(m.url, tmp_path, TOKENIZER, memory_enabled=False, upstreams=[
            {"name": "small", "url": m.url},
            {"name": "coder", "url": c.url, "roles": ["code"], "models": ["coder"]}],
            routing={"health": {"interval_s": 0}})
        with ServerThread(create_app(settings)) as srv:
            ask_code = "Please implement a function"
            assert chat(srv, "acme", ask_code, model="auto").headers["x-cwm-upstream"] == "coder"
            c.stop()
            # the request that finds it gone: no other upstream serves `coder` (failover stays
            # within a model), a clear 502; from then on `code` goes to a default upstream
            assert chat(srv, "acme", ask_code, model="auto").status_code == 502
            r = chat(srv, "acme", ask_code, model="auto")
            assert r.status_code == 200 and r.headers["x-cwm-upstream"] == "small"
            assert r.headers["x-cwm-route"].endswith("no `code` upstream is up: default")
            assert main.last()["model"] == "small"


def test_usage_is_per_tenant_and_model_priced_and_private(fleet, routed):
    auth = {"Authorization": f"Bearer {KEYS['beta']}"}
    before = httpx.get(f"{routed.url}/v1/usage", headers=auth).json()["total"]
    usages = []
    for text in ("Hello there", "How are you?"):
        r = chat(routed, "beta", text, model="small", session="u1")
        usages.append(r.json()["usage"])
    r = chat(routed, "beta", "Implement a parser", model="auto", session="u1")
    usages.append(r.json()["usage"])
    report = httpx.get(f"{routed.url}/v1/usage", headers=auth).json()
    assert report["principal"] == "beta" and report["currency"] == "USD"
    rows = {r["model"]: r for r in report["data"]}
    assert set(rows) == {"small", "coder"} and before["requests"] == 0
    small = rows["small"]
    assert (small["requests"], small["upstream"], small["kind"]) == (2, "small", "client")
    prompt = sum(u["prompt_tokens"] for u in usages[:2])
    completion = sum(u["completion_tokens"] for u in usages[:2])
    assert (small["prompt_tokens"], small["completion_tokens"]) == (prompt, completion)
    assert small["cost"] == pytest.approx(prompt + 2 * completion)  # 1e6 and 2e6 a million
    assert rows["coder"]["cost"] == 0.0  # no price configured: free
    assert report["total"]["requests"] == 3
    assert metric_value(routed, "cwm_sidecar_cost_total", tenant="beta", model="small",
                        kind="client") == pytest.approx(small["cost"])
    only = httpx.get(f"{routed.url}/v1/usage?model=coder", headers=auth).json()
    assert [r["model"] for r in only["data"]] == ["coder"]
    # another tenant sees none of it; no key, no usage
    gamma = httpx.get(f"{routed.url}/v1/usage",
                      headers={"Authorization": f"Bearer {KEYS['gamma']}"}).json()
    assert gamma["data"] == [] and gamma["total"]["requests"] == 0
    assert httpx.get(f"{routed.url}/v1/usage").status_code == 401


def test_the_context_limit_is_the_answering_upstreams(fleet, tmp_path):
    ups = fleet_upstreams(fleet)
    ups[0]["context_limit"] = 200  # `small` is configured smaller than its max_model_len
    settings = make_settings(fleet["small"][1].url, tmp_path, TOKENIZER, upstreams=ups,
                             checkpoint={"default": {"warn": 0.5, "checkpoint": 0.99}})
    text = " ".join(f"w{i}" for i in range(60))  # ~125 tokens with the chat template
    with ServerThread(create_app(settings)) as srv:
        r = chat(srv, "acme", text, model="small", session="lim")
        real = r.json()["usage"]["prompt_tokens"]  # the fake's own count, after the turn
        warning = r.headers["x-cwm-context-warning"]
        assert warning.startswith("warn; used=0.") and float(warning.split("=")[1]) >= 0.5
        r = chat(srv, "acme", text, model="big", session="lim2")
        assert "x-cwm-context-warning" not in r.headers
        sc = runtime(srv)
        assert sc.tracker.get("acme", "lim").last_limit == 200
        assert sc.tracker.get("acme", "lim2").last_limit == 32768
        assert metric_value(srv, "cwm_sidecar_context_fraction_sum", model="small") == \
            pytest.approx(real / 200)
        wait_idle(srv)


def test_background_work_goes_to_the_background_upstream_and_falls_back(tmp_path):
    main, cheap = FakeUpstream(model="tiny"), FakeUpstream(model="mini")
    with ServerThread(main.app) as m, ServerThread(cheap.app) as c:
        settings = make_settings(m.url, tmp_path, TOKENIZER, upstreams=[
            {"name": "main", "url": m.url},
            {"name": "cheap", "url": c.url, "roles": ["background"]}],
            memory={"summary_every_turns": 1}, routing={"health": {"interval_s": 0}})
        with ServerThread(create_app(settings)) as srv:
            assert chat(srv, "acme", "Remember the blue door", session="bg").status_code == 200
            wait_idle(srv)
            summaries = cheap.bodies()
            assert len(summaries) == 1 and summaries[0]["model"] == "mini"
            assert "running summary" in summaries[0]["messages"][0]["content"]
            assert [b["messages"][-1]["content"] for b in main.bodies()] == \
                ["Remember the blue door"]
            usage = httpx.get(f"{srv.url}/v1/usage",
                              headers={"Authorization": f"Bearer {KEYS['acme']}"}).json()
            kinds = {(r["model"], r["upstream"], r["kind"]) for r in usage["data"]}
            assert kinds == {("tiny", "main", "client"), ("mini", "cheap", "background")}
            c.stop()  # the cheap upstream is gone: the summary is written by the turn's own
            assert chat(srv, "acme", "And the red key", session="bg").status_code == 200
            wait_idle(srv)
            assert len(main.bodies()) == 3 and main.bodies()[-1]["model"] == "tiny"
            assert "running summary" in main.bodies()[-1]["messages"][0]["content"]


def test_the_documented_routing_examples_are_valid():
    """configs/sidecar.yaml: its rules are the defaults, its commented-out upstreams and
    activity examples load as they are written."""
    path = Path(__file__).parents[3] / "configs" / "sidecar.yaml"
    assert load_settings(path).routing.rules == DEFAULT_RULES
    lines = path.read_text().splitlines()

    def block(head: str) -> dict:
        start = lines.index(f"# {head}:")
        body = [f"{head}:"]
        for line in lines[start + 1:]:
            if not line.startswith("#   "):
                break
            body.append(line[2:])
        return yaml.safe_load("\n".join(body))

    s = Settings.model_validate({**block("upstreams"), **block("activity")})
    assert [u.name for u in s.endpoints()] == ["a", "b", "coder", "big", "cheap"]
    assert s.endpoints()[2].context_limit == 32768 and s.activity.read == "shared"
