"""Durable memories go through the same hybrid search as chunks; BM25's text side."""

from __future__ import annotations

import random

import pytest

from cwm_plugin.memory.index.bm25 import BM25Corpus, LuceneBM25, bm25_tokens, stem

pytestmark = pytest.mark.unit

FACTS = [
    ("The user's gym locker code is ZX-4417.", "fact", 0.5),
    ("The user adopted a small puppy last spring.", "fact", 0.5),
    ("The user prefers window seats on trains.", "preference", 0.5),
    ("The user decided to learn Portuguese before moving to Porto.", "decision", 0.5),
    ("The user is allergic to peanuts.", "fact", 0.9),
]


def test_stemming_matches_inflections() -> None:
    assert stem("painted") == stem("painting") == "paint"
    assert stem("hikes") == stem("hiking") == stem("hiked")
    assert stem("stories") == "story" and stem("glass") == "glass" and stem("is") == "is"
    assert bm25_tokens("What did she paint? Painting!") == ["paint", "paint"]


def test_incremental_bm25_equals_a_fresh_build() -> None:
    rng = random.Random(7)
    words = ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "grape", "melon", "berry"]
    docs = {f"d{i}": " ".join(rng.choices(words, k=rng.randint(1, 30))) for i in range(60)}
    inc = BM25Corpus()
    for d, t in docs.items():
        inc.add(d, t)
    for d in list(docs)[::3]:  # drop a third, as re-chunking and dropped sessions do
        inc.remove(d)
        del docs[d]
    inc.add("late", "kiwi kiwi lime")
    docs["late"] = "kiwi kiwi lime"
    ids = list(docs)
    fresh = LuceneBM25([bm25_tokens(docs[d]) for d in ids])
    for q in ("kiwi", "apple lime grape", "nothing here"):
        got = inc.scores(q)
        want = fresh.get_scores(bm25_tokens(q)) if bm25_tokens(q) else [0.0] * len(ids)
        assert len(inc) == len(ids) and set(got) <= set(ids)
        for d, w in zip(ids, want, strict=True):  # a document left out scores 0
            assert got.get(d, 0.0) == pytest.approx(float(w))
            assert (d in got) == (w > 0)


def test_memories_are_found_by_hybrid_search(new_service, minilm) -> None:
    svc = new_service(minilm)
    for text, cat, imp in FACTS:
        svc.add_memory("acme", text, cat, imp)
    exact = svc.search_memories("acme", "what was ZX-4417 again?", 2)
    assert exact[0].text.startswith("The user's gym locker") and exact[0].source == "memory"
    assert {"bm25", "vector", "bm25_norm", "vector_norm", "importance"} <= set(exact[0].reasons)
    para = svc.search_memories("acme", "which pet dog do I have?", 1, mode="vector")
    assert "puppy" in para[0].text  # no shared word: the vectors found it
    hyb = svc.search_memories("acme", "which pet dog do I have?", 1)
    assert "puppy" in hyb[0].text
    for mode in ("bm25", "vector", "hybrid"):
        assert all(h.source == "memory" for h in svc.search_memories("acme", "user", 5,
                                                                     mode=mode))
    assert svc.search("acme", "ZX-4417", 5) == []  # memories are not transcript chunks


def test_importance_weighs_in(new_service) -> None:
    svc = new_service()
    low = svc.add_memory("acme", "The user likes green tea in the morning.", "preference", 0.1)
    high = svc.add_memory("acme", "The user likes green tea in the evening.", "preference",
                          1.0)
    hits = svc.search_memories("acme", "green tea", 2)
    assert [h.chunk_id for h in hits] == [high.id, low.id]
    assert hits[0].reasons["prior"] == pytest.approx(1.5)
    assert hits[1].reasons["prior"] == pytest.approx(0.6)


LOCKER_QUESTION = [{"role": "user", "content": "Remind me of my locker code ZX-4417?"}]


def facts_service(new_service, minilm):
    """A service whose folder ``acme`` holds FACTS and one turn of session ``s1``."""
    svc = new_service(minilm, max_facts=1)
    for text, cat, imp in FACTS:
        svc.add_memory("acme", text, cat, imp)
    svc.record_turn("acme", "s1", "user", "Hello!")
    return svc


def test_selection_takes_memories_in_search_order(new_service, minilm) -> None:
    svc = facts_service(new_service, minilm)
    sel = svc.select_context("acme", "s1", LOCKER_QUESTION, 2000)
    # the most important memory (peanuts, 0.9) loses to the one the question is about
    assert [m.text for m in sel.facts] == ["The user's gym locker code is ZX-4417."]
    assert [h.source for h in sel.fact_hits] == ["memory"]
    assert "ZX-4417" in sel.memory_block
    assert any(r.startswith("keep memory") for r in sel.reasons)
    assert svc.memories("acme")[0].access_count == 1
    # with no query text, the most important memories come first
    assert svc.search_memories("acme", "  ", 1)[0].text == "The user is allergic to peanuts."


def test_a_selection_counts_uses_without_writing_or_re_indexing(new_service, minilm) -> None:
    svc = facts_service(new_service, minilm)
    svc.select_context("acme", "s1", LOCKER_QUESTION, 2000)
    index = svc.indexes.memories("acme")
    svc.select_context("acme", "s1", LOCKER_QUESTION, 2000)  # counted in .index/, not the .md
    again = svc.indexes.memories("acme")
    assert again is index, "counting a use rebuilt the memory index"
    assert svc.memories("acme")[0].access_count == 2
    svc.add_memory("acme", "The user's bike is a red Cinelli.", "fact", 0.5)
    assert svc.indexes.memories("acme") is not index       # a new memory is indexed
    assert "Cinelli" in svc.search_memories("acme", "which bike?", 1)[0].text


