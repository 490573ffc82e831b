"""What the memory's truth must do: ``MemoryTruth``, the one surface the service reads and
writes through.

Two kinds keep it: markdown files on one machine (:class:`~cwm_plugin.memory.files.markdown.
MemoryFiles`, the embedded default) and PostgreSQL shared by every sidecar replica
(:class:`~cwm_plugin.memory.postgres.truth.PostgresTruth`). Both hold a session's transcript as
the same append-only run of encoded turn records (``markdown.encode_turn``), so a session has a
size in bytes, appends return byte offsets, and the indexes (``index/folders.py``) keep up with
either the same way: a session whose ``(size, version)`` moved is read again from the offset
indexed so far. ``version`` is a file's mtime in nanoseconds, or a database row's counter; a
signature of the durable memories works alike. Everything derived (saved indexes, the
embedding cache, access counts) lives under ``root`` on the local disk, either way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from cwm_plugin.memory.models import Memory, Turn


class MemoryTruth(Protocol):
    root: Path  # the local folder for derived data (saved indexes, caches)

    def folders(self) -> list[str]: ...

    def sessions(self, folder: str) -> list[str]: ...

    def append_turns(self, folder: str, session: str, turns: list[Turn]) -> tuple[int, int]:
        """Append the records at once; their ``(start, end)`` byte offsets in the session."""

    def read_turns(self, folder: str, session: str) -> list[Turn]: ...

    def read_turns_from(self, folder: str, session: str, offset: int
                        ) -> tuple[list[Turn], int]: ...

    def session_stats(self, folder: str) -> dict[str, tuple[int, int]]:
        """``{session: (size, version)}`` for every session of the folder."""

    def session_data(self, folder: str, session: str) -> tuple[bytes, int] | None:
        """The session's whole record run and its version; None when it does not exist."""

    def folder_signature(self, folder: str) -> object | None:
        """Moves whenever any session of the folder changes, in one cheap answer; None when
        the truth cannot tell so cheaply (then every session is looked at)."""

    def session_stat(self, folder: str, session: str) -> tuple[int, int] | None:
        """One session's ``(size, version)``; None when it does not exist."""

    def read_memories(self, folder: str, *, history: bool = False) -> list[Memory]: ...

    def scan_memories(self, folder: str) -> tuple[list[Memory], list[tuple[int, str]]]: ...

    def update_memories(self, folder: str, fn: Callable[[list[Memory]], list[Memory]]
                        ) -> list[Memory]:
        """Change every memory (replaced ones too) under a lock every writer respects."""

    def memories_signature(self, folder: str) -> tuple[int, int] | None:
        """Moves whenever the folder's memories change; None when it has none."""

    def read_summary(self, folder: str, session: str) -> tuple[str, str] | None: ...

    def write_summary(self, folder: str, session: str, text: str, upto_turn: str) -> None: ...

    def read_cursor(self, folder: str, session: str, name: str) -> str: ...

    def write_cursor(self, folder: str, session: str, name: str, turn_id: str) -> None: ...

    def close(self) -> None: ...
