"""Retrieval at turn granularity: the line corpus follows the index (appends, edited and
removed session files), lines are ranked and packed into dated passages under the budget,
neighbours come along when asked, and the speaker named in a question counts."""

from __future__ import annotations

import re

import pytest

from cwm_plugin.memory.selection.lines import LineCorpus, doc_id, rank_lines

pytestmark = pytest.mark.unit

FILLER = ["We talked about the weather again.", "The train was late this morning.",
          "I bought some bread and cheese.", "The meeting moved to Thursday."]


def fill(svc, session: str, n: int, role: str = "user", start: int = 0) -> None:
    for i in range(start, start + n):
        svc.record_turn("acme", session, role, f"{FILLER[i % 4]} ({session} {i})",
                        turn_id=f"{session}-{i}")


def test_the_line_corpus_follows_appends_edits_and_removals(new_service) -> None:
    svc = new_service(chunk_tokens=60, chunk_overlap=10)
    fill(svc, "s1", 6)
    corpus = LineCorpus()
    idx = svc.index("acme")
    corpus.sync(idx)
    assert len(corpus.alone) == len(corpus.context) == 6
    fill(svc, "s1", 2, start=6)  # appended: the old last line gets its next neighbour
    svc.record_turn("acme", "s1", "user", "My violin teacher is called Ingrid.", turn_id="v")
    corpus.sync(svc.index("acme"))
    assert len(corpus.alone) == 9
    assert "violin" in " ".join(_context(corpus, "s1", 7))
    # a session file edited by hand is indexed again from its file
    path = svc.files.session_path("acme", "s1")
    path.write_text(path.read_text().replace("Ingrid", "Astrid"))
    idx = svc.index("acme")
    corpus.sync(idx)
    assert all("Ingrid" not in ln.unit.text
               for ln in rank_lines(idx, corpus, "Ingrid", None, svc.config, mode="bm25"))
    top = rank_lines(idx, corpus, "Astrid violin", None, svc.config, mode="bm25")
    assert top[0].unit.turn_id == "v"
    # a removed session file leaves the corpus
    fill(svc, "s2", 3)
    corpus.sync(svc.index("acme"))
    svc.files.session_path("acme", "s2").unlink()
    corpus.sync(svc.index("acme"))
    assert len(corpus.alone) == 9 and not any(d.startswith("s2") for d in corpus.by_label.values())


def _context(corpus: LineCorpus, session: str, row: int) -> list[str]:
    terms = corpus.context._freqs[corpus.context._row[doc_id(session, row)]]
    return list(terms)


def test_lines_are_packed_into_dated_passages_within_the_budget(new_service, counter) -> None:
    svc = new_service(chunk_tokens=80, chunk_overlap=10)
    for s in ("a", "b", "c"):
        fill(svc, s, 12)
    svc.record_turn("acme", "b", "user", "My violin teacher is called Ingrid.", turn_id="v")
    fill(svc, "b", 3, start=12)
    q = [{"role": "user", "content": "What is my violin teacher called?"}]
    for budget in (40, 80, 150, 400, 1200):
        sel = svc.select_context("acme", None, q, budget, summary=False)
        assert sel.tokens <= budget
        if sel.hits:  # the best line is taken first
            assert any("v" in h.turn_ids for h in sel.hits)
        for h in sel.hits:  # one header a passage: its session and day
            assert re.match(r"\[session [abc], \d{4}-\d{2}-\d{2}\]\n", h.text)
            assert h.text.count("\n") == len(h.turn_ids) + h.text.count("\n…\n")
    big = svc.select_context("acme", None, q, 1200, summary=False)
    assert any(r.startswith("keep turn v ") for r in big.reasons)
    # neighbours: the lines around a line come along
    svc.config.turn_neighbours = 1
    try:
        near = svc.select_context("acme", None, q, 1200, summary=False)
    finally:
        svc.config.turn_neighbours = 0
    passage = next(h for h in near.hits if "v" in h.turn_ids)
    assert {"b-11", "v", "b-12"} <= set(passage.turn_ids)


def test_a_question_naming_a_speaker_prefers_that_speakers_lines(new_service) -> None:
    svc = new_service(speaker_weight=0.2)
    svc.record_turn("acme", "s", "Caroline", "I went hiking in the mountains.", turn_id="c1")
    svc.record_turn("acme", "s", "Melanie", "I went hiking in the mountains too.", turn_id="m1")
    idx = svc.index("acme")
    corpus = LineCorpus()
    for who, first in (("Caroline", "c1"), ("Melanie", "m1")):
        got = rank_lines(idx, corpus, f"Where did {who} go hiking?", None, svc.config,
                         mode="bm25")
        assert got[0].unit.turn_id == first and got[0].reasons["speaker"] == 0.2
    both = rank_lines(idx, corpus, "Where did Caroline and Melanie go?", None, svc.config,
                      mode="bm25")
    assert all("speaker" not in ln.reasons for ln in both)  # two named: no preference


def test_warm_loads_the_index_and_builds_the_line_corpus(new_service) -> None:
    svc = new_service()
    svc.record_turn("acme", "s1", "user", "We hiked the Dolomites in June.")
    svc.record_turn("acme", "s1", "assistant", "That sounds wonderful.")
    svc.indexes._folders.clear()  # as after a restart: nothing loaded
    svc._lines.clear()
    svc.warm("acme")
    assert svc.indexes.loaded("acme")
    idx, corpus = svc._lines["acme"]
    assert idx is svc.indexes.get("acme") and len(corpus.alone) == 2


def test_warm_builds_the_line_corpus_when_the_embedder_is_down(new_service, caplog) -> None:
    from cwm_plugin.errors import UpstreamError
    from cwm_plugin.memory.index.embeddings import HashingEmbedder

    class Down(HashingEmbedder):
        def embed(self, texts):
            raise UpstreamError("embeddings server refused the connection", hint="start it")

    first = new_service()
    first.record_turn("acme", "s1", "user", "We hiked the Dolomites in June.")
    first.close()  # saves the index
    svc = new_service(Down(), root=first.config.root)
    svc.warm("acme")  # no exception: the keyword side is warm, the embedder is logged
    assert svc.indexes.loaded("acme") and "acme" in svc._lines
    assert "did not warm up" in caplog.text


def test_ranked_lines_are_what_a_selection_packs_from(new_service, counter) -> None:
    """``MemoryService.ranked_lines`` (bench/memory.py's top-N diagnostic) ranks exactly the
    lines a selection packs: the best of them lead the block it injects."""
    svc = new_service()
    fill(svc, "s1", 12)
    svc.record_turn("acme", "s2", "user", "My sister Lotte plays the cello in Utrecht.",
                    turn_id="cello")
    fill(svc, "s2", 12, start=1)
    for mode in ("hybrid", "bm25", "vector"):
        ranked = svc.ranked_lines("acme", "Who plays the cello?", mode=mode)
        assert ranked[0].unit.turn_id == "cello"
        assert [ln.score for ln in ranked] == sorted((ln.score for ln in ranked), reverse=True)
    sel = svc.select_context("acme", None, [{"role": "user", "content": "Who plays the cello?"}],
                             40, summary=False, bump=False)
    assert [t for h in sel.hits for t in h.turn_ids] == ["cello"]
    with pytest.raises(Exception, match="folder name"):
        svc.ranked_lines("../other", "cello")