def test_a_selection_leaves_every_file_byte_identical(new_service, minilm) -> None:
    """Reading never writes: content and mtime of every file under the memory folder are
    the same after selections (with and without the deferred count of uses)."""
    svc = facts_service(new_service, minilm)
    svc.set_summary("acme", "s1", "They talked about the gym.", upto_turn="")
    svc.select_context("acme", "s1", LOCKER_QUESTION, 2000, bump=False)  # indexes built
    folder = svc.files.folder_dir("acme")

    def snapshot() -> dict[str, tuple[bytes, int]]:
        return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
                for p in sorted(folder.rglob("*")) if p.is_file()}

    before = snapshot()
    assert "memories.md" in before
    for bump in (True, False):
        sel = svc.select_context("acme", "s1", LOCKER_QUESTION, 2000, bump=bump)
        assert sel.facts
        svc.bump("acme", [m.id for m in sel.facts])
        svc.search("acme", "gym locker", 3)
        svc.search_memories("acme", "gym locker", 3)
        svc.memories("acme")
    assert snapshot() == before


def test_a_repeated_query_sees_documents_added_or_removed_since() -> None:
    inc = BM25Corpus()
    inc.add("a", "kiwi lime")
    first = inc.top("kiwi", 5)
    assert set(first) == {"a"}
    inc.add("b", "kiwi kiwi kiwi")
    again = inc.top("kiwi", 5)
    assert set(again) == {"a", "b"} and again["a"] != first["a"]  # idf changed too
    inc.remove("b")
    assert inc.top("kiwi", 5) == pytest.approx(first)


def test_bm25_through_adds_removals_and_compactions_equals_a_fresh_build() -> None:
    """Queries between changes (a term's arrays built, then grown, rows removed, the corpus
    compacted past 1,024 removed rows) score exactly as a corpus built afresh."""
    rng = random.Random(11)
    words = ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "grape", "melon", "berry",
             "common"]
    inc, docs, n = BM25Corpus(), {}, 0
    queries = ("kiwi common", "apple lime grape", "berry", "nothing here")
    for step in range(3000):
        if docs and rng.random() < 0.45:
            d = rng.choice(list(docs))
            inc.remove(d)
            del docs[d]
        else:
            docs[f"d{n}"] = " ".join(rng.choices(words, k=rng.randint(1, 12)))
            inc.add(f"d{n}", docs[f"d{n}"])
            n += 1
        if step % 50 == 0 or step == 2999:
            q = queries[step // 50 % len(queries)]
            inc.top(q, 3)  # builds (or grows) the query terms' arrays
        if step % 500 == 499 or step == 2999:
            ids = list(docs)
            fresh = LuceneBM25([bm25_tokens(docs[d]) for d in ids])
            for q in queries:
                got = inc.scores(q)
                want = fresh.get_scores(bm25_tokens(q)) if bm25_tokens(q) else [0.0] * len(ids)
                assert len(inc) == len(ids) and set(got) <= set(ids)
                for d, w in zip(ids, want, strict=True):
                    assert got.get(d, 0.0) == pytest.approx(float(w))
    assert n - len(docs) > 1024  # the compaction ran at least once


def test_top_is_the_n_best_of_a_fresh_build_and_scores_of_is_exact() -> None:
    """``top`` partitions only the rows a query scored: the same n best (by score) as every
    row sorted, ``allowed`` respected, ``also`` given its exact score (0 outside ``allowed``);
    ``scores_of`` is each document's exact score."""
    rng = random.Random(5)
    words = ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "grape", "melon", "berry"]
    docs = {f"d{i}": " ".join(rng.choices(words, k=rng.randint(1, 20))) for i in range(400)}
    docs.update({f"z{i}": "walnut hazelnut" for i in range(50)})  # no fruit: score 0
    inc = BM25Corpus()
    for d, t in docs.items():
        inc.add(d, t)
    ids = list(docs)
    fresh = LuceneBM25([bm25_tokens(docs[d]) for d in ids])
    allowed = set(ids[::2])
    for q in ("kiwi", "apple lime grape", "date date melon"):
        want = dict(zip(ids, map(float, fresh.get_scores(bm25_tokens(q))), strict=True))
        for n in (1, 7, 300, 1000):
            got = inc.top(q, n)
            best = sorted((s for s in want.values() if s > 0), reverse=True)[:n]
            assert sorted(got.values(), reverse=True) == pytest.approx(best)
            assert all(got[d] == pytest.approx(want[d]) for d in got)
        got = inc.top(q, 5, also=["z1", "d1", "d2"], allowed=allowed)
        in_allowed = sorted((want[d] for d in allowed if want[d] > 0), reverse=True)[:5]
        top5 = {d: v for d, v in got.items() if d not in {"z1", "d1", "d2"} or d in allowed}
        assert sorted(top5.values(), reverse=True)[:5] == pytest.approx(in_allowed)
        assert got["z1"] == 0.0 and got["d1"] == 0.0  # d1 is outside allowed (odd index)
        assert got["d2"] == pytest.approx(want["d2"])
        exact = inc.scores_of(q, ["d3", "z4", "missing"])
        assert exact == pytest.approx({"d3": want["d3"], "z4": 0.0})
