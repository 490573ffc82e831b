"""Chunking properties: whole lines, size, overlap, determinism, incremental == full."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cwm_plugin.memory.index.chunking import chunk_units, spans, turn_units
from cwm_plugin.memory.index.chunks import ChunkIndex
from cwm_plugin.memory.index.embeddings import HashingEmbedder
from cwm_plugin.memory.models import Turn

pytestmark = pytest.mark.unit

WORDS = st.sampled_from(["alpha", "beta", "gamma", "delta", "café", "42", "Basel", "x-ray", "ünïcode"])
TEXTS = st.lists(WORDS, min_size=1, max_size=60).map(" ".join)


def turns_of(texts: list[str]) -> list[Turn]:
    return [Turn(f"D1:{i}", "user" if i % 2 else "assistant", t, "2024-01-01T00:00:00Z")
            for i, t in enumerate(texts)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(TEXTS, min_size=1, max_size=40), size=st.integers(40, 200),
       overlap=st.integers(0, 60))
def test_chunk_properties(counter, texts: list[str], size: int, overlap: int) -> None:
    units = [u for t in turns_of(texts) for u in turn_units(t, counter, size)]
    sp = spans(units, 0, size, overlap, header_tokens=0)
    assert sp[0][0] == 0 and sp[-1][1] == len(units)
    covered = set()
    for (b, e), nxt in zip(sp, [*sp[1:], None], strict=True):
        assert e > b
        covered.update(range(b, e))
        if e - b > 1:  # a chunk of several lines stays within the size
            assert sum(u.tokens + 1 for u in units[b:e]) <= size
        if nxt is not None:
            assert b < nxt[0] <= e  # progress, and overlap only with the previous chunk
            assert sum(u.tokens + 1 for u in units[nxt[0]:e]) <= overlap
    assert covered == set(range(len(units)))
    for u in units:  # lines are never split unless a turn alone exceeds the size
        if u.tokens > size:
            assert " " not in u.text.split(": ", 1)[-1]  # only a single over-long word


def test_long_turn_is_split_at_lines_then_words(counter) -> None:
    text = "\n".join(["short line"] * 3 + ["word " * 300])
    units = turn_units(Turn("t1", "user", text, "2024-01-01T00:00:00Z"), counter, 50)
    assert len(units) > 3 and all(u.turn_id == "t1" for u in units)
    assert all(u.tokens <= 50 for u in units)
    assert "".join(u.text for u in units).replace("\n", "").replace(" ", "") == \
        ("user: " + text).replace("\n", "").replace(" ", "")


def test_chunk_ids_and_turn_ids(counter) -> None:
    units = [u for t in turns_of(["hello " * 30] * 10) for u in turn_units(t, counter, 100)]
    a = chunk_units("s1", units, counter, 100, 30)
    b = chunk_units("s1", units, counter, 100, 30)
    c = chunk_units("s2", units, counter, 100, 30)
    assert [x[2].chunk_id for x in a] == [x[2].chunk_id for x in b]
    assert {x[2].chunk_id for x in a}.isdisjoint(x[2].chunk_id for x in c)
    assert all(len(x[2].chunk_id) == 64 for x in a)
    assert [tid for x in a for tid in x[2].turn_ids][:2] == ["D1:0", "D1:1"]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(TEXTS, min_size=1, max_size=30), split=st.integers(0, 30))
def test_incremental_equals_full(counter, texts: list[str], split: int) -> None:
    turns = turns_of(texts)
    inc = ChunkIndex(HashingEmbedder(32), counter, 120, 30)
    for i in range(0, len(turns), max(1, split)):
        inc.add_turns("s", turns[i:i + max(1, split)])
    full = ChunkIndex(HashingEmbedder(32), counter, 120, 30)
    full.add_turns("s", turns)
    assert inc.doc_ids("s") == full.doc_ids("s")
    assert set(inc.chunks) == set(full.chunks)
