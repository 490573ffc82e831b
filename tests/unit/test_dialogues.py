"""The generated conversations: LoCoMo's layout, facts planted and referred back to later,
the same text in every process, and enough of it for the benchmarks' longest prompts, whatever
lies beside the checkout."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from cwm_plugin.testing.conversations.dialogues import default_conversations, generate
from cwm_plugin.testing.conversations.locomo import Conversation, load_conversations
from cwm_plugin.testing.conversations.prompts import conversation_lines, conversation_prompt
from cwm_plugin.testing.models import TINY

pytestmark = pytest.mark.unit
DIGEST = ("import hashlib, json; from cwm_plugin.testing.conversations.dialogues import generate; "
          "from cwm_plugin.testing.models import TINY; "
          "print(hashlib.sha256(json.dumps([(c.name, c.sessions, c.qa) for c in "
          "generate(seed=3, conversations=2)], sort_keys=True).encode()).hexdigest(), "
          "TINY.fingerprint())")


def digest(convs: list[Conversation]) -> str:
    blob = json.dumps([(c.name, c.sessions, c.qa) for c in convs], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def test_a_seed_gives_the_same_text_and_model_name_in_every_process() -> None:
    here = f"{digest(generate(seed=3, conversations=2))} {TINY.fingerprint()}"
    for hash_seed in ("1", "2"):                # str hashes (set order) differ between them
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "LC_ALL": "C"}
        out = subprocess.run([sys.executable, "-c", DIGEST], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == here
    assert digest(generate(seed=4, conversations=2)) != here.split()[0]


def test_conversations_come_in_locomo_layout_with_facts_planted_and_referred_back(tmp_path):
    convs = default_conversations()
    for c in convs:                             # what bench/memory.py --data reads
        (tmp_path / f"{c.name}.json").write_text(json.dumps({**c.sessions, "qa": c.qa}))
    assert [list(c.lines()) for c in load_conversations(tmp_path)] == \
        [list(c.lines()) for c in convs]
    later = 0
    for c in convs:
        dated = c.dated_sessions()
        days = [when for _, when, _ in dated]
        assert len(dated) >= 16 and None not in days and days == sorted(set(days))
        said = {t["dia_id"]: t["text"] for _, _, turns in dated for t in turns}
        speakers = {c.sessions["speaker_a"], c.sessions["speaker_b"]}
        assert len(speakers) == 2
        for n, when, _ in dated:
            summary = c.sessions[f"session_{n}_summary"]
            assert all(s in summary for s in speakers) and when.strftime("%Y") in summary
        assert len(c.qa) >= 60                  # bench/memory.py --quick asks 60
        assert {1, 2, 4} <= set(Counter(q["category"] for q in c.qa))
        for q in c.qa:
            assert q["evidence"] and set(q["evidence"]) <= set(said), q
            if q["category"] != 2:              # temporal answers are days, said relatively
                held = " ".join(said[e] for e in q["evidence"]).lower()
                assert q["answer"].lower() in held, q
            sessions = {e.split(":")[0] for e in q["evidence"]}
            later += q["category"] == 1 and len(sessions) == 2
    assert later >= 10 * len(convs)             # a fact told, and built on sessions later


def test_several_speakers_and_a_varied_vocabulary() -> None:
    lines = list(conversation_lines())
    speakers = Counter(line.partition(": ")[0] for line in lines)
    assert len(speakers) >= 12 and min(speakers.most_common(12), key=lambda s: s[1])[1] > 100
    words = Counter(w.lower() for line in lines for w in re.findall(r"[A-Za-z']+", line))
    assert len(words) >= 1400 and len(lines) >= 2000
    assert len(set(lines)) / len(lines) > 0.6   # templates, but mostly not the same line


def test_prompts_need_nothing_beside_the_checkout(tmp_path, monkeypatch, tiny_model):
    from transformers import AutoTokenizer

    other = tmp_path / "data"                   # a folder of other conversations, pointed at
    other.mkdir()
    (other / "1.json").write_text(json.dumps({"session_1_date_time": "1:00 pm on 8 May, 2023",
                                              "session_1": [{"speaker": "Zed", "dia_id": "D1:1",
                                                             "text": "from elsewhere"}]}))
    monkeypatch.setenv("CWM_SHARED_DIR", str(tmp_path))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = conversation_prompt(tok, 8000, skip_lines=800)   # bench/ttft.py's longest
    assert len(tok.encode(prompt, add_special_tokens=False)) > 7000
    assert "Zed:" not in prompt and prompt.splitlines()[0] == list(conversation_lines())[800]
