"""The sidecar against a scripted upstream on loopback: the running summary is incremental, a
checkpoint never holds up the client, one session's jobs never overlap, connect errors are retried,
and the prompt keeps its prefix once and its mid-conversation instructions. The upstream is a small
real HTTP server that answers like vLLM (the model's wisdom is not under test here, what the sidecar
sends it is)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from sidecar_helpers import chat, make_settings, metric_value, runtime, scripted_app, wait_idle

from cwm_plugin.memory.tokens import make_counter
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.procs import free_port
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
COUNTER = make_counter("tiktoken:cl100k_base")


class Scripted:
    """Answers chats with "ok" (usage counted like the sidecar counts), summaries with
    "SUMMARY n" after ``summary_delay`` seconds; records summary requests and their times."""

    def __init__(self, summary_delay: float = 0.0) -> None:
        self.summary_delay = summary_delay
        self.summaries: list[dict] = []
        self.chats: list[dict] = []
        self.spans: list[tuple[float, float]] = []
        self.app = scripted_app(self.answer, lambda body: {
            "prompt_tokens": COUNTER.count_chat(body["messages"]), "completion_tokens": 1,
            "total_tokens": 0})

    async def answer(self, body: dict) -> str:
        if body["messages"][0]["content"].startswith("You maintain a running summary"):
            t0 = time.monotonic()
            await asyncio.sleep(self.summary_delay)
            self.summaries.append(body)
            self.spans.append((t0, time.monotonic()))
            return f"SUMMARY {len(self.summaries)}"
        self.chats.append(body)
        return "ok"

def sidecar(up_url: str, root, **over) -> ServerThread:
    return ServerThread(create_app(make_settings(up_url, root, "tiktoken:cl100k_base", **over)))


def test_the_summary_is_updated_from_the_turns_after_the_last_one_it_covers(tmp_path):
    up = Scripted()
    with ServerThread(up.app) as u, sidecar(u.url, tmp_path,
                                            memory={"summary_every_turns": 2}) as srv:
        said = [f"Turn {i}: I visited city number {i} and liked it." for i in range(1, 5)]
        for text in said:
            assert chat(srv, "acme", text, session="inc").status_code == 200
            wait_idle(srv)
        assert len(up.summaries) == 2
        first, second = (b["messages"][1]["content"] for b in up.summaries)
        assert "Previous summary" not in first and said[0] in first and said[1] in first
        assert second.startswith("Previous summary:\nSUMMARY 1\n")
        assert said[2] in second and said[3] in second  # only what came after
        assert said[0] not in second and said[1] not in second
        svc = runtime(srv).memory.service
        turns = svc.transcript("acme", "inc")
        summary, upto = svc.summary_state("acme", "inc")  # the model's text, then the
        assert summary.startswith("SUMMARY 2\n\nKept from the conversation:")  # details
        assert upto == turns[-1]["turn_id"]
        assert metric_value(srv, "cwm_sidecar_background_tasks_total", tenant="acme",
                            kind="summary", outcome="ok") == 2


def test_a_backlog_longer_than_the_budget_is_summarised_in_order_without_gaps(tmp_path):
    up = Scripted()
    with ServerThread(up.app) as u, sidecar(u.url, tmp_path, memory={
            "summary_every_turns": 4, "background_max_tokens": 900}) as srv:
        said = [f"Turn {i}: the train to town {i} left on time." for i in range(1, 5)]
        for text in said:
            assert chat(srv, "acme", text, session="big").status_code == 200
        wait_idle(srv)
        assert len(up.summaries) >= 3  # half the context minus 900 fits a few lines a call
        seen: list[str] = []
        for i, body in enumerate(up.summaries):
            content = body["messages"][1]["content"]
            if i:
                assert content.startswith(f"Previous summary:\nSUMMARY {i}\n")
            convo = content.split("Conversation:\n", 1)[1].rsplit("\n\nWrite", 1)[0]
            seen += convo.split("\n")
        turns = runtime(srv).memory.service.transcript("acme", "big")
        assert seen == [f"{t['role']}: {t['content']}" for t in turns]  # each once, in order


def test_a_checkpoint_never_holds_up_the_client_and_jobs_do_not_overlap(tmp_path):
    up = Scripted(summary_delay=4.0)
    thresholds = {"default": {"warn": 0.002, "checkpoint": 0.004, "keep_turns": 1}}
    hooks: list[str] = []
    with ServerThread(up.app) as u, sidecar(u.url, tmp_path, checkpoint=thresholds,
                                            memory={"summary_every_turns": 1}) as srv:
        runtime(srv).snapshot_hook = lambda t, s, salt, name: hooks.append(name)
        history = [{"role": "user", "content": "We talked about the Bernina pass in winter."}]
        r = chat(srv, "acme", history, session="cp")
        assert r.status_code == 200 and r.headers["X-CWM-Context-Warning"].startswith("check")
        history += [{"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "And the Albula line?"}]
        r = chat(srv, "acme", history, session="cp")
        # answered while the checkpoint's summary is still being written; the session is
        # compacted once it is there (not before: the prefix then changes only once)
        state = runtime(srv).tracker.get("acme", "cp")
        assert r.status_code == 200 and runtime(srv).background.pending >= 1
        assert state.checkpointing and not state.compacted
        wait_idle(srv)
        assert metric_value(srv, "cwm_sidecar_checkpoints_total", tenant="acme") == 1
        assert hooks == ["auto-cp-1"] and state.compaction_due
        (a0, a1), (b0, b1) = up.spans
        assert a1 <= b0  # the second job of the session (a summary) waited for the first
        # the second summary built on the first: incremental, not from scratch
        assert up.summaries[1]["messages"][1]["content"].startswith(
            "Previous summary:\nSUMMARY 1")
        history += [{"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "Which one is older?"}]
        assert chat(srv, "acme", history, session="cp").status_code == 200
        assert state.compacted  # with the summary written by then, the last exchange kept
        sent = up.chats[-1]["messages"]
        assert "SUMMARY 2" in sent[0]["content"] and sent[1:] == history[-3:]  # the newest


def test_connect_errors_are_retried_until_the_upstream_is_up(tmp_path):
    up = Scripted()
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    with sidecar(upstream, tmp_path / "a", upstream={"connect_retries": 0}) as srv:
        r = chat(srv, "acme", "hello", session="r0")
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
    late = ServerThread(up.app, port=port)
    starter = threading.Timer(0.3, late.start)
    with sidecar(upstream, tmp_path / "b", upstream={"connect_retries": 6}) as srv:
        starter.start()
        try:
            r = chat(srv, "acme", "hello", session="r1")  # refused at first, then retried
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "ok"
        finally:
            starter.join()
            late.stop()
    assert [t["content"] for t in runtime(srv).memory.service.transcript("acme", "r1")] == \
        ["hello", "ok"]


def test_prefix_messages_are_sent_once_and_instructions_mid_conversation_are_kept(tmp_path):
    up = Scripted()
    prefix = [{"role": "system", "content": "You are a travel desk."},
              {"role": "developer", "content": "Answer in one sentence."}]
    mid = {"role": "system", "content": "The user now prefers answers in German."}
    talk = [{"role": r, "content": f"{r} message {i}"} for i in range(6)
            for r in ("user", "assistant")]
    messages = [*prefix, *talk[:2], mid, *talk[2:], {"role": "user", "content": "Und jetzt?"}]
    with ServerThread(up.app) as u, sidecar(u.url, tmp_path) as srv:
        r = chat(srv, "acme", messages, session="dev")
        assert r.status_code == 200, r.text
        assert up.chats[-1]["messages"] == messages  # full history (the default): as sent
        r = chat(srv, "acme", messages, session="dev2", headers={"X-CWM-History": "recent"})
        assert r.status_code == 200, r.text
    sent = up.chats[-1]["messages"]  # the token-saving mode, asked for by this request
    # the stable prefix, once, in place (memory merged at the end of the system message)
    assert sent[0]["content"].startswith(prefix[0]["content"]) and sent[1] == prefix[1]
    assert sum(m == prefix[1] for m in sent) == 1
    assert [m["role"] for m in sent].count("system") == 2  # the prefix's and `mid`
    assert mid in sent  # older than the recent window, but an instruction: pinned
    assert sent[-7:] == messages[-7:]  # the last six history messages and the new one
    assert len(sent) == 2 + 1 + 7
