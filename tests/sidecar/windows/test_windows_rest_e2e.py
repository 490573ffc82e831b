"""Context windows through the sidecar's REST, driven as clients do: the ``openai`` SDK for the
conversation, plain HTTP for the windows API, the ``cwm window`` CLI; a real ``vllm serve``
with the cwm connector behind it, and a second tenant that must see nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from sidecar_helpers import KEYS, SECRET, make_settings

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.e2e
HITS = "vllm:external_prefix_cache_hits"




def sidecar(kv_vllm, store_dir, tiny_model, tmp_path, memory_on: bool = False,
            **over) -> ServerThread:
    settings = make_settings(kv_vllm.base_url, tmp_path / "memory", tiny_model,
                             memory_enabled=memory_on,
                             windows={"store": {"disk_path": str(store_dir)}, "wait_s": 30},
                             **over)
    return ServerThread(create_app(settings)).start()


def chat(client, session: str, messages: list[dict], max_tokens: int = 12):
    return client.chat.completions.create(model="tiny", messages=messages,
                                          max_tokens=max_tokens, temperature=0.0,
                                          extra_headers={"X-Session-Id": session},
                                          extra_body={"return_token_ids": True})


def cold_run(kv_vllm, reply, max_tokens: int = 12) -> list[int]:
    """The greedy tokens of ``reply``'s exact prompt recomputed under a fresh salt."""
    out = kv_vllm.post("/v1/completions", {
        "model": "tiny", "prompt": list(reply.prompt_token_ids), "max_tokens": max_tokens,
        "temperature": 0.0, "cache_salt": f"cold-{time.monotonic_ns()}",
        "return_token_ids": True})
    return out["choices"][0]["token_ids"]


def words(n: int, seed: int) -> str:
    vocab = ["river", "mountain", "coffee", "letter", "garden", "window", "token", "memory"]
    return " ".join(vocab[(i * 7 + seed) % len(vocab)] for i in range(n))


