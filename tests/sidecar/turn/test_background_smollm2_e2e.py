"""Summaries and facts written by a real model (SmolLM2-135M-Instruct) served by real
``vllm serve``, through the real sidecar over HTTP, with a real relay recording what vLLM was
sent. Nothing here checks the model's wording: structure, validity, provenance, retrieval
and injection."""

from __future__ import annotations

import pytest
from sidecar_helpers import KEYS, Recorder, chat, make_settings, metric_value, runtime, wait_idle

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BUDGET = 200  # memory budget: a few lines of transcript, or a fact and a few lines

RECIPES = [  # an imported session about cooking: it outranks the allergy for a dinner question
    ("user", "What should I cook for dinner tonight? Something quick."),
    ("assistant", "A quick dinner recipe: garlic butter pasta with spinach, ready in 15 minutes."),
    ("user", "I like a dinner recipe with chicken and rice for weeknights."),
    ("assistant", "Chicken and rice dinner: brown the chicken, add rice and stock, simmer."),
    ("user", "Any dinner recipe with noodles? I love Thai food for dinner."),
    ("assistant", "Pad thai dinner recipe: rice noodles, egg, tofu, bean sprouts, lime."),
    ("user", "What about a vegetarian dinner recipe for tonight?"),
    ("assistant", "Vegetarian dinner: a chickpea curry recipe with coconut milk and rice."),
    ("user", "Can you suggest a dinner recipe my kids will eat tonight?"),
    ("assistant", "Kids' dinner recipe: homemade pizza on flatbread with tomato and cheese."),
    ("user", "Suggest a recipe for a dinner party with friends."),
    ("assistant", "Dinner party recipe: roast salmon with lemon, potatoes and green beans."),
]
STATEMENT = "By the way, I am severely allergic to peanuts, so please always keep that in mind."
QUESTION = "Can you suggest a recipe for dinner tonight?"


def test_a_fact_from_one_session_is_extracted_stored_and_injected_into_a_later_one(
        smollm2_vllm, smollm2_model, tmp_path):
    rec = Recorder(smollm2_vllm.base_url)
    with ServerThread(rec.app) as relay:
        settings = make_settings(relay.url, tmp_path, smollm2_model, memory={
            "extract_facts": True, "structured_facts": True, "facts_every_turns": 2,
            "budget_tokens": BUDGET, "embedder": {"kind": "local"}})
        with ServerThread(create_app(settings)) as srv:
            svc = runtime(srv).memory.service
            svc.record_turns("acme", "recipes", RECIPES)  # history imported earlier
            r = chat(srv, "acme", STATEMENT, session="a", model="smollm2", max_tokens=24)
            assert r.status_code == 200, r.text
            said = svc.transcript("acme", "a")[0]
            wait_idle(srv)

            # extracted through vLLM's structured outputs: valid on the first try, stored
            extraction = rec.last(where=lambda b: "response_format" in b)
            assert extraction["response_format"]["type"] == "json_schema"
            assert metric_value(srv, "cwm_sidecar_facts_refused_total", tenant="acme") == 0
            assert metric_value(srv, "cwm_sidecar_background_tasks_total", tenant="acme",
                                kind="facts", outcome="ok") == 1
            assert metric_value(srv, "cwm_sidecar_background_tokens_total", tenant="acme",
                                kind="facts", type="completion") > 0
            facts = [m for m in svc.memories("acme") if m.source.startswith("session:a#")]
            assert facts, "no fact extracted from the statement"
            assert said["turn_id"] in facts[0].source
            assert svc.files.scan_memories("acme")[1] == []  # every line of memories.md valid
            print(f"\nfacts: {[(m.key, m.text) for m in facts]}")

            # transcript search alone does not bring the statement within the budget ...
            ask = [{"role": "user", "content": QUESTION}]
            svc.config.max_facts = 0
            try:
                alone = svc.select_context("acme", "b", ask, BUDGET, summary=False, bump=False)
            finally:
                svc.config.max_facts = 8
            assert alone.hits and not any(said["turn_id"] in h.turn_ids for h in alone.hits)

            # ... but the fact is injected into the later session's prompt
            r = chat(srv, "acme", QUESTION, session="b", model="smollm2", max_tokens=16,
                     debug=True)
            assert r.status_code == 200, r.text
            sent = rec.last(where=lambda b: b.get("messages") and
                            b["messages"][-1]["content"] == QUESTION)
            system = sent["messages"][0]
            assert system["role"] == "system"
            assert any(m.text in system["content"] for m in facts)
            assert '"facts":' in r.headers["X-CWM-Memory"]
            assert KEYS["acme"] not in str(sent)


def test_a_summary_is_written_and_facts_are_valid(smollm2_vllm, smollm2_model, tmp_path):
    settings = make_settings(smollm2_vllm.base_url, tmp_path, smollm2_model,
                             memory={"summary_every_turns": 2, "extract_facts": True,
                                     "facts_every_turns": 4})
    with ServerThread(create_app(settings)) as srv:
        svc = runtime(srv).memory.service
        said = ["Hi! My name is Maria and I live in Lisbon.",
                "I work as a nurse and I love playing the cello on weekends."]
        for text in said:
            r = chat(srv, "acme", text, session="bio", model="smollm2", max_tokens=40)
            assert r.status_code == 200, r.text
        wait_idle(srv)
        summary, upto = svc.summary_state("acme", "bio")
        turns = svc.transcript("acme", "bio")
        assert summary and len(summary.split()) >= 3 and upto == turns[-1]["turn_id"]
        # whatever the model wrote, the names and the day are kept (memory/details.py)
        kept = summary.partition("Kept from the conversation:")[2]
        assert "Maria" in kept and "Lisbon" in kept and turns[0]["ts"][:10] in kept
        # one extraction (4 turns), valid by construction (structured outputs)
        assert metric_value(srv, "cwm_sidecar_background_tasks_total", tenant="acme",
                            kind="facts", outcome="ok") == 1
        assert metric_value(srv, "cwm_sidecar_facts_refused_total", tenant="acme") == 0
        assert svc.files.read_cursor("acme", "bio", "facts") == turns[-1]["turn_id"]
        assert len(turns) == 4
        print(f"\nsummary: {summary!r}\nfacts: {[m.text for m in svc.memories('acme')]}")
