"""Selection under a budget: never over it, recent turns verbatim, reasons for every item."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cwm_plugin.memory.index.embeddings import HashingEmbedder
from cwm_plugin.memory.models import MemoryConfig
from cwm_plugin.memory.service.service import MemoryService

pytestmark = pytest.mark.unit

TOPICS = ["hiking in the alps", "the tax return", "a sourdough starter", "the new bicycle",
          "learning Portuguese", "the leaking roof", "a trip to Kyoto", "chess openings"]


@pytest.fixture(scope="module")
def filled(tmp_path_factory, counter) -> MemoryService:
    root = tmp_path_factory.mktemp("sel")
    svc = MemoryService(MemoryConfig(root=root, chunk_tokens=120, chunk_overlap=30),
                        HashingEmbedder(), counter)
    for s in range(3):
        for i, topic in enumerate(TOPICS):
            svc.record_turn("acme", f"s{s}", "user", f"Tell me more about {topic} ({s}-{i}).",
                            turn_id=f"u{s}-{i}")
            svc.record_turn("acme", f"s{s}", "assistant",
                            f"Sure. About {topic}: " + "details and more details " * (i + 1),
                            turn_id=f"a{s}-{i}")
    svc.add_memory("acme", "The user is learning Portuguese for a move to Porto.", "goal", 0.9)
    svc.add_memory("acme", "The user prefers short answers.", "preference", 0.6)
    svc.set_summary("acme", "s2", "They discussed many hobbies and chores.", upto_turn="a2-7")
    yield svc
    svc.close()


def history(n: int) -> list[dict]:
    out = []
    for i in range(n):
        out.append({"role": "user", "content": f"question {i} about {TOPICS[i % 8]}"})
        out.append({"role": "assistant", "content": f"answer {i} " + "blah " * (i * 3)})
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(budget=st.integers(0, 2500), n=st.integers(0, 12), with_system=st.booleans())
def test_budget_never_exceeded(filled, counter, budget: int, n: int, with_system: bool) -> None:
    msgs = ([{"role": "system", "content": "You are helpful. " * 50}] if with_system else []) \
        + history(n) + [{"role": "user", "content": "What about Portuguese and Kyoto?"}]
    sel = filled.select_context("acme", "s2", msgs, budget)
    assert sel.tokens <= budget
    block = counter.count(sel.memory_block) if sel.memory_block else 0
    assert sel.tokens == block + counter.count_messages(sel.recent)
    assert all(m["role"] != "system" for m in sel.recent)
    assert sel.reasons or (n == 0 and budget == 0) or not sel.memory_block


def test_recent_verbatim_and_memory_block(filled) -> None:
    msgs = history(5) + [{"role": "user", "content": "Remind me about the sourdough starter"}]
    sel = filled.select_context("acme", "s2", msgs, 4000)
    assert sel.recent == msgs[-7:-1]  # the last six turns, the new message excluded
    assert "sourdough" in sel.memory_block and sel.hits
    assert sel.summary == "They discussed many hobbies and chores."
    assert any(f.category == "goal" for f in sel.facts)
    assert any(r.startswith("keep turn") for r in sel.reasons)  # lines packed (pack.py)
    assert filled.memories("acme")[0].access_count >= 1


@pytest.mark.parametrize("unit", ["turn", "chunk"])
def test_the_quick_view_takes_facts_and_summary_never_passages(filled, unit: str) -> None:
    msgs = history(5) + [{"role": "user", "content": "Remind me about the sourdough starter"}]
    filled.config.retrieval_unit = unit
    try:
        sel = filled.select_context("acme", "s2", msgs, 4000, passages=False, bump=False)
    finally:
        filled.config.retrieval_unit = "turn"
    assert not sel.hits and "sourdough" not in sel.memory_block
    assert sel.summary and any(f.category == "goal" for f in sel.facts)


def test_chunk_unit_keeps_whole_chunks(filled) -> None:
    msgs = history(5) + [{"role": "user", "content": "Remind me about the sourdough starter"}]
    filled.config.retrieval_unit = "chunk"
    try:
        sel = filled.select_context("acme", "s2", msgs, 4000)
    finally:
        filled.config.retrieval_unit = "turn"
    assert "sourdough" in sel.memory_block
    assert any(r.startswith("keep chunk") for r in sel.reasons)


def test_history_from_transcript_and_recent_chunks_skipped(filled) -> None:
    sel = filled.select_context("acme", "s1", [{"role": "user", "content": "chess openings?"}],
                                4000)
    turns = filled.transcript("acme", "s1")[-6:]
    assert sel.recent == [{"role": t["role"], "content": t["content"]} for t in turns]
    recent_ids = {t["turn_id"] for t in turns}
    for h in sel.hits:
        assert not recent_ids.issuperset(h.turn_ids)


def test_small_budget_drops_with_reasons(filled, counter) -> None:
    msgs = history(6) + [{"role": "user", "content": "the leaking roof"}]
    sel = filled.select_context("acme", "s0", msgs, 60)
    assert sel.tokens <= 60
    assert any("over budget" in r for r in sel.reasons)
    assert filled.select_context("acme", "s0", msgs, 0).tokens == 0


TOOL_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "weather", "arguments": '{"city": "Basel"}'}}]}
TOOL_REPLY = {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, rain"}


def test_a_tool_result_is_never_kept_without_its_call(filled) -> None:
    msgs = [*history(3), {"role": "user", "content": "Weather in Basel?"}, TOOL_CALL,
            TOOL_REPLY, {"role": "assistant", "content": "It rains, 12 degrees."},
            {"role": "user", "content": "And tomorrow?"}]
    for n in range(1, 6):  # however the window falls, call and result stay together
        filled.config.recent_turns = n
        try:
            sel = filled.select_context("acme", "s2", msgs, 4000)
        finally:
            filled.config.recent_turns = 6
        assert (TOOL_REPLY in sel.recent) == (TOOL_CALL in sel.recent)
        assert len(sel.recent) >= n
    # a budget that fits the answer but not the call group drops the group whole
    small = filled.counter.count_messages(msgs[-2:-1]) + 1
    sel = filled.select_context("acme", "s2", msgs, small)
    assert TOOL_REPLY not in sel.recent and TOOL_CALL not in sel.recent
    assert sel.recent == [msgs[-2]]


def test_developer_prefix_not_repeated_and_mid_conversation_system_kept(filled) -> None:
    prefix = [{"role": "system", "content": "You are helpful."},
              {"role": "developer", "content": "Answer in French."}]
    mid = {"role": "system", "content": "From now on, answer in German."}
    msgs = [*prefix, *history(1), mid, *history(4),
            {"role": "user", "content": "Wie geht's?"}]
    sel = filled.select_context("acme", "s2", msgs, 4000)
    assert not any(m in sel.recent for m in prefix)  # the caller keeps the prefix in place
    assert mid in sel.recent  # older than the window, pinned as an instruction
    assert sel.recent[0] == mid and sel.recent[1:] == msgs[-7:-1]
    assert any(r.startswith("keep pinned system message") for r in sel.reasons)
    tiny = filled.select_context("acme", "s2", msgs, filled.counter.count_messages(msgs[-2:-1]))
    assert mid not in tiny.recent
    assert any(r.startswith("drop pinned system message") for r in tiny.reasons)


class _Recording:
    """A counter that remembers what it was asked to count, under a chosen name."""

    def __init__(self, inner, name: str) -> None:
        self.inner, self.name, self.seen = inner, name, []

    def count(self, text: str) -> int:
        self.seen.append(text)
        return self.inner.count(text)

    def count_messages(self, messages: list[dict]) -> int:
        return self.inner.count_messages(messages)


class _Doubled(_Recording):
    """Another tokenizer: twice the tokens of ``inner``'s on every text."""

    def count(self, text: str) -> int:
        return 2 * super().count(text)

    def count_messages(self, messages: list[dict]) -> int:
        return 2 * self.inner.count_messages(messages)


