"""Search: hybrid combination on a crafted corpus, folder isolation, rebuild from files."""

from __future__ import annotations

import numpy as np
import pytest

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.index.search import _minmax
from cwm_plugin.memory.metrics import MemoryMetrics

pytestmark = pytest.mark.unit

CORPUS = [
    ("c1", "My gym locker code is ZX-4417, please remember it."),
    ("c2", "Last spring we adopted a small puppy; she loves chasing balls in the park."),
    ("c3", "The quarterly report is due on Friday and the numbers look fine."),
    ("c4", "I repaired the kitchen sink with a new washer this morning."),
    ("c5", "Our flight to Lisbon leaves at seven, so we pack tonight."),
    ("c6", "The tomato plants on the balcony finally have red fruit."),
    ("c7", "I switched my phone plan to one with more mobile data."),
    ("c8", "Grandma's apple pie recipe needs cinnamon and cold butter."),
    ("c9", "The code review for the login page took the whole afternoon."),
    ("c10", "We watched a documentary about deep sea fish yesterday."),
]


def fill(svc, folder: str = "acme") -> None:
    for tid, text in CORPUS:
        svc.record_turn(folder, "s1", "user", text, turn_id=tid)


def top(hits, n: int) -> list[str]:
    return [h.turn_ids[0] for h in hits[:n]]


def test_hybrid_combines_both_methods(new_service, minilm) -> None:
    svc = new_service(minilm, chunk_tokens=40, chunk_overlap=0)
    fill(svc)
    q = "what pet dog do we have, and what is ZX-4417 for?"
    bm25 = svc.search("acme", q, 3, mode="bm25")
    vec = svc.search("acme", q, 3, mode="vector")
    hyb = svc.search("acme", q, 3, mode="hybrid")
    assert top(bm25, 1) == ["c1"]  # the exact token
    assert "c2" in top(vec, 2)  # the paraphrase (pet dog ~ adopted a puppy)
    assert set(top(hyb, 2)) == {"c1", "c2"}
    cfg = svc.config
    for h in hyb:  # the score is the documented weighted sum of min-max normalised scores
        r = h.reasons
        assert h.score == pytest.approx(cfg.bm25_weight * r["bm25_norm"]
                                        + cfg.vector_weight * r["vector_norm"])
    assert hyb[0].reasons["bm25_norm"] == 1.0 or hyb[0].reasons["vector_norm"] == 1.0


def test_weights_reduce_to_single_methods(new_service, minilm) -> None:
    svc = new_service(minilm, chunk_tokens=40, chunk_overlap=0, bm25_weight=1.0,
                       vector_weight=0.0)
    fill(svc)
    q = "ZX-4417 locker"
    assert top(svc.search("acme", q, 1), 1) == top(svc.search("acme", q, 1, mode="bm25"), 1)
    svc.config.bm25_weight, svc.config.vector_weight = 0.0, 1.0
    q = "baking a dessert"
    assert top(svc.search("acme", q, 1), 1) == top(svc.search("acme", q, 1, mode="vector"), 1)
    with pytest.raises(InvalidInput):
        svc.search("acme", q, 1, mode="fuzzy")


def test_minmax() -> None:
    assert _minmax({"a": 2.0, "b": 4.0, "c": 3.0}) == {"a": 0.0, "b": 1.0, "c": 0.5}
    assert _minmax({"a": 0.7, "b": 0.7}) == {"a": 1.0, "b": 1.0}
    assert _minmax({"a": 0.0}) == {"a": 0.0}


def test_mmr_recency_and_session_filter(new_service, minilm) -> None:
    svc = new_service(minilm, chunk_tokens=40, chunk_overlap=0, mmr_lambda=0.5,
                       recency_half_life_days=30.0)
    fill(svc)
    svc.record_turn("acme", "s2", "user", "The puppy chewed my slippers.", turn_id="d1")
    hits = svc.search("acme", "puppy", 3)
    assert len({h.chunk_id for h in hits}) == len(hits) == 3
    assert all("recency" in h.reasons for h in hits)
    only = svc.search("acme", "puppy", 5, session="s2")
    assert [h.turn_ids for h in only] == [["d1"]]
    assert all(h.source == "session:s2" for h in only)


