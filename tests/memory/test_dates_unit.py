"""Explicit dates in a question: which are read, and how near a line's time stamp is."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from cwm_plugin.memory.selection.dates import Period, nearness, periods
from cwm_plugin.memory.selection.lines import LineCorpus, rank_lines

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("query, want", [
    ("What did she show me on October 13, 2023?", [Period(10, 13, 2023)]),
    ("What did Gina find on 1 February, 2023?", [Period(2, 1, 2023)]),
    ("the 3rd of June", [Period(6, 3)]),
    ("on 2023-06-16 we met", [Period(6, 16, 2023)]),
    ("What happened to his job in August 2023?", [Period(8, None, 2023)]),
    ("When did Melanie go camping in June?", [Period(6)]),
    ("between May 3 and May 9, 2023", [Period(5, 3), Period(5, 9, 2023)]),
    ("May I ask what you did in 2023?", []),  # a modal verb and a bare year: no date
    ("What did I say last week?", []),
    ("on 31 February", []),
])
def test_explicit_days_and_months_are_read(query: str, want: list[Period]) -> None:
    assert periods(query) == want


def test_nearness_is_one_inside_the_period_and_fades_within_a_week() -> None:
    day, month = periods("on 23 May, 2023"), periods("in June")
    assert nearness(day, "2023-05-23T18:00:00+00:00") == 1.0
    assert 0 < nearness(day, "2023-05-27T10:00:00") < 1
    assert nearness(day, "2023-06-23T10:00:00") == 0.0
    assert nearness(month, "2021-06-30T10:00:00") == 1.0  # no year: June of any year
    assert nearness(month, "2021-07-03T10:00:00") > nearness(month, "2021-07-06T10:00:00") > 0
    assert nearness([], "2023-05-23") == nearness(day, "not a date") == 0.0


def test_a_question_naming_a_day_prefers_the_lines_of_that_day(new_service) -> None:
    svc = new_service(date_weight=0.2)
    for day, tid in ((3, "early"), (16, "late")):
        svc.record_turn("acme", f"s{day}", "Maria", "I started a new class at the gym.",
                        turn_id=tid, ts=datetime(2023, 6, day, 10, tzinfo=UTC))
    idx, corpus = svc.index("acme"), LineCorpus()
    for q, first in (("What did Maria start on 16 June, 2023?", "late"),
                     ("What did Maria start, as mentioned on 3 June 2023?", "early")):
        got = rank_lines(idx, corpus, q, None, svc.config, mode="bm25")
        assert got[0].unit.turn_id == first and got[0].reasons["date"] == 0.2
    plain = rank_lines(idx, corpus, "What did Maria start?", None, svc.config, mode="bm25")
    assert all("date" not in ln.reasons for ln in plain)
