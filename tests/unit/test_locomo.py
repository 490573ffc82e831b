"""The LoCoMo reader takes both layouts the data set ships in, and skips what is not LoCoMo."""

from __future__ import annotations

import json

import pytest

from cwm_plugin.testing.conversations.locomo import load_conversations

pytestmark = pytest.mark.unit

SESSIONS = {
    "speaker_a": "Ann", "speaker_b": "Bo",
    "session_2": [{"speaker": "Bo", "dia_id": "D2:1", "text": "later"}],
    "session_2_date_time": "2 pm on 9 May, 2023",
    "session_1": [{"speaker": "Ann", "dia_id": "D1:1", "text": "hi"},
                  {"speaker": "Bo", "dia_id": "D1:2", "text": "hello"}],
}
QA = [{"question": "who?", "answer": "Ann", "evidence": ["D1:1"], "category": 4}]


def test_flat_and_nested_layouts_read_alike(tmp_path):
    (tmp_path / "26.json").write_text(json.dumps({**SESSIONS, "qa": QA}))
    (tmp_path / "locomo10.json").write_text(json.dumps(
        [{"sample_id": "conv/x", "conversation": SESSIONS, "qa": QA},
         {"sample_id": "y", "conversation": SESSIONS}]))
    (tmp_path / "other.json").write_text(json.dumps({"not": "locomo"}))
    (tmp_path / "broken.json").write_text("{")
    convs = load_conversations(tmp_path)
    assert [c.name for c in convs] == ["26", "conv_x", "y"]
    for c in convs:
        assert c.session_numbers() == [1, 2]
        assert list(c.lines()) == ["Ann: hi", "Bo: hello", "Bo: later"]
    assert convs[0].qa == QA and convs[2].qa == []
