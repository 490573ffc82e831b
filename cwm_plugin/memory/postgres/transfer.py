"""Copy a memory from one truth to another: ``cwm memory migrate`` (markdown files into
PostgreSQL) and ``cwm memory export`` (PostgreSQL back out to markdown files).

A copy can be run again and resumes: a session the destination holds whole is skipped, one it
holds a beginning of (an interrupted copy, or turns added since) gets the rest appended, and one
that differs from the source is left alone and reported (a conflict: nothing is overwritten).
Summaries and the background work's cursors are the source's; the source's durable memories
the destination lacks are added (one both hold that differs is reported and left as the
destination has it). A session the database refuses (a duplicate id, say) is reported too;
the copy goes on with the others. What is derived (indexes, access
counts, the embedding cache) is not copied: each side rebuilds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import psycopg
from tqdm import tqdm

from cwm_plugin.memory.files.markdown import encode_turn
from cwm_plugin.memory.files.truth import MemoryTruth

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
                try:
                    why = _copy_session(src, dst, folder, session, report)
                except (psycopg.DataError, psycopg.IntegrityError) as exc:
                    why = f"refused by the database ({type(exc).__name__}: {exc})"[:300]
                if why:
                    report.conflicts.append(f"{folder}/{session}: {why}")
                    log.warning("memory copy: %s/%s left alone: %s", folder, session, why)
                    if on_conflict is not None:
                        on_conflict(report.conflicts[-1])
                bar.update(1)
            gained, differ = _merge_memories(src, dst, folder)
            report.memories += gained
            for mid in differ:
                report.conflicts.append(f"{folder}/memories: {mid} differs between the two "
                                        "sides (the destination's is kept)")
                log.warning("memory copy: %s", report.conflicts[-1])
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


def _merge_memories(src: MemoryTruth, dst: MemoryTruth, folder: str
                    ) -> tuple[int, list[str]]:
    """Add the source's memories (replaced ones too) the destination lacks, after its own;
    returns how many it gained and the ids both hold that differ (left as the destination has
    them: it may have moved on since an earlier copy, a fact replaced there, say)."""
    theirs = src.read_memories(folder, history=True)
    mine = {m.id: m for m in dst.read_memories(folder, history=True)}
    differ = [m.id for m in theirs if m.id in mine and asdict(m) != asdict(mine[m.id])]
    new = [m for m in theirs if m.id not in mine]
    if new:  # (the lock held, what another writer added meanwhile is kept)
        dst.update_memories(folder, lambda ms: [
            *ms, *(m for m in new if m.id not in {x.id for x in ms})])
    return len(new), differ
