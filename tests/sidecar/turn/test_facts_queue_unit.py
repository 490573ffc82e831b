"""Fact extraction and the bounded background queue against a scripted upstream on loopback
(real HTTP; the model's wisdom is not under test here, what the sidecar sends it and does
with its answers is): facts come from the transcript after a cursor, with the known facts'
keys, merged with their source; the queue holds at most ``background_queue_limit`` jobs,
merges a session's jobs, drops (and counts) the rest, and the work dropped is done later; each
tenant is sure of its share of the queue, however much another queues."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from sidecar_helpers import chat, make_settings, metric_value, runtime, scripted_app, wait_idle

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.background.queue import Background, Job
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit


class FactsUpstream:
    """Chats answer "ok"; fact extractions answer ``answers`` in turn (then "[]") once
    ``gate`` is set; every extraction request is kept."""

    def __init__(self, answers: list[list[dict]]) -> None:
        self.answers = list(answers)
        self.extractions: list[dict] = []
        self.gate = threading.Event()
        self.gate.set()
        self.app = scripted_app(self.answer, lambda body: {
            "prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107})

    async def answer(self, body: dict) -> str:
        if body["messages"][0]["content"].startswith("Extract durable facts"):
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
            self.extractions.append(body)
            return json.dumps(self.answers.pop(0) if self.answers else [])
        return "ok"

def sidecar(url: str, root, **memory) -> ServerThread:
    return ServerThread(create_app(make_settings(url, root, "tiktoken:cl100k_base", memory={
        "extract_facts": True, "facts_every_turns": 4, **memory})))


def user_turns(extraction: dict) -> str:
    return extraction["messages"][1]["content"]


def test_facts_come_from_the_turns_after_the_cursor_with_known_keys_and_sources(tmp_path):
    up = FactsUpstream([
        [{"text": "The user lives in Lisbon.", "category": "fact", "importance": 0.6,
          "key": "home city"}],
        [{"text": "The user lives in Lisbon.", "category": "fact", "importance": 0.8,
          "key": "home city"}],
    ])
    with ServerThread(up.app) as u, sidecar(u.url, tmp_path) as srv:
        assert chat(srv, "acme", "I live in Lisbon.", session="a").status_code == 200
        wait_idle(srv)
        assert not up.extractions  # two turns recorded: not due yet (every 4)
        assert chat(srv, "acme", "It is sunny here.", session="a").status_code == 200
        wait_idle(srv)
        assert len(up.extractions) == 1
        first = up.extractions[0]
        assert first["response_format"]["type"] == "json_schema"  # structured outputs
        schema = first["response_format"]["json_schema"]["schema"]
        assert list(schema["items"]["properties"])[0] == "text"
        assert "I live in Lisbon." in user_turns(first) and "Known facts" not in user_turns(first)
        svc = runtime(srv).memory.service
        turns = svc.transcript("acme", "a")
        (m,) = svc.memories("acme")
        assert m.key == "home city"
        assert m.source == f"session:a#{turns[0]['turn_id']}..{turns[-1]['turn_id']}"
        for text in ("Still in Lisbon.", "Yes."):
            assert chat(srv, "acme", text, session="a").status_code == 200
        wait_idle(srv)
        second = user_turns(up.extractions[1])
        assert "[home city] The user lives in Lisbon." in second  # the known fact, its key
        assert "Still in Lisbon." in second and "I live in Lisbon." not in second  # cursor
        assert len(svc.memories("acme")) == 1  # the same fact again: a duplicate
        assert svc.memories("acme")[0].importance == 0.8
        assert metric_value(srv, "cwm_sidecar_facts_total", tenant="acme",
                            outcome="duplicate") == 1
        assert metric_value(srv, "cwm_sidecar_background_tokens_total", tenant="acme",
                            kind="facts", type="prompt") == 200
        assert metric_value(srv, "cwm_sidecar_background_tokens_total", tenant="acme",
                            kind="facts", type="completion") == 14


def test_the_queue_is_bounded_merges_per_session_and_drops_the_rest(tmp_path):
    up = FactsUpstream([])
    up.gate.clear()  # extractions wait: jobs pile up while clients are answered
    with ServerThread(up.app) as u, sidecar(u.url, tmp_path, facts_every_turns=2,
                                            background_queue_limit=2) as srv:
        bg = runtime(srv).background
        sessions = ["s1", "s2", "s3", "s4"]
        for s in sessions:  # s1 runs (blocked), s2 and s3 wait, s4 is dropped
            assert chat(srv, "acme", f"hello from {s}", session=s).status_code == 200
        assert chat(srv, "acme", "again", session="s2").status_code == 200  # merged
        assert bg.depth <= 3  # one running + at most `limit` waiting
        assert metric_value(srv, "cwm_sidecar_background_jobs_total", outcome="dropped") == 1
        assert metric_value(srv, "cwm_sidecar_background_jobs_total", outcome="merged") == 1
        assert metric_value(srv, "cwm_sidecar_background_queue_depth") == bg.depth
        up.gate.set()
        wait_idle(srv)
        done = {user_turns(b).split("hello from ")[1].split("\n")[0] for b in up.extractions}
        assert done == {"s1", "s2", "s3"}
        # the dropped session's turns were not lost: its next turn queues them again
        assert chat(srv, "acme", "me again", session="s4").status_code == 200
        wait_idle(srv)
        last = user_turns(up.extractions[-1])
        assert "hello from s4" in last and "me again" in last
        assert metric_value(srv, "cwm_sidecar_background_queue_depth") == 0


def test_a_tenant_flooding_the_queue_never_drops_another_tenants_job(tmp_path, caplog):
    """Each tenant is sure of its share of the queue (4 // 3 principals: 1): acme's backlog
    fills the queue, beta's one job still gets a place (acme's newest gives it up, acme's next
    is dropped, not beta's) and runs next, before acme's backlog; acme's turns are not lost."""
    up = FactsUpstream([])
    up.gate.clear()  # extractions wait: jobs pile up while clients are answered
    with ServerThread(up.app) as u, sidecar(u.url, tmp_path, facts_every_turns=2,
                                            background_queue_limit=4) as srv:
        bg = runtime(srv).background
        for s in ["a1", "a2", "a3", "a4", "a5", "a6"]:  # a1 runs, a2-a5 wait, a6 dropped
            assert chat(srv, "acme", f"hello from {s}", session=s).status_code == 200
        assert chat(srv, "beta", "hello from b1", session="b1").status_code == 200
        assert chat(srv, "acme", "hello from a7", session="a7").status_code == 200
        assert bg.depth == 5  # one running + `limit` waiting
        assert metric_value(srv, "cwm_sidecar_background_jobs_total", outcome="dropped") == 3
        up.gate.set()
        wait_idle(srv)
        done = [user_turns(b).split("hello from ")[1].split("\n")[0] for b in up.extractions]
        assert done == ["a1", "b1", "a2", "a3", "a4"]
        full = [r for r in caplog.records if "background queue full" in r.getMessage()]
        assert len(full) == 1 and "acme" in full[0].getMessage()  # logged once, not per drop
        # a dropped session's turns wait for its next turn
        assert chat(srv, "acme", "me again", session="a5").status_code == 200
        wait_idle(srv)
        assert "hello from a5" in user_turns(up.extractions[-1])


def test_a_waiting_checkpoint_is_never_given_up_for_another_tenant():
    """A tenant under its share takes the place of the newest waiting job of the tenant over
    it that is not a checkpoint (a checkpoint dropped would leave its session uncompacted)."""
    async def scenario() -> tuple[list[str], list[str]]:
        ran: list[str] = []
        gate = asyncio.Event()

        async def run(job: Job) -> None:
            await gate.wait()
            ran.append(job.info["name"])

        bg = Background(limit=3, share=1)
        outcomes = [bg.submit("acme", ("acme", name),
                              Job(run, checkpoint=name.startswith("c"), info={"name": name}),
                              force=name.startswith("c"))  # a checkpoint is always queued
                    for name in ("a0", "a1", "a2", "c3")]  # a0 is taken by the worker
        await asyncio.sleep(0)
        outcomes += [bg.submit("acme", ("acme", "a4"), Job(run, info={"name": "a4"})),
                     bg.submit("beta", ("beta", "b0"), Job(run, info={"name": "b0"})),
                     bg.submit("gamma", ("gamma", "g0"), Job(run, info={"name": "g0"})),
                     bg.submit("gamma", ("gamma", "g1"), Job(run, info={"name": "g1"}))]
        gate.set()
        await bg.drain()
        await bg.close()
        return outcomes, ran

    outcomes, ran = asyncio.run(scenario())
    assert outcomes == ["queued"] * 4 + ["dropped", "queued", "queued", "dropped"]
    assert ran == ["a0", "b0", "g0", "c3"]  # a1 and a2 gave their places up, c3 did not


def test_shares_that_do_not_fit_the_queue_are_refused(tmp_path):
    with pytest.raises(ValueError, match="background_tenant_share 30 is over"):
        make_settings("http://127.0.0.1:9", tmp_path, "tiktoken:cl100k_base",
                      memory={"background_tenant_share": 30})
