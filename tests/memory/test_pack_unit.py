"""Packing lines under a budget: the room the packer's upper estimate left unused is packed
again, and a passage emptied by dropping its lines is no hit."""

from __future__ import annotations

import pytest

from cwm_plugin.memory import select as S
from cwm_plugin.memory.chunking import Unit
from cwm_plugin.memory.pack import pack
from cwm_plugin.memory.turns import Line

pytestmark = pytest.mark.unit


def line(session: str, row: int, text: str, score: float) -> Line:
    unit = Unit(text=f"user: {text}", turn_id=f"{session}-{row}", ts="2024-03-01T10:00:00",
                tokens=0)
    return Line(session, row, unit, score, {})


def test_a_passage_emptied_by_dropping_its_lines_is_no_hit(counter) -> None:
    lines = [line("a", 0, "First thing.", 0.9), line("b", 0, "Second thing.", 0.8)]
    packed = pack(lines, lambda s: [], 200, counter.count)
    assert len(packed.hits()) == 2
    assert packed.drop_last().startswith("drop turn b-0")
    assert [h.turn_ids for h in packed.hits()] == [["a-0"]]


def test_the_room_left_unused_by_the_estimate_is_packed_again(make_service, counter,
                                                               monkeypatch) -> None:
    svc = make_service(chunk_tokens=80, chunk_overlap=10)
    for i in range(100):
        svc.record_turn("acme", "s", "user", f"We planted tomato seedling number {i}.",
                        turn_id=f"t{i}")
    q = [{"role": "user", "content": "Which tomato seedlings did we plant?"}]
    for budget in (150, 300, 600):
        monkeypatch.setattr(S, "FILL_ROUNDS", 0)
        once = svc.select_context("acme", None, q, budget, summary=False)
        monkeypatch.setattr(S, "FILL_ROUNDS", 2)
        filled = svc.select_context("acme", None, q, budget, summary=False)
        assert once.tokens <= filled.tokens <= budget
        n_once = sum(len(h.turn_ids) for h in once.hits)
        n_filled = sum(len(h.turn_ids) for h in filled.hits)
        assert n_filled > n_once  # ".\n" is one token: the estimate counted a newline a line
        assert budget - filled.tokens < 2 * S.FILL_MIN
