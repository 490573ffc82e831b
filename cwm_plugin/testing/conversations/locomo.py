"""Conversations in LoCoMo's layout: the generated ones
(:mod:`cwm_plugin.testing.conversations.dialogues`) and LoCoMo's own, read from its files in either
layout it ships in.

A sample is a dict with ``session_N`` lists of turns ``{speaker, dia_id, text}`` (and
``session_N_date_time``), either at its top level (a file a conversation, as in LoCoMo's
development split) or under a ``conversation`` key beside ``qa`` (``locomo10.json``, which
holds a list of samples). LoCoMo itself is optional: ``bench/memory.py --data DIR`` reads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cwm_plugin.memory.service.importer import locomo_datetime

_SESSION = re.compile(r"session_(\d+)")


@dataclass(frozen=True)
class Conversation:
    name: str                       # a file-safe name: the sample id or the file's stem
    sessions: dict                  # the sample's conversation: session_N, session_N_date_time
    qa: list[dict]

    def session_numbers(self) -> list[int]:
        return sorted(int(m.group(1)) for k in self.sessions
                      if (m := _SESSION.fullmatch(k)) and isinstance(self.sessions[k], list))

    def turns(self, session: int) -> list[dict]:
        return [t for t in self.sessions.get(f"session_{session}", []) if isinstance(t, dict)]

    def dated_sessions(self) -> list[tuple[int, datetime | None, list[dict]]]:
        """``(number, date, turns)`` of every non-empty session, in order."""
        return [(n, locomo_datetime(self.sessions.get(f"session_{n}_date_time")), ts)
                for n in self.session_numbers() if (ts := self.turns(n))]

    def lines(self) -> Iterator[str]:
        """Every turn, in order, as ``speaker: text``."""
        for n in self.session_numbers():
            for t in self.turns(n):
                yield f"{t.get('speaker', '?')}: {t.get('text', '')}"


def load_conversations(folder: Path) -> list[Conversation]:
    """Every LoCoMo sample in the ``*.json`` files under ``folder`` (files that are not LoCoMo
    are skipped), in file order."""
    out: list[Conversation] = []
    for path in sorted(Path(folder).glob("**/*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        samples = data if isinstance(data, list) else [data]
        for i, sample in enumerate(samples):
            if not isinstance(sample, dict):
                continue
            conv = sample.get("conversation", sample)
            if not isinstance(conv, dict) or not any(_SESSION.fullmatch(k) for k in conv):
                continue
            name = str(sample.get("sample_id") or (path.stem if len(samples) == 1
                                                   else f"{path.stem}-{i}"))
            out.append(Conversation(re.sub(r"[^A-Za-z0-9_.-]", "_", name), conv,
                                    list(sample.get("qa") or [])))
    return out


def turn_text(t: dict) -> str:
    """A turn's text, with the caption of a photo it shares."""
    text = str(t.get("text", ""))
    if t.get("blip_caption"):
        text += f" [shares a photo: {t['blip_caption']}]"
    return text


def evidence_ids(q: dict) -> list[str]:
    """The dia_ids a question's ``evidence`` names (lists, or ids split by ``;``/``,``)."""
    ids: list[str] = []
    for e in q.get("evidence") or []:
        ids.extend(x for x in re.split(r"[;,\s]+", str(e)) if x)
    return list(dict.fromkeys(ids))
