"""Progressive summaries keep names, dates and decisions whatever the model writes: replayed
on the generated conversations' sessions (an update every 8 turns, as the sidecar does),
compared with the sessions' own summaries."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest

from cwm_plugin.memory.service.details import MARK, extract, parse, with_details
from cwm_plugin.testing.conversations.dialogues import default_conversations

pytestmark = pytest.mark.unit
EVERY = 8
PRONOUNS = {"The", "She", "He", "They", "Both", "This", "It", "Her", "His", "Friday"}


def sessions():
    for conv in default_conversations():
        for n in conv.session_numbers():
            when = datetime.strptime(conv.sessions[f"session_{n}_date_time"],
                                     "%I:%M %p on %d %B, %Y").replace(tzinfo=UTC)
            turns = [{"role": t["speaker"], "content": t["text"],
                      "ts": when.strftime("%Y-%m-%dT%H:%M:%SZ")} for t in conv.turns(n)]
            yield conv, n, turns


def progressive(turns: list[dict]) -> str:
    summary = None
    for i in range(0, len(turns), EVERY):  # the model's text is not under test
        summary = with_details(f"Summary after {i + EVERY} turns.", summary,
                               turns[i:i + EVERY])
    assert summary is not None
    return summary


def test_names_dates_and_decisions_survive_every_update() -> None:
    named = kept = 0
    for conv, n, turns in sessions():
        summary = progressive(turns)
        prose, details = parse(summary)
        assert prose == f"Summary after {len(turns) + (-len(turns)) % EVERY} turns."
        speakers = {t["role"] for t in turns}
        assert speakers <= set(details.names[:len(speakers)])  # the speakers come first
        assert turns[0]["ts"][:10] in details.dates  # the day it was said
        text = " ".join(t["content"] for t in turns)
        decided = [f"{t['role']}: {s}" for t in turns
                   for s in re.split(r"(?<=[.!?])\s+", t["content"])
                   if re.search(r"\b(?:decided|signed up)\b", s, re.I) and len(s.split()) <= 30]
        for d in decided[-3:]:  # the newest decisions are kept
            assert d.strip() in details.decisions
        gold = conv.sessions.get(f"session_{n}_summary", "")
        for w in set(re.findall(r"\b[A-Z][a-z]+\b", gold)) - PRONOUNS:
            if re.search(r"[a-z,] " + w + r"\b", text):  # a name the turns use mid-sentence
                named += 1
                kept += w in details.names
        assert len(summary) < 3000  # bounded however long the session
    assert named > 100 and kept / named >= 0.95  # measured: 639 of 640


def test_relative_dates_are_anchored_and_an_echoed_block_is_cut() -> None:
    turns = [{"role": "Ana", "content": "I went to Porto yesterday with Rui. We decided to "
              "move in June 2024.", "ts": "2024-03-02T10:00:00Z"}]
    d = extract(turns)
    assert d.names[:1] == ["Ana"] and {"Porto", "Rui"} <= set(d.names)
    assert "yesterday (said 2024-03-02)" in d.dates and "June 2024" in d.dates
    assert d.decisions == ["Ana: We decided to move in June 2024."]
    first = with_details("Ana talked about Porto.", None, turns)
    echo = with_details(f"Ana moved.\n\n{MARK}\n- Names: Bogus", first,
                        [{"role": "Ana", "content": "Next is Lisbon.", "ts": "2024-03-09"}])
    prose, got = parse(echo)
    assert prose == "Ana moved." and "Bogus" not in got.names
    assert {"Porto", "Rui", "Lisbon"} <= set(got.names)
    assert got.dates[0] == "2024-03-02" and "2024-03-09" in got.dates
