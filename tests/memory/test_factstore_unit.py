"""Durable facts are deduplicated and updated, and a replaced fact keeps its history in the
markdown file (real files, the real MiniLM similarity where the threshold matters)."""

from __future__ import annotations

import numpy as np
import pytest

from cwm_plugin.memory.files.markdown import HISTORY_HEADING
from cwm_plugin.memory.index.embeddings import HashingEmbedder
from cwm_plugin.memory.models import Memory, MemoryConfig
from cwm_plugin.memory.service.facts_file import merge
from cwm_plugin.memory.service.service import MemoryService

pytestmark = pytest.mark.unit


def mem(mid: str, text: str, key: str = "", importance: float = 0.5) -> Memory:
    return Memory(mid, text, "fact", importance, 0, "2026-01-01T00:00:00Z", key=key)


def fixed(sims: list[float]):
    return lambda text, others: np.array(sims[:len(others)])


def test_merge_rules() -> None:
    old = mem("m-1", "The user lives in Lisbon.", key="home city")
    # the same text (case, spacing, final dot aside) is a duplicate, whatever the similarity
    out, got = merge([old], mem("m-2", "the user lives in  lisbon", importance=0.9), fixed([0]))
    assert got.outcome == "duplicate" and out == [old] and old.importance == 0.9
    # a rewording (similarity >= 0.92) is a duplicate too
    _, got = merge([old], mem("m-3", "User resides in Lisbon."), fixed([0.95]))
    assert got.outcome == "duplicate"
    # same key and related: replaced, the old one kept with its replacement and time
    new = mem("m-4", "The user moved to Porto.", key="Home  City")
    out, got = merge([old], new, fixed([0.65]))
    assert got.outcome == "updated" and got.replaced is old and out == [old, new]
    assert old.replaced_by == "m-4" and old.until == new.created and not old.active
    # a key given loosely to an unrelated fact replaces nothing
    other = mem("m-5", "The user is allergic to peanuts.", key="home city")
    out, got = merge([mem("m-6", "The user lives in Porto.", key="home city")], other,
                     fixed([0.14]))
    assert got.outcome == "added" and all(m.active for m in out)
    # no key, related: both stay (two preferences on one topic are not exclusive)
    _, got = merge([mem("m-7", "The user prefers tea.")], mem("m-8", "The user prefers coffee."),
                   fixed([0.74]))
    assert got.outcome == "added"


@pytest.fixture()
def svc(tmp_path, counter):
    s = MemoryService(MemoryConfig(root=tmp_path), HashingEmbedder(), counter)
    yield s
    s.close()


def test_a_newer_fact_replaces_the_old_one_with_its_history_in_the_markdown(svc) -> None:
    first = svc.add_fact("acme", "The user lives in Lisbon.", "fact", 0.6, key="home city",
                         source="session:a#t1..t2")
    assert first.outcome == "added"
    svc.facts.similar = fixed([0.7])  # HashingEmbedder has no semantics: say they are related
    second = svc.add_fact("acme", "The user now lives in Porto.", "fact", 0.7, key="home city",
                          source="session:b#t9..t9")
    assert second.outcome == "updated"
    assert [m.text for m in svc.memories("acme")] == ["The user now lives in Porto."]
    every = svc.memories("acme", history=True)
    assert {m.text: m.replaced_by for m in every} == {
        "The user now lives in Porto.": "", "The user lives in Lisbon.": second.memory.id}
    text = svc.files.memories_path("acme").read_text()
    active, _, history = text.partition(HISTORY_HEADING)
    assert "Porto" in active and "Lisbon" not in active
    assert "~~" in history and "Lisbon" in history and second.memory.id in history
    assert "session:a#t1..t2" in history and "session:b#t9..t9" in active
    # only the fact in force is searched and injected
    sel = svc.select_context("acme", None, [{"role": "user", "content": "Where do I live?"}],
                             500)
    assert [m.text for m in sel.facts] == ["The user now lives in Porto."]
    assert "Lisbon" not in sel.memory_block
    # the file reads back the same after a rewrite (a bump rewrites it)
    svc.bump("acme", [second.memory.id])
    assert [(m.text, m.replaced_by) for m in svc.memories("acme", history=True)] == \
        [(m.text, m.replaced_by) for m in every]


def test_duplicates_across_categories_are_one_memory(svc) -> None:
    for cat in ("preference", "goal", "fact"):  # what SmolLM2 answered for one statement
        svc.add_fact("acme", "The user is allergic to peanuts.", cat, 1.0)
    assert len(svc.memories("acme")) == 1


def test_minilm_similarity_gates_an_update(tmp_path, counter, minilm) -> None:
    s = MemoryService(MemoryConfig(root=tmp_path), minilm, counter)
    try:
        s.add_fact("acme", "The user lives in Lisbon.", "fact", key="home city")
        assert s.add_fact("acme", "The user is allergic to peanuts.", "fact",
                          key="home city").outcome == "added"
        assert s.add_fact("acme", "The user now lives in Porto.", "fact",
                          key="home city").outcome == "updated"
        assert s.add_fact("acme", "The user is severely allergic to peanuts.",
                          "preference").outcome == "duplicate"
        assert sorted(m.text for m in s.memories("acme")) == [
            "The user is allergic to peanuts.", "The user now lives in Porto."]
    finally:
        s.close()


@pytest.mark.parametrize("damage", [b"{not json", b"[1, 2]", b"\x00\xff" * 40, b""])
def test_a_damaged_use_count_file_is_statistics_lost_never_a_failed_selection(svc, damage):
    """access.json is derived: damaged, it reads as no counts, a selection still answers,
    the next use rewrites it whole, and memories.md is never touched."""
    from cwm_plugin.memory.service.facts_file import access_counts, access_path

    got = svc.add_fact("acme", "The user keeps bees in Lisbon.", "fact", 0.8)
    svc.bump("acme", [got.memory.id])
    md = (svc.files.root / "acme" / "memories.md").read_bytes()
    path = access_path(svc.files.root, "acme")
    path.write_bytes(damage)
    assert access_counts(svc.files.root, "acme") == {}
    sel = svc.select_context("acme", None, [{"role": "user", "content": "Where are my bees?"}],
                             500)
    assert [m.text for m in sel.facts] == ["The user keeps bees in Lisbon."]
    assert access_counts(svc.files.root, "acme") == {got.memory.id: 1}   # rewritten whole
    assert (svc.files.root / "acme" / "memories.md").read_bytes() == md
