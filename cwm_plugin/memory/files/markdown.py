"""Markdown files, the source of truth: transcripts, daily logs, durable memories, summaries.

Layout under the root, one folder a memory (in the sidecar: a principal's own, a user's
``u-<32 hex>``, ``global`` or ``project.<name>``)::

    <root>/<folder>/sessions/<session>.md     one turn appended at a time, never rewritten
    <root>/<folder>/daily/<YYYY-MM-DD>.md      one line a turn, for people reading along
    <root>/<folder>/memories.md                durable memories, one line each
    <root>/<folder>/summaries/<session>.md     the running summary of a session
    <root>/<folder>/cursors/<session>.json     the last turn fact extraction covered

Every turn record is a visible heading plus a machine line carrying the exact byte length of
the content, so any text (even text that looks like a header) reads back verbatim, and a torn
tail from a crash is detected and ignored. Appends and reads go through ``durable.py``
(an exclusive ``flock`` to append, a shared one to read, so a reader never sees half an
append; a failed append is cut back); files that are replaced (memories, summaries) are
written to a temporary file, fsynced and renamed over the old one.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from cwm_plugin.memory.files.durable import append_durable, file_lock, read_locked, replace_durable
from cwm_plugin.memory.files.names import NAME, check_memory_name
from cwm_plugin.memory.models import Memory, Turn

log = logging.getLogger(__name__)
DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")  # a daily file's name
TURN_MARK = b"<!-- cwm-turn "
MEM_MARK = "<!-- cwm-mem "
SUMMARY_MARK = "<!-- cwm-summary "
END = " -->"


def _mark_safe_json(data: dict) -> str:
    """JSON with ``<`` and ``>`` escaped, so no text can end or start a marker early."""
    return json.dumps(data, ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e")


OPTIONAL = ("key", "source", "replaced_by", "until")  # written only when set
HISTORY_HEADING = "## History (replaced by newer facts)"


def memory_line(m: Memory) -> str:
    """One line of memories.md: readable text, then the machine-readable record; a replaced
    memory is struck through and says by which memory and when."""
    data = {"id": m.id, "text": m.text, "category": m.category,
            "importance": round(m.importance, 4), "access_count": m.access_count,
            "created": m.created}
    data.update({k: getattr(m, k) for k in OPTIONAL if getattr(m, k)})
    meta = _mark_safe_json(data)
    shown = f"**{m.category}** ({m.importance:.2f}) {m.text}"
    if m.replaced_by:
        shown = f"~~{shown}~~ (until {m.until[:10]}, replaced by {m.replaced_by})"
    return f"- {shown} {MEM_MARK}{meta}{END}"


def parse_memory_line(line: str) -> Memory | None:
    """The memory a line records, or None. The record is the marker whose JSON parses (older
    files did not escape a marker quoted in a memory's text, so every occurrence is tried)."""
    end = line.rfind(END)
    i = line.find(MEM_MARK)
    while 0 <= i < end:
        try:
            meta = json.loads(line[i + len(MEM_MARK):end])
            return Memory(id=str(meta["id"]), text=str(meta["text"]),
                          category=str(meta["category"]), importance=float(meta["importance"]),
                          access_count=int(meta["access_count"]), created=str(meta["created"]),
                          **{k: str(meta.get(k) or "") for k in OPTIONAL})
        except (ValueError, KeyError, TypeError):
            i = line.find(MEM_MARK, i + 1)
    return None


def summary_meta(head: str) -> dict | None:
    """The JSON of a summary's header line, or None when it is damaged."""
    try:
        meta = json.loads(head[len(SUMMARY_MARK):head.rindex(END)])
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def utc_iso(ts: datetime | None = None) -> str:
    ts = ts or datetime.now(UTC)
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=UTC)
    return ts.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def encode_turn(turn: Turn) -> bytes:
    body = turn.content.encode("utf-8")
    meta = json.dumps({"id": turn.turn_id, "role": turn.role, "ts": turn.ts,
                       "bytes": len(body)}, ensure_ascii=True)
    head = f"### {turn.role} · {turn.ts} · {turn.turn_id}\n".encode()
    return head + TURN_MARK + meta.encode() + b" -->\n" + body + b"\n\n"


def decode_turns(data: bytes) -> list[Turn]:
    """Every complete turn record in ``data``; a torn or garbled record is skipped."""
    return decode_turns_at(data)[0]


def decode_turns_at(data: bytes) -> tuple[list[Turn], int]:
    """The complete records in ``data`` and the offset just after the last one.

    A record must end with its blank line; a header whose length runs past the end of the data
    (a writer died mid-append) stops the scan there, and one whose body is not followed by the
    blank line (garbage, or a torn record that later appends ran into) is skipped.
    """
    out: list[Turn] = []
    pos = end = 0
    while True:
        i = data.find(TURN_MARK, pos)
        if i < 0:
            break
        j = data.find(b" -->\n", i)
        if j < 0 or (i > 0 and data[i - 1:i] != b"\n"):
            pos = i + 1
            continue
        try:
            meta = json.loads(data[i + len(TURN_MARK):j])
            n = int(meta["bytes"])
            start = j + 5
            if start + n + 2 > len(data):
                if data.find(TURN_MARK, i + 1) < 0:
                    break  # torn tail: the writer died mid-append
                pos = i + 1
                continue
            if data[start + n:start + n + 2] != b"\n\n":
                pos = i + 1
                continue
            out.append(Turn(str(meta["id"]), str(meta["role"]),
                            data[start:start + n].decode("utf-8"), str(meta["ts"])))
            pos = end = start + n + 2
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            pos = i + 1
    return out, end