def test_folder_isolation(new_service, minilm, tmp_path) -> None:
    svc = new_service(minilm)
    svc.record_turn("alpha", "s1", "user", "The vault password is banana-42.")
    svc.add_memory("alpha", "Alpha's vault password is banana-42.", "fact")
    svc.record_turn("beta", "s1", "user", "We like hiking in the mountains.")
    for mode in ("bm25", "vector", "hybrid"):
        for h in svc.search("beta", "vault password banana-42", 10, mode=mode):
            assert "banana" not in h.text
        assert svc.search("alpha", "vault password banana-42", 1, mode=mode)
    sel = svc.select_context("beta", "s1", [{"role": "user", "content": "vault password?"}],
                             2000)
    assert "banana" not in sel.memory_block and sel.facts == []
    assert svc.memories("beta") == []
    assert svc.search("gamma", "anything", 5) == []


def test_reindex_and_new_process_give_identical_results(new_service, minilm, tmp_path) -> None:
    metrics = MemoryMetrics()
    svc = new_service(minilm, chunk_tokens=60, chunk_overlap=20, metrics=metrics)
    for i, (tid, text) in enumerate(CORPUS * 3):
        svc.record_turn("acme", f"s{i % 2}", "user", text, turn_id=f"{tid}-{i}")
    queries = ["puppy in the park", "ZX-4417", "flight to Lisbon", "report due"]

    def snapshot(s):
        return [[(h.chunk_id, round(h.score, 6), h.turn_ids) for h in s.search("acme", q, 5)]
                for q in queries]

    before = snapshot(svc)
    n = svc.reindex(progress=False)
    assert n == len(svc.index("acme").chunks) > 2
    assert snapshot(svc) == before
    fresh = new_service(minilm, root=svc.config.root, chunk_tokens=60, chunk_overlap=20)
    assert snapshot(fresh) == before
    # the rebuild embedded nothing new: every text came from the on-disk cache
    hits = fresh.metrics.cache.labels("hit")._value.get()
    misses = fresh.metrics.cache.labels("miss")._value.get()
    assert hits > 0 and misses == 0
    assert metrics.chunks._value.get() > 0
    assert metrics.retrieval.labels("hybrid")._sum.get() > 0


def test_two_writers_on_one_root_see_each_other(new_service) -> None:
    """Two services (as two processes would) append to one session; both indexes catch up."""
    a = new_service()
    b = new_service(root=a.config.root)
    a.record_turn("acme", "s1", "user", "We adopted a puppy named Biscuit.", turn_id="a1")
    assert b.search("acme", "Biscuit puppy", 1)[0].turn_ids == ["a1"]  # b builds from files
    a.record_turn("acme", "s1", "user", "The locker code is ZX-4417.", turn_id="a2")
    b.record_turn("acme", "s1", "assistant", "Noted, Biscuit and ZX-4417.", turn_id="b1")
    a.record_turn("acme", "s2", "user", "Lisbon flight at seven.", turn_id="a3")
    assert b.search("acme", "Lisbon flight", 1, mode="bm25")[0].turn_ids == ["a3"]
    assert [t["turn_id"] for t in a.transcript("acme", "s1")] == ["a1", "a2", "b1"]
    a.search("acme", "anything", 1)
    fresh = new_service(root=a.config.root)
    fresh.search("acme", "anything", 1)
    ids = set(fresh.index("acme").chunks)
    assert set(a.index("acme").chunks) == ids == set(b.index("acme").chunks)


def test_index_grows_past_its_initial_capacity(counter) -> None:
    from cwm_plugin.memory.index.chunks import ChunkIndex
    from cwm_plugin.memory.index.embeddings import HashingEmbedder
    from cwm_plugin.memory.index.search import search_index
    from cwm_plugin.memory.models import MemoryConfig, Turn

    idx = ChunkIndex(HashingEmbedder(384), counter, 200, 40)
    emb = HashingEmbedder(384)
    turns = [Turn(f"t{i}", "user", f"note number {i} mentions word{i}", "2024-01-01T00:00:00Z")
             for i in range(1500)]
    for i in range(0, 1500, 100):
        idx.add_turns("s", turns[i:i + 100])
    assert idx.vectors.shape[0] == 1500
    q = "note number 1234 mentions word1234"
    qvec = emb.embed([q])[0]
    # every vector landed in its place: the best line (exact search) is t1234's, or t1235's
    # (a line's vector has the line before it as context)
    best = int(np.argmax(idx.vectors @ qvec))
    assert idx.sessions["s"].units[idx.sessions["s"].labels.index(best)].turn_id in \
        ("t1234", "t1235")
    for mode in ("bm25", "hybrid"):  # (hnsw over 1500 near-identical lines is too approximate
        hits = search_index(idx, q, qvec, 3, MemoryConfig(root="unused"),  # for vector-only)
                            mode=mode)
        assert "t1234" in {t for h in hits[:2] for t in h.turn_ids}