def test_windows_over_rest_are_exact_and_isolated_per_tenant(kv_vllm, store_dir, tiny_model,
                                                             tmp_path):
    from openai import OpenAI

    srv = sidecar(kv_vllm, store_dir, tiny_model, tmp_path, memory_on=True)  # as shipped
    try:
        acme = OpenAI(base_url=f"{srv.url}/v1", api_key=KEYS["acme"])
        history = [{"role": "system", "content": "You are helpful."}]
        for i in range(2):
            history.append({"role": "user", "content": words(250, i)})
            reply = chat(acme, "alice", history).choices[0].message.content
            history.append({"role": "assistant", "content": reply})
        api = httpx.Client(base_url=srv.url, timeout=120,
                           headers={"Authorization": f"Bearer {KEYS['acme']}"})
        rival = httpx.Client(base_url=srv.url, timeout=120,
                             headers={"Authorization": f"Bearer {KEYS['beta']}"})
        r = api.post("/v1/windows", json={"name": "plan", "session": "alice", "tags": ["x"]})
        assert r.status_code == 200, r.text
        frozen = r.json()
        assert frozen["pinned_tokens"] >= 3 * 128 and "salt" not in r.text

        # the other tenant: every operation looks like an unknown window
        assert rival.get("/v1/windows").json()["data"] == []
        for call in (lambda: rival.get("/v1/windows/plan"),
                     lambda: rival.post("/v1/windows/plan/thaw", json={"session": "x"}),
                     lambda: rival.post("/v1/windows/plan/clone", json={"name": "mine"}),
                     lambda: rival.delete("/v1/windows/plan")):
            resp = call()
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
        # clear errors
        bad = api.post("/v1/windows", json={"name": "../x", "session": "alice"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_input"
        taken = api.post("/v1/windows", json={"name": "plan", "session": "alice"})
        assert taken.status_code == 409 and taken.json()["error"]["code"] == "already_exists"

        assert api.post("/v1/windows/plan/clone", json={"name": "plan-b"}).status_code == 200
        listed = api.get("/v1/windows", params={"tag": "x"}).json()
        assert sorted(w["name"] for w in listed["data"]) == ["plan", "plan-b"]
        assert api.get("/v1/windows/plan-b").json()["parent"] == "plan"

        thawed = api.post("/v1/windows/plan-b/thaw", json={"session": "bob", "warm": True})
        assert thawed.status_code == 200, thawed.text
        assert thawed.json()["warm"]["hits"] >= 3 * 128         # vLLM measured the restore
        question = [*history, {"role": "user", "content": "What comes next?"}]
        before = kv_vllm.metric("vllm:prefix_cache_hits")
        reply = chat(acme, "bob", question)
        # the warm-up already loaded the window into vLLM's own cache for bob's salt, and
        # bob's prompt (with the memory the window's conversation had) begins with it
        assert kv_vllm.metric("vllm:prefix_cache_hits") - before >= 3 * 128
        assert list(reply.choices[0].token_ids) == cold_run(kv_vllm, reply)

        out = subprocess.run([sys.executable, "-m", "cwm_plugin.cli", "window", "ls", "--url",
                              srv.url, "--api-key", KEYS["acme"], "--json"],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ})
        assert out.returncode == 0, out.stderr
        assert {w["name"] for w in json.loads(out.stdout)["data"]} == {"plan", "plan-b"}
        assert api.delete("/v1/windows/plan").json()["deleted"]
        assert api.get("/v1/windows/plan-b").json()["restorable_tokens"] == \
            frozen["pinned_tokens"]
        stats = api.get("/v1/cache/stats").json()
        assert stats["tiers"]["disk"]["pinned_bytes"] > 0
        assert {s["session"] for s in api.get("/v1/sessions").json()["data"]} >= {"alice"}
    finally:
        srv.stop()


def test_the_checkpoint_threshold_freezes_the_session_for_real(kv_vllm, store_dir, tiny_model,
                                                               tmp_path):
    from openai import OpenAI

    # the context accounting behind the warning and the checkpoint is the memory's; its
    # background work (a summary at the checkpoint, facts every turn) runs as it ships
    srv = sidecar(kv_vllm, store_dir, tiny_model, tmp_path, memory_on=True,
                  checkpoint={"default": {"warn": 0.2, "checkpoint": 0.3}},
                  memory={"extract_facts": True, "facts_every_turns": 1})
    try:
        acme = OpenAI(base_url=f"{srv.url}/v1", api_key=KEYS["acme"])
        first = [{"role": "user", "content": words(400, 3)}]
        raw = acme.chat.completions.with_raw_response.create(
            model="tiny", max_tokens=4, temperature=0.0, messages=first,
            extra_headers={"X-Session-Id": "dave"})
        assert raw.headers.get("x-cwm-context-warning")
        answer = raw.parse().choices[0].message.content
        api = httpx.Client(base_url=srv.url, timeout=120,
                           headers={"Authorization": f"Bearer {KEYS['acme']}"})
        deadline = time.monotonic() + 90
        autos: list = []
        while not autos and time.monotonic() < deadline:
            autos = api.get("/v1/windows", params={"tag": "auto"}).json()["data"]
            time.sleep(0.5)
        assert autos and autos[0]["name"].startswith("auto-dave-")
        assert autos[0]["session"] == "dave" and autos[0]["pinned_tokens"] >= 128
        assert autos[0]["turn"] == 1          # the client's turn, not the summary's prompt
        check = api.post("/v1/auto_freeze/check", json={"session": "dave"}).json()
        assert check["level"] == "checkpoint" and check["frozen"] is None   # cooling down
        assert SECRET not in json.dumps(check)
        # what it froze thaws into a new session whose next turn restores it
        t = api.post(f"/v1/windows/{autos[0]['name']}/thaw", json={"session": "erin"}).json()
        assert t["messages"] == [*first, {"role": "assistant", "content": answer}]
        nxt = [*t["messages"], {"role": "user", "content": "And then?"}]
        before = kv_vllm.metric(HITS)
        reply = acme.chat.completions.create(
            model="tiny", max_tokens=6, temperature=0.0, messages=nxt,
            extra_headers={"X-Session-Id": "erin"}, extra_body={"return_token_ids": True})
        # every block the window holds, and it holds every full block of its tokens (a partial
        # last block is never stored, so a fraction of its tokens is no bound)
        assert t["restorable_tokens"] == 128 * (t["tokens"] // 128), t
        assert kv_vllm.metric(HITS) - before >= t["restorable_tokens"]
        cold = kv_vllm.post("/v1/completions", {
            "model": "tiny", "prompt": list(reply.prompt_token_ids), "max_tokens": 6,
            "temperature": 0.0, "cache_salt": "cold", "return_token_ids": True})
        assert cold["choices"][0]["token_ids"] == list(reply.choices[0].token_ids)
    finally:
        srv.stop()
