"""Recorded turns: their records, and those appended with ``defer_index`` awaiting indexing.

A caller answering a client appends turns to the session file at once (durable) and leaves
embedding their lines for later (``MemoryService.index_pending``); a search of the folder runs
that first, so it sees every turn this process appended. ``PendingTurns`` keeps those batches
per folder, in order, lets one indexing a folder take them at a time, and puts them back in
front when the indexing fails (an embedder that is down), so nothing is lost.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.files.markdown import utc_iso
from cwm_plugin.memory.files.names import check_role
from cwm_plugin.memory.models import Turn, new_turn_id

TURN_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
Batch = tuple[str, list[Turn], int, int]  # (session, turns, start, end offsets in the file)


def turn_records(turns: list[tuple[str, str]], turn_ids: list[str | None] | None,
                 ts: datetime | None) -> list[Turn]:
    """``(role, content)`` pairs checked and made records (a fresh id where none is given)."""
    ids = list(turn_ids or [None] * len(turns))
    if len(ids) != len(turns):
        raise InvalidInput(f"{len(ids)} turn ids for {len(turns)} turns")
    records = []
    for (role, content), turn_id in zip(turns, ids, strict=True):
        check_role(role)
        if not isinstance(content, str):
            raise InvalidInput("turn content must be a string")
        if turn_id is None:
            turn_id = new_turn_id()
        elif not TURN_ID.match(turn_id):
            raise InvalidInput(f"turn id {turn_id!r} is not allowed",
                               hint="use 1-64 letters, digits, '_', '.', ':' or '-'")
        records.append(Turn(turn_id=turn_id, role=role, content=content, ts=utc_iso(ts)))
    return records


class PendingTurns:
    """Batches of appended turns not indexed yet, per folder, in the order appended."""

    def __init__(self) -> None:
        self._batches: dict[str, list[Batch]] = {}
        self._indexing: dict[str, threading.RLock] = {}  # one indexing a folder at a time
        self._guard = threading.Lock()

    def add(self, folder: str, batch: Batch) -> None:
        with self._guard:
            self._batches.setdefault(folder, []).append(batch)

    def waiting(self, folder: str) -> int:
        with self._guard:
            return len(self._batches.get(folder, ()))

    def folders(self) -> list[str]:
        """The folders with batches waiting."""
        with self._guard:
            return [t for t, b in self._batches.items() if b]

    @contextmanager
    def take(self, folder: str) -> Iterator[list[Batch]]:
        """The folder's waiting batches, taken while holding its indexing turn (waiting for an
        indexing under way); given back in front of newer ones if the body raises."""
        with self._guard:
            lock = self._indexing.setdefault(folder, threading.RLock())
        with lock:
            with self._guard:
                todo = self._batches.pop(folder, [])
            try:
                yield todo
            except BaseException:  # (a batch already added is a no-op the second time)
                with self._guard:
                    self._batches[folder] = todo + self._batches.get(folder, [])
                raise
