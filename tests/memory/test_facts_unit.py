"""The strict JSON contract for extracted facts."""

from __future__ import annotations

import json

import pytest

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.service.facts import FACTS_PROMPT, SUMMARY_PROMPT, parse_facts

pytestmark = pytest.mark.unit


def test_valid_facts() -> None:
    text = json.dumps([{"text": "The user lives in Basel.", "category": "fact",
                        "importance": 0.7},
                       {"text": " Prefers  tea ", "category": "preference"}])
    assert parse_facts(text) == [
        {"text": "The user lives in Basel.", "category": "fact", "importance": 0.7},
        {"text": "Prefers tea", "category": "preference", "importance": 0.5}]
    assert parse_facts("[]") == []
    assert "JSON" in FACTS_PROMPT and SUMMARY_PROMPT


@pytest.mark.parametrize("bad", [
    "", "not json", '```json\n[]\n```', "{}", '{"facts": []}', "[1]", '["x"]',
    '[{"text": "x"}]', '[{"category": "fact"}]', '[{"text": "", "category": "fact"}]',
    '[{"text": "x", "category": "opinion"}]', '[{"text": "x", "category": "fact", "k": 1}]',
    '[{"text": "x", "category": "fact", "importance": 2}]',
    '[{"text": "x", "category": "fact", "importance": "high"}]',
    '[{"text": "x", "category": "fact", "importance": true}]',
    '[{"text": 5, "category": "fact"}]', '[{"text": "x", "category": "fact"}] trailing',
    json.dumps([{"text": "x", "category": "fact"}] * 21),
])
def test_malformed_rejected(bad: str) -> None:
    with pytest.raises(InvalidInput):
        parse_facts(bad)
