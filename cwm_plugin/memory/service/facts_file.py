"""Durable memories (``memories.md``): added, deduplicated, updated, counted when used.

Reading never writes the markdown: how often a memory was selected is a derived statistic kept
in ``<root>/.index/<folder>/access.json`` (:func:`access_counts`; lost with the index folder,
which is fine), added to the count a memory line carries from older versions.

A new fact is merged into the memories in force (:func:`merge`):

- a *duplicate* (the same text, any category, or a cosine similarity of at least
  ``DUPLICATE`` between the two texts' vectors: a rewording) adds nothing; the memory kept
  takes the higher importance and the newer source;
- an *update*: a memory with the same ``key`` (the topic the extraction names, "home city")
  whose text is *related* (similarity at least ``RELATED``) is replaced: it stays in the file,
  struck through under the history heading with ``replaced_by`` and ``until``, and only the new
  one is searched and injected. Both conditions are needed: a small model names keys loosely
  (it may file an allergy under "home city"), and two facts on one topic are not always exclusive
  (tea and coffee) unless the extraction says they share a key;
- anything else is added.

The thresholds sit between MiniLM's similarities of such pairs: "lives in Lisbon" / "now lives
in Porto" 0.77, "moved to Porto" 0.65, "works as a nurse" / "became a teacher" 0.52; unrelated
facts 0.14-0.35; "allergic to peanuts" / "severely allergic to peanuts" 0.99.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.files.durable import file_lock, replace_durable
from cwm_plugin.memory.files.markdown import utc_iso
from cwm_plugin.memory.files.truth import MemoryTruth
from cwm_plugin.memory.index.persist import folder_dir
from cwm_plugin.memory.models import CATEGORIES, Memory

DUPLICATE = 0.92
RELATED = 0.5
Similar = Callable[[str, list[str]], np.ndarray]  # text, others -> cosine to each


@dataclass
class Merged:
    memory: Memory       # the memory in force for this fact
    outcome: str         # "added", "duplicate" or "updated"
    replaced: Memory | None = None


def norm_key(key: str) -> str:
    return " ".join("".join(c if c.isalnum() else " " for c in key.lower()).split())


def _norm_text(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".")


def merge(mems: list[Memory], new: Memory, similar: Similar) -> tuple[list[Memory], Merged]:
    """``mems`` (every memory, replaced ones too) with ``new`` merged in (module docstring)."""
    active = [m for m in mems if m.active]
    sims = similar(new.text, [m.text for m in active]) if active else np.zeros(0)
    for m, sim in zip(active, sims, strict=True):
        if _norm_text(m.text) == _norm_text(new.text) or sim >= DUPLICATE:
            m.importance = max(m.importance, new.importance)
            m.source = new.source or m.source
            m.key = m.key or new.key
            return mems, Merged(m, "duplicate")
    key = norm_key(new.key)
    if key:
        same = [(m, sim) for m, sim in zip(active, sims, strict=True)
                if norm_key(m.key) == key and sim >= RELATED]
        if same:
            old = max(same, key=lambda x: x[1])[0]
            old.replaced_by, old.until = new.id, new.created
            return [*mems, new], Merged(new, "updated", old)
    return [*mems, new], Merged(new, "added")


class FactStore:
    """One memory root's durable memories; ``lock(folder)`` serialises a folder's changes."""

    def __init__(self, files: MemoryTruth, similar: Similar,
                 lock: Callable[[str], AbstractContextManager[object]]) -> None:
        self.files = files
        self.similar = similar
        self.lock = lock

    def add(self, folder: str, text: str, category: str, importance: float = 0.5, *,
            key: str = "", source: str = "") -> Merged:
        """Merge one fact into the folder's memories (see :func:`merge`)."""
        if category not in CATEGORIES:
            raise InvalidInput(f"memory category {category!r} is unknown",
                               hint=f"use one of {', '.join(CATEGORIES)}")
        text = " ".join(str(text).split())
        if not text or len(text) > 2000:
            raise InvalidInput("memory text must be 1-2000 characters")
        if not 0.0 <= float(importance) <= 1.0:
            raise InvalidInput(f"importance {importance} is outside [0, 1]")
        new = Memory(id=f"m-{secrets.token_hex(6)}", text=text, category=category,
                     importance=float(importance), access_count=0, created=utc_iso(),
                     key=norm_key(key)[:60], source=source[:200])
        got: list[Merged] = []

        def change(ms: list[Memory]) -> list[Memory]:
            out, merged = merge(ms, new, self.similar)
            got.append(merged)
            return out

        with self.lock(folder):
            self.files.update_memories(folder, change)
        return got[0]

    def bump(self, folder: str, ids: list[str]) -> None:
        """Count one more use of each of these memories (in the derived ``access.json``;
        ``memories.md`` is left as it is)."""
        path = access_path(self.files.root, folder)
        with self.lock(folder), file_lock(path):
            counts = access_counts(self.files.root, folder)
            for i in ids:
                counts[i] = counts.get(i, 0) + 1
            replace_durable(path, json.dumps(counts, sort_keys=True))

    def with_counts(self, folder: str, mems: list[Memory]) -> list[Memory]:
        """``mems`` with the uses counted since (``access.json``) added to their counts."""
        counts = access_counts(self.files.root, folder)
        for m in mems:
            m.access_count += counts.get(m.id, 0)
        return mems


def access_path(root: Path, folder: str) -> Path:
    return folder_dir(root, folder) / "access.json"


def access_counts(root: Path, folder: str) -> dict[str, int]:
    """Uses of each memory (by id) recorded in the derived file; {} when there is none (or it
    is damaged: the counts are statistics, never the truth)."""
    try:
        data = json.loads(access_path(root, folder).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): int(v) for k, v in data.items() if isinstance(v, int)}