def test_the_index_line_counts_are_reused_as_they_are_for_the_same_tokenizer(filled,
                                                                             counter) -> None:
    q = [{"role": "user", "content": "What about Portuguese and the trip to Kyoto?"}]
    same = _Recording(counter, counter.name)
    a = filled.select_context("acme", None, q, 400, counter=same, bump=False)
    lines = {ln for h in a.hits for ln in h.text.split("\n")[1:]} - {"…"}
    assert lines and not lines & set(same.seen)   # taken from the index: never counted again
    assert a.tokens == counter.count(a.memory_block) <= 400


def test_another_tokenizer_prices_lines_at_a_ratio_measured_once(filled, counter) -> None:
    """A served model's tokenizer: the index's counts times the ratio of the two tokenizers,
    measured once on the folder's best lines; the block still counted exactly, in budget."""
    other = _Doubled(counter, "another-tokenizer")
    q = [{"role": "user", "content": "What about Portuguese and the trip to Kyoto?"}]
    first = filled.select_context("acme", None, q, 800, counter=other, bump=False)
    assert filled.ratios.of("acme", other, []) == pytest.approx(2.0, rel=0.02)
    assert first.tokens == other.count(first.memory_block) <= 800
    before = len(other.seen)
    q2 = [{"role": "user", "content": "Remind me about the leaking roof and the new bicycle."}]
    second = filled.select_context("acme", None, q2, 800, counter=other, bump=False)
    lines = {ln for h in second.hits for ln in h.text.split("\n")[1:]} - {"…"}
    assert lines and not lines & set(other.seen[before:])  # priced, never counted again
    assert second.tokens == other.count(second.memory_block) <= 800
    exact = filled.select_context("acme", None, q2, 400, counter=counter, bump=False)
    assert second.memory_block == exact.memory_block  # twice the tokens, twice the budget
    assert filled.ratios.of("acme", _Recording(counter, "third"), []) is None  # not measured


class _Skewed(_Recording):
    """A tokenizer whose lines cost twice ``inner``'s and whose assembled blocks (text with a
    newline) 2.6 times: the pieces' prices add up to much less than the block."""

    def count(self, text: str) -> int:
        n = super().count(text)
        return math.ceil(2.6 * n) if "\n" in text else 2 * n

    def count_messages(self, messages: list[dict]) -> int:
        return 2 * self.inner.count_messages(messages)


def test_a_block_over_the_room_gives_back_enough_lines_at_once(filled, counter) -> None:
    """Priced lines that cost more once joined: the selection drops, in one step, the lines
    whose cost covers the excess and counts the block again, instead of counting it again
    after each line dropped; the block still fits."""
    from cwm_plugin.memory.selection.select import HITS_HEADER

    skewed = _Skewed(counter, "skewed-tokenizer")
    q = [{"role": "user", "content": "Tell me about hiking, the tax return and chess openings."}]
    got = filled.select_context("acme", None, q, 900, counter=skewed, bump=False)
    blocks = [t for t in skewed.seen if HITS_HEADER in t and "\n" in t]  # whole blocks
    assert got.hits and got.tokens == skewed.count(got.memory_block) <= 900
    assert any("over budget once assembled" in r for r in got.reasons)  # it had to give back
    assert len(blocks) <= 4, len(blocks)  # fill rounds and one count after giving back
