"""The memory re-ranker (``memory.rerank``) over real HTTP: the sidecar asks the model server to
judge its best memory lines against the question and injects what the judge ranks first; a
judge that fails leaves the first ranking and the turn answers all the same.

The fake upstream stands in for the model: its ``judge`` says "yes" to the one line that shares
no word with the question, which the first ranking puts below what a small budget holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sidecar_helpers import ADMIN, chat, make_settings, wait_idle

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.turn.rerank import INSTRUCTION, yes_no_score
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
QUESTION = "What activities does Melanie enjoy?"
EVIDENCE = "I'm off to go swimming with the kids."
DISTRACTORS = [f"Melanie here: the activities list for {d} has nothing I enjoy."
               for d in ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")]


def judged(prompt: str) -> float:
    return 0.95 if "swimming" in prompt.rsplit("Line:", 1)[-1] else 0.05


@contextmanager
def sidecar(tmp: Path, rerank: dict | None, judge=judged) -> Iterator[tuple[ServerThread,
                                                                           FakeUpstream]]:
    fake = FakeUpstream(model="tiny", max_model_len=4096)
    fake.judge = judge
    memory = {"budget_tokens": 60, "recent_turns": 0, **({"rerank": rerank} if rerank else {})}
    with ServerThread(fake.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp, "tiktoken:cl100k_base", memory={
                "root": str(tmp), "tokenizer": "tiktoken:cl100k_base",
                "embedder": {"kind": "hashing"}, "summary_every_turns": 0,
                "extract_facts": False, **memory}))) as srv:
        for line in [*DISTRACTORS[:3], EVIDENCE, *DISTRACTORS[3:]]:
            assert chat(srv, "acme", line, session="old").status_code == 200
        wait_idle(srv)
        yield srv, fake


def injected(fake: FakeUpstream) -> str:
    first = fake.last()["messages"][0]
    return first["content"] if first["role"] == "system" else ""


def degraded(srv: ServerThread) -> float:
    text = httpx.get(f"{srv.url}/metrics", headers=ADMIN, timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "cwm_memory_degraded_total" and s.labels.get("what") == "rerank")


def test_without_a_reranker_the_line_sharing_no_word_is_left_out(tmp_path: Path) -> None:
    """The control: the first ranking fills the small budget with the distractors."""
    with sidecar(tmp_path, None) as (srv, fake):
        assert chat(srv, "acme", QUESTION, session="new").status_code == 200
        block = injected(fake)
        assert "activities list" in block and "swimming" not in block
        assert not fake.bodies("/v1/completions")


def test_the_served_model_judges_the_best_lines_and_its_pick_is_injected(
        tmp_path: Path) -> None:
    with sidecar(tmp_path, {"kind": "completions", "top_n": 20}) as (srv, fake):
        before = len(fake.bodies("/v1/completions"))  # (the seeding turns were re-ranked too)
        r = chat(srv, "acme", QUESTION, session="new")
        assert r.status_code == 200
        assert "swimming" in injected(fake)
        asked = fake.bodies("/v1/completions")[before:]
        assert len(asked) == 1
        body, chat_body = asked[0], fake.last()
        head = INSTRUCTION.format(query=QUESTION)
        assert len(body["prompt"]) >= 7 and all(p.startswith(head) for p in body["prompt"])
        assert any(EVIDENCE in p for p in body["prompt"])
        # the tenant's salt (its KV stays its own), one token, the top log-probabilities
        assert body["cache_salt"] == chat_body["cache_salt"]
        assert body["max_tokens"] == 1 and body["logprobs"] >= 2 and body["model"] == "tiny"
        text = httpx.get(f"{srv.url}/metrics", headers=ADMIN, timeout=30).text
        assert 'cwm_sidecar_rerank_tokens_total{model="tiny",tenant="acme"}' in text
        assert degraded(srv) == 0


def test_a_served_reranker_is_asked_on_its_endpoint(tmp_path: Path) -> None:
    with sidecar(tmp_path, {"kind": "rerank"},
                 judge=lambda doc: 0.9 if "swimming" in doc else 0.1) as (srv, fake):
        assert chat(srv, "acme", QUESTION, session="new").status_code == 200
        asked = fake.bodies("/v1/rerank")
        assert asked[-1]["query"] == QUESTION and EVIDENCE in str(asked[-1]["documents"])
        assert "swimming" in injected(fake)


def test_a_failing_reranker_leaves_the_first_ranking_and_the_turn_answers(
        tmp_path: Path) -> None:
    def broken(prompt: str) -> float:
        raise RuntimeError("the judge is down")

    with sidecar(tmp_path, {"kind": "completions"}, judge=broken) as (srv, fake):
        before = degraded(srv)  # (the seeding turns' failed too)
        for i in range(2):  # (two conversations: one pins its memory block for its turns)
            r = chat(srv, "acme", QUESTION, session=f"new{i}")
            assert r.status_code == 200 and "X-CWM-Memory-Status" not in r.headers
            block = injected(fake)
            assert "activities list" in block and "swimming" not in block
        assert degraded(srv) == before + 2


def test_a_model_no_upstream_serves_degrades_the_same_way(tmp_path: Path) -> None:
    with sidecar(tmp_path, {"kind": "completions", "model": "no-such-model"}) as (srv, fake):
        before = degraded(srv)
        assert chat(srv, "acme", QUESTION, session="new").status_code == 200
        assert "swimming" not in injected(fake) and degraded(srv) == before + 1


@pytest.mark.parametrize("top, score", [
    ({" yes": -0.1, " no": -2.4}, 2.3),
    ({"Yes": -1.0, " yes": -1.0, " no": -0.5}, -1.0 + 0.693 + 0.5),
    ({" no": -0.2, " maybe": -3.0}, -4.0 + 0.2),  # yes not among them: below the least
    ({}, 0.0),
])
def test_yes_no_score(top: dict[str, float], score: float) -> None:
    assert yes_no_score(top) == pytest.approx(score, abs=1e-3)
