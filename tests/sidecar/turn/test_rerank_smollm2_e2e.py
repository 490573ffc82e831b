"""The memory re-ranker against a real model server: the sidecar's ``/v1/completions``
request (a prompt a line, the top log-probabilities of one token, the session's salt) is
accepted by real ``vllm serve`` (SmolLM2-135M-Instruct) and every line gets a score from its
answer, so the stage runs instead of degrading. What the model judges is not checked: a 135M
model is no judge of relevance (``bench/rerank.py`` measures the cost)."""

from __future__ import annotations

import pytest
from sidecar_helpers import Recorder, chat, make_settings, metric_value, runtime

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.turn.rerank import INSTRUCTION
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HISTORY = [(role, text) for i in range(6) for role, text in (
    ("user", f"Day {i}: I went hiking on trail number {i} with my sister."),
    ("assistant", f"Trail {i} sounds lovely; how long was the hike?"))]
QUESTION = "Who do I go hiking with?"


def test_the_served_model_scores_every_line_it_is_asked_about(smollm2_vllm, smollm2_model,
                                                              tmp_path):
    rec = Recorder(smollm2_vllm.base_url)
    with ServerThread(rec.app) as relay:
        settings = make_settings(relay.url, tmp_path, smollm2_model, memory={
            "budget_tokens": 120,
            # (a fresh vLLM's first request may be its slowest: this checks the format)
            "rerank": {"kind": "completions", "top_n": 8, "timeout_s": 60}})
        with ServerThread(create_app(settings)) as srv:
            runtime(srv).memory.service.record_turns("acme", "past", HISTORY)
            r = chat(srv, "acme", QUESTION, session="now", model="smollm2", max_tokens=8)
            assert r.status_code == 200, r.text
            asked = rec.last("/v1/completions")
            assert len(asked["prompt"]) == 8
            assert all(p.startswith(INSTRUCTION.format(query=QUESTION)) for p in asked["prompt"])
            assert asked["cache_salt"] == rec.last()["cache_salt"]
            assert metric_value(srv, "cwm_memory_degraded_total", what="rerank") == 0
            assert metric_value(srv, "cwm_sidecar_rerank_seconds_count", tenant="acme") == 1
            assert metric_value(srv, "cwm_sidecar_rerank_tokens_total", tenant="acme") > 8 * 40