class MemoryFiles:
    """All file access of one memory root; names are validated before any path is built."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._strays: set[str] = set()  # names skipped (and logged) once

    def close(self) -> None:
        """Nothing held open (the truth's interface: a database closes its pool)."""

    # --- paths -----------------------------------------------------------------------------

    def folder_dir(self, folder: str) -> Path:
        return self.root / check_memory_name("folder", folder)

    def session_path(self, folder: str, session: str) -> Path:
        return self.folder_dir(folder) / "sessions" / f"{check_memory_name('session', session)}.md"

    def summary_path(self, folder: str, session: str) -> Path:
        return self.folder_dir(folder) / "summaries" / f"{check_memory_name('session', session)}.md"

    def memories_path(self, folder: str) -> Path:
        return self.folder_dir(folder) / "memories.md"

    def folders(self) -> list[str]:
        """The memory folders under the root; a folder whose name no memory folder could have
        ("alice copy", ".index") is not one."""
        if not self.root.is_dir():
            return []
        return sorted(self._named(p.name for p in self.root.iterdir() if p.is_dir()
                                  and not p.name.startswith(".")))

    def sessions(self, folder: str) -> list[str]:
        """The folder's session files; a stray file whose name no session could have ("s1
        copy.md", macOS's "._s1.md") is skipped and logged, never a failed index build."""
        d = self.folder_dir(folder) / "sessions"
        return sorted(self._named(p.stem for p in d.glob("*.md"))) if d.is_dir() else []

    def _named(self, names: Iterable[str]) -> list[str]:
        out = []
        for name in names:
            if NAME.fullmatch(name) and ".." not in name:
                out.append(name)
            elif name not in self._strays:
                self._strays.add(name)
                log.warning("memory root %s: %r is not a valid folder or session name; "
                            "skipped (rename or move it)", self.root, name)
        return out

    # --- transcripts -------------------------------------------------------------------------

    def append_turn(self, folder: str, session: str, turn: Turn) -> tuple[int, int]:
        """Append one record; returns its (start, end) byte offsets in the session file."""
        return self.append_turns(folder, session, [turn])

    def append_turns(self, folder: str, session: str, turns: list[Turn]) -> tuple[int, int]:
        """Append records in one durable write (one fsync for an exchange, not one a turn);
        returns their (start, end) byte offsets in the session file."""
        path = self.session_path(folder, session)
        path.parent.mkdir(parents=True, exist_ok=True)
        span = append_durable(path, b"".join(encode_turn(t) for t in turns))
        self._daily(folder, session, turns)
        return span

    def read_turns(self, folder: str, session: str) -> list[Turn]:
        return self.read_turns_from(folder, session, 0)[0]

    def read_turns_from(self, folder: str, session: str, offset: int) -> tuple[list[Turn], int]:
        """Complete turns from byte ``offset`` on, and the offset after the last of them."""
        path = self.session_path(folder, session)
        if not path.exists():
            return [], offset
        turns, used = decode_turns_at(read_locked(path, offset))
        return turns, offset + used

    def session_stats(self, folder: str) -> dict[str, tuple[int, int]]:
        """``{session: (size, mtime_ns)}`` of the folder's session files (one directory scan)."""
        d = self.folder_dir(folder) / "sessions"
        out: dict[str, tuple[int, int]] = {}
        try:
            entries = list(os.scandir(d))
        except FileNotFoundError:
            return out
        for e in entries:
            if e.name.endswith(".md") and NAME.fullmatch(e.name[:-3]) and ".." not in e.name \
                    and e.is_file():  # files named otherwise by hand are not sessions
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                out[e.name[:-3]] = (st.st_size, st.st_mtime_ns)
        return out

    def session_data(self, folder: str, session: str) -> tuple[bytes, int] | None:
        """The session file's bytes (never half an append another writer is making) and its
        mtime in nanoseconds; None when there is no such file."""
        path = self.session_path(folder, session)
        try:
            mtime = path.stat().st_mtime_ns
            return read_locked(path), mtime
        except FileNotFoundError:
            return None

    def folder_signature(self, folder: str) -> None:
        """None: a file appended to does not move its directory; every file is looked at."""
        return None

    def session_stat(self, folder: str, session: str) -> tuple[int, int] | None:
        """``(size, mtime_ns)`` of the session file; None when there is none."""
        try:
            st = self.session_path(folder, session).stat()
        except FileNotFoundError:
            return None
        return st.st_size, st.st_mtime_ns

    def memories_signature(self, folder: str) -> tuple[int, int] | None:
        """``(size, mtime_ns)`` of memories.md; None when there is none."""
        try:
            st = self.memories_path(folder).stat()
        except FileNotFoundError:
            return None
        return st.st_size, st.st_mtime_ns

    def _daily(self, folder: str, session: str, turns: list[Turn]) -> None:
        by_day: dict[str, list[str]] = {}
        for turn in turns:
            day, _, clock = turn.ts.partition("T")
            if not DAY.fullmatch(day):  # (the file's name: never a path from a stamp)
                day, clock = "undated", " ".join(turn.ts.split())[:40]
            one_line = " ".join(turn.content.split())
            one_line = one_line[:160] + ("…" if len(one_line) > 160 else "")
            by_day.setdefault(day or "undated", []).append(
                f"- {clock or turn.ts} [{session}] {turn.role}: {one_line} ({turn.turn_id})\n")
        for day, lines in by_day.items():
            path = self.folder_dir(folder) / "daily" / f"{day}.md"
            path.parent.mkdir(parents=True, exist_ok=True)
            # the daily log is for people reading along: no fsync (the session file has one)
            append_durable(path, "".join(lines).encode("utf-8"), sync=False)

    # --- durable memories --------------------------------------------------------------------

    def read_memories(self, folder: str, *, history: bool = False) -> list[Memory]:
        """The durable memories in force (with ``history``: the replaced ones too); a line that
        does not parse is skipped (and logged): a broken line must never take the folder's
        memory down (``cwm memory check`` lists them)."""
        mems, bad = self.scan_memories(folder)
        for n, _ in bad:
            log.warning("folder %s: memories.md line %d is not a valid memory line; skipped "
                        "(run `cwm memory check`)", folder, n)
        return mems if history else [m for m in mems if m.active]

    def scan_memories(self, folder: str) -> tuple[list[Memory], list[tuple[int, str]]]:
        """``(memories, [(line number, line) of every memory line that does not parse])``."""
        path = self.memories_path(folder)
        if not path.exists():
            return [], []
        out: list[Memory] = []
        bad: list[tuple[int, str]] = []
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace")
                                 .splitlines(), 1):
            if MEM_MARK not in line:
                continue
            m = parse_memory_line(line)
            if m is None:
                bad.append((n, line))
            else:
                out.append(m)
        return out, bad

    def update_memories(self, folder: str, fn) -> list[Memory]:
        """Read, change (``fn(list) -> list``, every memory, replaced ones included) and
        atomically rewrite memories.md, locked: the memories in force, then the history of
        replaced ones. Lines that do not parse are written back as they were (for a person to
        fix)."""
        path = self.memories_path(folder)
        with file_lock(path):
            parsed, bad = self.scan_memories(folder)
            mems = fn(parsed)
            lines = ["# Durable memories", ""]
            lines += [memory_line(m) for m in mems if m.active]
            lines += [raw for _, raw in bad]
            old = [memory_line(m) for m in mems if not m.active]
            if old:
                lines += ["", HISTORY_HEADING, "", *old]
            replace_durable(path, "\n".join(lines) + "\n")
        return mems

    # --- summaries ---------------------------------------------------------------------------

    def read_summary(self, folder: str, session: str) -> tuple[str, str] | None:
        """``(text, upto_turn)`` or ``None``; a damaged header line is logged and ignored
        (the summary is then taken as covering no turn, so the next update redoes it)."""
        path = self.summary_path(folder, session)
        if not path.exists():
            return None
        head, _, text = path.read_text(encoding="utf-8", errors="replace").partition("\n")
        if not head.startswith(SUMMARY_MARK):
            return (head + "\n" + text).strip(), ""
        meta = summary_meta(head)
        if meta is None:
            log.warning("folder %s: the header of summary %s is damaged; ignored (run `cwm "
                        "memory check`)", folder, session)
            return text.strip(), ""
        return text.strip(), str(meta.get("upto_turn", ""))

    def read_cursor(self, folder: str, session: str, name: str) -> str:
        """The id of the last turn the work ``name`` covered in the session ("" if none)."""
        path = self.folder_dir(folder) / "cursors" / f"{check_memory_name('session', session)}.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return ""
        return str(data.get(name, "")) if isinstance(data, dict) else ""

    def write_cursor(self, folder: str, session: str, name: str, turn_id: str) -> None:
        path = self.folder_dir(folder) / "cursors" / f"{check_memory_name('session', session)}.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = {}
        data = data if isinstance(data, dict) else {}
        data[name] = turn_id
        replace_durable(path, json.dumps(data) + "\n")

    def write_summary(self, folder: str, session: str, text: str, upto_turn: str) -> None:
        meta = _mark_safe_json({"upto_turn": upto_turn, "updated": utc_iso()})
        replace_durable(self.summary_path(folder, session),
                        f"{SUMMARY_MARK}{meta}{END}\n{text.strip()}\n")
