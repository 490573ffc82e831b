"""Copy a memory from one truth to another: ``cwm memory migrate`` (markdown files into
PostgreSQL) and ``cwm memory export`` (PostgreSQL back out to markdown files).

A copy can be run again and resumes: a session the destination holds whole is skipped, one it
holds a beginning of (an interrupted copy, or turns added since) gets the rest appended, and one
that differs from the source is left alone and reported (a conflict: nothing is overwritten).
Summaries and the background work's cursors are the source's; durable memories are merged by
id (the source's first, then any only the destination has). What is derived (indexes, access
counts, the embedding cache) is not copied: each side rebuilds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from cwm_plugin.memory.files.markdown import encode_turn
from cwm_plugin.memory.files.truth import MemoryTruth
from cwm_plugin.memory.models import Memory

log = logging.getLogger(__name__)
CURSORS = ("facts",)  # the background work's cursors (sidecar/background/maintainer.py)
BATCH = 500  # turns a transaction


@dataclass
class CopyReport:
    folders: int = 0
    sessions: int = 0          # sessions whose turns were copied (whole or the rest)
    turns: int = 0
    skipped: int = 0           # already whole in the destination
    memories: int = 0          # memories the destination gained
    summaries: int = 0
    conflicts: list[str] = field(default_factory=list)  # "folder/session: why"

    def line(self) -> str:
        return (f"{self.folders} folders: {self.sessions} sessions copied ({self.turns} turns), "
                f"{self.skipped} already there, {self.memories} memories, {self.summaries} "
                f"summaries, {len(self.conflicts)} conflicts")


def copy_memory(src: MemoryTruth, dst: MemoryTruth, folders: list[str] | None = None, *,
                progress: bool = True,
                on_conflict: Callable[[str], None] | None = None) -> CopyReport:
    """Copy ``folders`` (default: every folder of ``src``) into ``dst``; see the module."""
    report = CopyReport()
    names = folders if folders is not None else src.folders()
    total = sum(len(src.sessions(f)) for f in names)
    with tqdm(total=total, desc="copy", unit="session", disable=not progress) as bar:
        for folder in names:
            report.folders += 1
            for session in src.sessions(folder):
                why = _copy_session(src, dst, folder, session, report)
                if why:
                    report.conflicts.append(f"{folder}/{session}: {why}")
                    log.warning("memory copy: %s/%s left alone: %s", folder, session, why)
                    if on_conflict is not None:
                        on_conflict(report.conflicts[-1])
                bar.update(1)
            report.memories += _merge_memories(src, dst, folder)
    return report


def _copy_session(src: MemoryTruth, dst: MemoryTruth, folder: str, session: str,
                  report: CopyReport) -> str:
    """Copy one session's turns, summary and cursors; returns why not ("" when copied)."""
    turns = src.read_turns(folder, session)
    got = dst.session_data(folder, session)
    have = got[0] if got else b""
    runs = [encode_turn(t) for t in turns]
    at = 0
    done = 0
    while done < len(runs) and at + len(runs[done]) <= len(have):
        if have[at:at + len(runs[done])] != runs[done]:
            break
        at += len(runs[done])
        done += 1
    if at != len(have):
        return ("the destination holds turns the source does not (delete the session there, "
                "or copy into another folder)")
    if done == len(runs):
        report.skipped += 1
    else:
        for i in range(done, len(runs), BATCH):
            dst.append_turns(folder, session, turns[i:i + BATCH])
        report.sessions += 1
        report.turns += len(runs) - done
    summary = src.read_summary(folder, session)
    if summary is not None and dst.read_summary(folder, session) != summary:
        dst.write_summary(folder, session, summary[0], summary[1])
        report.summaries += 1
    for name in CURSORS:
        cursor = src.read_cursor(folder, session, name)
        if cursor and dst.read_cursor(folder, session, name) != cursor:
            dst.write_cursor(folder, session, name, cursor)
    return ""


def _merge_memories(src: MemoryTruth, dst: MemoryTruth, folder: str) -> int:
    """The source's memories (replaced ones too), then those only the destination has;
    returns how many the destination gained (0, and nothing written, when it had them)."""
    theirs = src.read_memories(folder, history=True)
    ids = {m.id for m in theirs}
    if not theirs or [asdict(m) for m in theirs] == \
            [asdict(m) for m in dst.read_memories(folder, history=True) if m.id in ids]:
        return 0
    gained: list[int] = []

    def merge(mine: list[Memory]) -> list[Memory]:
        gained.append(len(ids - {m.id for m in mine}))
        return [*theirs, *(m for m in mine if m.id not in ids)]

    dst.update_memories(folder, merge)
    return gained[0]
