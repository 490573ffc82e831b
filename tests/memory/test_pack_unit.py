"""Packing lines under a budget: the room the packer's upper estimate left unused is packed
again, and a passage emptied by dropping its lines is no hit."""

from __future__ import annotations

import pytest

from cwm_plugin.memory.index.chunking import Unit
from cwm_plugin.memory.selection import select as S
from cwm_plugin.memory.selection.lines import Line
from cwm_plugin.memory.selection.pack import pack_lines

pytestmark = pytest.mark.unit


def line(session: str, row: int, text: str, score: float) -> Line:
    unit = Unit(text=f"user: {text}", turn_id=f"{session}-{row}", ts="2024-03-01T10:00:00",
                tokens=0)
    return Line(session, row, unit, score, {})


def test_a_passage_emptied_by_dropping_its_lines_is_no_hit(counter) -> None:
    lines = [line("a", 0, "First thing.", 0.9), line("b", 0, "Second thing.", 0.8)]
    packed = pack_lines(lines, lambda s: [], 200, counter.count)
    assert len(packed.hits()) == 2
    assert packed.drop_last().startswith("drop turn b-0")
    assert [h.turn_ids for h in packed.hits()] == [["a-0"]]


def test_the_room_left_unused_by_the_estimate_is_packed_again(new_service, counter,
                                                               monkeypatch) -> None:
    svc = new_service(chunk_tokens=80, chunk_overlap=10)
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


def test_one_line_costs_what_its_passage_grows_by() -> None:
    """The packer's one-line cost (from the line's neighbours only) equals the passage's
    cost with the line minus without it, for random passages, gaps and days."""
    import random

    from cwm_plugin.memory.selection.pack import Passage, _line_cost

    rng = random.Random(7)

    def count(text: str) -> int:
        return len(text) // 3 + 1

    def rand_line() -> Line:
        s, r = f"s{rng.randint(0, 2)}", rng.randint(0, 12)
        unit = Unit("x" * rng.randint(1, 40), f"{s}-{r}", f"2023-01-0{rng.randint(1, 3)}T09", 0)
        return Line(s, r, unit, 1.0, {})

    for _ in range(2000):
        passages: dict[tuple[str, str], Passage] = {}
        for g in [rand_line() for _ in range(rng.randint(0, 8))]:
            key = (g.session, g.unit.ts[:10])
            passages.setdefault(key, Passage(*key)).lines[g.row] = g
        g = rand_line()
        key = (g.session, g.unit.ts[:10])
        before = passages.get(key)
        if before is not None and g.row in before.lines:
            assert _line_cost(passages, g, count) is None
            continue
        after = Passage(*key, dict(before.lines) if before else {})
        after.lines[g.row] = g
        want = after.cost(count) - (before.cost(count) if before else -2)
        assert _line_cost(passages, g, count) == want
