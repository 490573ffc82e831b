"""Summaries and fact extraction written by a real model (SmolLM2-135M-Instruct) and by the
random tiny model (whose output is never valid JSON: the refusal path)."""

from __future__ import annotations

import pytest
from sidecar_helpers import chat, make_settings, metric_value, runtime, wait_idle

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.serving import ServerThread
from cwm_plugin.testing.vllm_server import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def smollm2_vllm(smollm2_model, tmp_path_factory):
    server = VLLMServer(model_dir=smollm2_model, served_name="smollm2", dtype="bfloat16",
                        max_model_len=4096, log_dir=tmp_path_factory.mktemp("vllm"))
    with server:
        yield server


def test_summary_and_facts_come_back_valid_or_are_refused_cleanly(smollm2_vllm, smollm2_model,
                                                                  tmp_path):
    settings = make_settings(smollm2_vllm.base_url, tmp_path, smollm2_model,
                             memory={"summary_every_turns": 2, "extract_facts": True})
    with ServerThread(create_app(settings)) as srv:
        svc = runtime(srv).memory.service
        said = ["Hi! My name is Maria and I live in Lisbon.",
                "I work as a nurse and I love playing the cello on weekends."]
        for text in said:
            r = chat(srv, "acme", text, session="bio", model="smollm2", max_tokens=40)
            assert r.status_code == 200, r.text
        wait_idle(srv)
        summary = svc.summary("acme", "bio")
        summary_text = summary if isinstance(summary, str) else getattr(summary, "text", "")
        assert summary_text and len(summary_text.split()) >= 3
        ok = metric_value(srv, "cwm_sidecar_background_tasks_total", tenant="acme", kind="facts",
                          outcome="ok")
        refused = metric_value(srv, "cwm_sidecar_facts_refused_total", tenant="acme")
        print(f"\nsummary: {summary_text!r}\nfacts ok={ok} refused={refused}: "
              f"{[m.text for m in svc.memories('acme')]}")
        # Two turns, two extractions: each either stored valid facts or was refused and counted.
        assert ok + refused == 2
        if ok:
            assert svc.memories("acme")
        # Turns are recorded whatever happened in the background.
        assert len(svc.transcript("acme", "bio")) == 4