def test_an_exchange_is_one_durable_append_and_indexed_at_once(new_service, monkeypatch) -> None:
    from datetime import UTC, datetime

    from cwm_plugin.memory.files import markdown as files_mod

    when = datetime(2026, 5, 1, 12, tzinfo=UTC)  # one daily file for every turn here
    svc = new_service()
    svc.record_turn("acme", "s", "user", "warm up the index", ts=when)
    syncs: list[int] = []
    real_fsync = files_mod.os.fsync
    monkeypatch.setattr(files_mod.os, "fsync", lambda fd: (syncs.append(fd), real_fsync(fd)))
    ids = svc.record_turns("acme", "s", [("user", "my kayak is teal"),
                                         ("assistant", "a teal kayak, noted")], ts=when)
    assert len(syncs) == 1  # the session file; the daily log (for people) is not fsynced
    assert [t["turn_id"] for t in svc.transcript("acme", "s")][-2:] == ids
    assert "teal kayak" in svc.search("acme", "teal kayak", 1, mode="bm25")[0].text
    # deferred indexing: the turns are in the file at once and in the index by the next search
    svc.record_turns("acme", "s", [("user", "my canoe is mauve")], defer_index=True, ts=when)
    assert svc.transcript("acme", "s")[-1]["content"] == "my canoe is mauve"
    assert svc.pending.waiting("acme") == 1
    assert "mauve" in svc.search("acme", "mauve canoe", 1, mode="bm25")[0].text
    assert not svc.pending.waiting("acme") and svc.index_pending("acme") == 0


def test_vector_candidates_follow_adds_and_drops(new_service) -> None:
    svc = new_service(chunk_tokens=40, chunk_overlap=8)
    for i in range(30):
        svc.record_turn("acme", f"s{i % 3}", "user", f"line {i} about topic {i % 7} " * 3)
    idx = svc.index("acme")
    idx.drop_session("s1")

    def brute(q) -> list[str]:  # every chunk holding one of the nearest lines, in index order
        from cwm_plugin.memory.index.chunks import knn_labels

        wanted = knn_labels(idx.hnsw, q, 12, idx.n_vectors - idx.deleted)
        return [c for c, labs in idx.chunk_labels.items() if wanted.intersection(labs)]

    for text in ("topic 3", "line 17", "about topic 5"):
        q = svc.embedder.embed([text])[0]
        got = idx.vector_candidates(q, 12)
        assert got == brute(q) and got
        assert not any(idx.chunks[c].session == "s1" for c in got)


def test_deferred_indexing_under_concurrent_appends_equals_a_rebuild(new_service) -> None:
    import threading

    svc = new_service(chunk_tokens=60, chunk_overlap=12)
    svc.record_turn("acme", "s0", "user", "warm up the index")

    def writer(w: int) -> None:
        for i in range(15):
            svc.record_turns("acme", f"s{w % 2}", [("user", f"writer {w} line {i} kiwi"),
                                                   ("assistant", f"noted {w}.{i}")],
                             defer_index=True)

    def indexer() -> None:
        for _ in range(30):
            svc.index_pending("acme")
            svc.search("acme", "kiwi", 3, mode="bm25")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    threads.append(threading.Thread(target=indexer))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    svc.index_pending("acme")
    live = {c: ch.text for c, ch in svc.index("acme").chunks.items()}
    assert len(svc.transcript("acme", "s0")) + len(svc.transcript("acme", "s1")) == 121
    svc.reindex("acme", progress=False)
    assert {c: ch.text for c, ch in svc.index("acme").chunks.items()} == live


def test_an_indexing_brings_the_line_corpus_and_other_writers_in_before_the_next_search(
        new_service, monkeypatch) -> None:
    """The catch-up after a deferred indexing: the line corpus holds the new lines and a file
    written by another process is indexed, before any search; a catch-up that fails leaves
    the turns indexed (and the next search to look again)."""
    svc = new_service(sync_interval_s=0.0)
    svc.record_turn("acme", "s", "user", "warm up the index")
    assert svc.select_context("acme", None, [{"role": "user", "content": "warm"}], 200,
                              bump=False, mode="bm25") is not None  # builds the line corpus
    corpus = svc._lines["acme"][1]
    before = len(corpus.alone)
    other = new_service(root=svc.config.root)  # another writer on the same files
    other.record_turn("acme", "t", "user", "a walrus named Olga")
    svc.record_turns("acme", "s", [("user", "my canoe is mauve")], defer_index=True)
    searched: list[str] = []
    monkeypatch.setattr("cwm_plugin.memory.service.service.rank_lines",
                        lambda *a, **k: searched.append("x") or [])
    assert svc.index_pending("acme") == 1 and not searched
    assert len(corpus.alone) == before + 2  # both new lines, no search needed
    assert "t" in svc.indexes.get("acme").sessions
    svc.record_turns("acme", "s", [("user", "my kayak is teal")], defer_index=True)
    monkeypatch.setattr(svc.indexes, "refresh", lambda folder: 1 / 0)
    assert svc.index_pending("acme") == 1 and not svc.pending.waiting("acme")
    assert any("kayak" in c.text for c in svc.indexes.get("acme").chunks.values())


