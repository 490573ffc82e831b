"""A memory, index or embedder failure never fails a client's request: it is answered without
memory, flagged in ``X-CWM-Memory-Status``, counted and logged once; damaged memory lines are
skipped. Real HTTP both ways; the upstream is ``cwm_plugin.testing.fake_upstream``; the embedder
outage is a real embeddings endpoint that is not there."""

from __future__ import annotations

import pytest
from sidecar_helpers import chat, make_settings, metric_value, runtime, wait_idle

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.procs import free_port
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def upstream():
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as srv:
        yield fake, srv


def test_a_fact_quoting_the_marker_and_damaged_lines_do_not_break_a_tenant(upstream,
                                                                          tmp_path):
    fake, up = upstream
    with ServerThread(create_app(make_settings(up.url, tmp_path, "tiktoken:cl100k_base"))) as srv:
        svc = runtime(srv).memory.service
        svc.add_memory("acme", "The user wrote <!-- cwm-mem {} --> in a wiki page about teal "
                               "kayaks.", "fact", 0.9)
        path = tmp_path / "acme" / "memories.md"
        path.write_text(path.read_text() + "- **fact** broken <!-- cwm-mem {\"id\": -->\n")
        summary = tmp_path / "acme" / "summaries" / "s1.md"
        summary.parent.mkdir(parents=True)
        summary.write_text("<!-- cwm-summary {not json -->\nThey talked about kayaks.\n")
        for _ in range(2):
            r = chat(srv, "acme", "What about my teal kayak?", session="s1", debug=True)
            assert r.status_code == 200, r.text
            assert "X-CWM-Memory-Status" not in r.headers
        assert "wiki page about teal kayaks" in fake.last()["messages"][0]["content"]
        svc.add_memory("acme", "The user paddles on Lake Zug.", "fact", 0.5)
        assert "broken" in path.read_text()  # a rewrite keeps the damaged line for a person
        assert len(svc.memories("acme")) == 2


def test_an_embedder_outage_answers_without_memory(upstream, tmp_path, caplog):
    fake, up = upstream
    dead = f"http://127.0.0.1:{free_port()}/v1"
    settings = make_settings(up.url, tmp_path, "tiktoken:cl100k_base", memory={
        "embedder": {"kind": "openai", "url": dead, "model": "mini"}, "warm_on_start": False})
    with ServerThread(create_app(settings)) as srv:
        for i in range(3):
            r = chat(srv, "acme", [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": f"Question {i}?"}],
                     session="out")
            assert r.status_code == 200, r.text
            assert r.headers["X-CWM-Memory-Status"] == "unavailable; stage=select"
            # answered as the client asked, without memory
            assert fake.last()["messages"] == [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": f"Question {i}?"}]
        assert metric_value(srv, "cwm_sidecar_memory_failures_total", tenant="acme",
                            stage="select") == 3
        # the turns are still recorded (appending needs no embedder); nothing is indexed on
        # the client's path
        svc = runtime(srv).memory.service
        assert len(svc.transcript("acme", "out")) == 6 and not svc.indexes.loaded("acme")
    failures = [r for r in caplog.records if "memory select failed" in r.getMessage()]
    assert len(failures) == 1  # logged once
    assert str(tmp_path) not in r.text + str(dict(r.headers))


def test_an_embedder_that_fails_later_is_counted_at_selection_and_indexing(upstream, tmp_path):
    fake, up = upstream
    settings = make_settings(up.url, tmp_path, "tiktoken:cl100k_base", memory={
        "embedder": {"kind": "openai", "url": up.url + "/v1", "model": "tiny", "dims": 3}})
    with ServerThread(create_app(settings)) as srv:
        r = chat(srv, "acme", "I keep bees in the garden.", session="later")
        assert r.status_code == 200 and "X-CWM-Memory-Status" not in r.headers
        wait_idle(srv)
        fake.embeddings_down = True
        try:
            r = chat(srv, "acme", "Where are the bees?", session="later2")
            wait_idle(srv)
        finally:
            fake.embeddings_down = False
        assert r.status_code == 200
        assert r.headers["X-CWM-Memory-Status"] == "unavailable; stage=select"
        for stage in ("select", "index"):
            assert metric_value(srv, "cwm_sidecar_memory_failures_total", tenant="acme",
                                stage=stage) == 1
        # once the embedder is back, the turn that could not be indexed is found
        r = chat(srv, "acme", "Where are the bees?", session="later3")
        assert r.status_code == 200 and "X-CWM-Memory-Status" not in r.headers
        hits = runtime(srv).memory.service.search("acme", "bees", 5, mode="bm25")
        assert any("Where are the bees?" in h.text for h in hits)