@pytest.mark.parametrize("chunk_weight", [1.0, 0.0])
def test_vector_scores_of_many_chunks_equal_one_at_a_time(new_service, chunk_weight) -> None:
    svc = new_service(chunk_tokens=40, chunk_overlap=8, chunk_vector_weight=chunk_weight)
    for i in range(40):
        svc.record_turn("acme", f"s{i % 4}", "user", f"line {i} about topic {i % 7} " * 3)
    idx = svc.index("acme")
    idx.drop_session("s2")
    ids = [*idx.chunks, "no-such-chunk"]
    for text in ("topic 3", "line 17 about"):
        q = svc.embedder.embed([text])[0]
        got = idx.vector_scores(q, ids)
        assert list(got) == ids and got["no-such-chunk"] == 0.0
        for c in ids:
            assert got[c] == pytest.approx(idx.vector_score(q, c), abs=1e-6)
    assert idx.vector_scores(q, []) == {}


def test_nearest_lines_answers_a_narrower_ask_from_the_last_one_until_the_index_changes(
        new_service) -> None:
    """A selection asks for the chunks' nearest lines, then for fewer lines of the same query:
    the second answer is the head of the first, and any add or drop searches again."""
    from cwm_plugin.memory.index.chunks import knn_ordered

    svc = new_service(chunk_tokens=40, chunk_overlap=8)
    for i in range(40):
        svc.record_turn("acme", f"s{i % 4}", "user", f"line {i} about topic {i % 9}")
    idx = svc.index("acme")
    q = svc.embedder.embed(["about topic 4"])[0]
    wide = idx.nearest_lines(q, 16)
    assert wide == knn_ordered(idx.hnsw, q, 16, idx.n_vectors - idx.deleted)
    assert idx.nearest_lines(q, 6) == wide[:6]
    gone = set(idx.sessions["s0"].labels)
    assert gone.intersection(idx.nearest_lines(q, 40))
    idx.drop_session("s0")  # a drop: searched again, the dropped lines gone
    after = idx.nearest_lines(q, 6)
    assert after == knn_ordered(idx.hnsw, q, 6, idx.n_vectors - idx.deleted)
    assert not gone.intersection(after)
    svc.record_turn("acme", "s9", "user", "about topic 4")  # an add: the new line is nearest
    idx = svc.index("acme")
    new = idx.sessions["s9"].labels[-1]
    assert new in idx.nearest_lines(q, 3)


class _Graph:
    """hnswlib's answer when its graph reaches fewer than ``k`` items (RuntimeError "Cannot
    return the results in a contiguous 2D array"): reaches ``reach`` items at the index's
    ef, all of them once ef is at least ``wide``."""

    def __init__(self, items: int, reach: int, wide: int) -> None:
        self.items, self.reach, self.wide, self.ef = items, reach, wide, 0

    def set_ef(self, ef: int) -> None:
        self.ef = ef

    def knn_query(self, q, k: int):
        if k > (self.items if self.ef >= self.wide else self.reach):
            raise RuntimeError("Cannot return the results in a contiguous 2D array. Probably "
                               "ef or M is too small")
        return np.arange(k).reshape(1, -1), np.zeros((1, k))


def test_a_graph_that_reaches_fewer_items_than_asked_answers_what_it_reaches() -> None:
    from cwm_plugin.memory.index.chunks import knn_ordered

    q = np.ones(4, dtype=np.float32)
    assert knn_ordered(_Graph(500, 40, 500), q, 100, 500) == list(range(100))  # wider: all
    assert knn_ordered(_Graph(500, 40, 10**9), q, 100, 500) == list(range(25))  # fewer
    assert knn_ordered(_Graph(500, 0, 10**9), q, 100, 500) == []
