"""An append-only activity log, so one provider picks up where another left off.

Each entry -- who (principal), when, session, project, model, what was done, its output, the
context use (used / limit / %) -- is appended to ``activity.jsonl`` with the SHA-256 of the
previous entry and its own: a hash chain, so an edited, removed, inserted or reordered line is
visible to :meth:`ActivityLog.verify`. ``activity.md`` beside it is the readable truth, one line
an entry ending in the first 12 hex digits of the entry's hash, and is checked against the chain
too. Appends from several threads or processes take turns under a file lock (``flock``), so the
chain stays linear. Nothing here rewrites or deletes an entry.

A hash chain without a secret shows naive edits; someone who can write the files can also
recompute every hash after an edit, or cut entries off the end. :meth:`ActivityLog.head` (the
last hash) is what to record elsewhere to detect that. A line cut short by a crash is reported
by ``verify`` and never breaks later appends: the next entry starts on a new line and chains to
the last complete one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cwm_plugin.errors import InvalidInput

GENESIS = "0" * 64
MAX_TEXT = 4000   # what and output, in characters
MAX_NAME = 256    # principal, session, project, model
_STR, _OPT_STR, _OPT_INT = (str,), (str, type(None)), (int, type(None))
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "principal": _STR, "what": _STR, "session": _OPT_STR, "project": _OPT_STR,
    "model": _OPT_STR, "output": _STR, "used_tokens": _OPT_INT, "limit_tokens": _OPT_INT,
    "time": (int, float), "prev": _STR, "hash": _STR,
}


def _one_line(text: str | None, limit: int = 500) -> str:
    return " ".join(str(text or "").split())[:limit]


@dataclass
class Entry:
    """One line of the log (``time``, ``prev`` and ``hash`` are set by :meth:`ActivityLog.append`)."""

    principal: str
    what: str
    session: str | None = None
    project: str | None = None
    model: str | None = None
    output: str = ""
    used_tokens: int | None = None
    limit_tokens: int | None = None
    time: float = field(default_factory=time.time)
    prev: str = GENESIS
    hash: str = ""

    @classmethod
    def from_json(cls, line: str | bytes) -> Entry:
        """Parse one stored line strictly (every field, the right types); ValueError if not."""
        obj = json.loads(line)
        if not isinstance(obj, dict) or set(obj) != set(FIELD_TYPES):
            raise ValueError("not an entry (fields missing or unknown)")
        for name, types in FIELD_TYPES.items():
            value = obj[name]
            if isinstance(value, bool) or not isinstance(value, types):
                raise ValueError(f"field {name} has the wrong type")
        return cls(**obj)

    @property
    def percent(self) -> float | None:
        if self.used_tokens is None or not self.limit_tokens:
            return None
        return round(100 * self.used_tokens / self.limit_tokens, 1)

    def body(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("hash")
        return d

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.body(), sort_keys=True,
                                         separators=(",", ":")).encode()).hexdigest()

    def public(self) -> dict[str, Any]:
        """The entry as an API returns it (with the context use in percent)."""
        return {**asdict(self), "percent": self.percent}

    def markdown(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.time))
        ctx = (f" [context {self.used_tokens}/{self.limit_tokens} = {self.percent}%]"
               if self.percent is not None else "")
        where = ", ".join(f"{k} {_one_line(v, MAX_NAME)}" for k, v in
                          (("session", self.session), ("project", self.project),
                           ("model", self.model)) if v)
        out = f" -> {_one_line(self.output)}" if self.output else ""
        return (f"- {when}Z **{_one_line(self.principal, MAX_NAME)}**"
                f"{' (' + where + ')' if where else ''}: {_one_line(self.what)}{out}{ctx} "
                f"`{self.hash[:12]}`")


def check(entry: Entry) -> None:
    """Refuse an entry that is not worth a line (InvalidInput, nothing written)."""
    if not entry.principal or not entry.what.strip():
        raise InvalidInput("an activity entry needs a principal and what was done")
    for name in ("what", "output"):
        if len(getattr(entry, name)) > MAX_TEXT:
            raise InvalidInput(f"activity field {name} is over {MAX_TEXT} characters")
    for name in ("principal", "session", "project", "model"):
        value = getattr(entry, name)
        if value is not None and len(value) > MAX_NAME:
            raise InvalidInput(f"activity field {name} is over {MAX_NAME} characters")
    for name in ("used_tokens", "limit_tokens"):
        value = getattr(entry, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise InvalidInput(f"activity field {name} must be a whole number >= 0")


Who = str | Callable[[str], bool] | None  # a principal, a test of one, or anyone


def _by(entry: Entry, principal: Who) -> bool:
    """Whether ``entry`` was written by ``principal`` (a name, a test, None: anyone)."""
    if principal is None:
        return True
    return entry.principal == principal if isinstance(principal, str) \
        else principal(entry.principal)


class ActivityLog:
    """``activity.jsonl`` (the chain) and ``activity.md`` (readable) under ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.root / "activity.jsonl"
        self.md = self.root / "activity.md"
        self._lock = threading.Lock()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock, open(self.root / ".activity.lock", "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file closes
            yield

    def append(self, entry: Entry) -> Entry:
        """Chain and append one entry (both files, fsynced); returns it with its hash."""
        check(entry)
        with self._locked():
            entry.prev = self.head()
            entry.time = time.time()
            entry.hash = entry.digest()
            _append(self.jsonl, json.dumps(asdict(entry), sort_keys=True) + "\n")
            _append(self.md, entry.markdown() + "\n")
        return entry

    def head(self) -> str:
        """The hash of the last complete entry (``GENESIS`` for an empty log)."""
        for line in _reverse_lines(self.jsonl):
            try:
                return Entry.from_json(line).hash
            except ValueError:
                continue  # a line cut short by a crash (verify reports it)
        return GENESIS

    def _newest_first(self) -> Iterator[Entry]:
        for line in _reverse_lines(self.jsonl):
            try:
                yield Entry.from_json(line)
            except ValueError:
                continue

    def entries(self) -> list[Entry]:
        """Every readable entry, oldest first."""
        return list(reversed(list(self._newest_first())))

    def quick(self, *, hours: float = 24.0, limit: int = 10,
              principal: Who = None) -> list[Entry]:
        """The last ``limit`` entries of the last ``hours`` (of ``principal`` when given: a
        name or a test of one), oldest first: where to pick up. Reads the file from its end only as
        far as needed."""
        since = time.time() - hours * 3600
        out: list[Entry] = []
        for e in self._newest_first():
            if e.time < since or len(out) >= limit:
                break
            if _by(e, principal):
                out.append(e)
        return out[::-1]

    def page(self, *, offset: int = 0, limit: int = 100,
             principal: Who = None) -> tuple[list[Entry], int]:
        """Entries ``offset`` .. ``offset + limit`` (oldest first) and how many there are."""
        every = [e for e in self.entries() if _by(e, principal)]
        return every[offset:offset + limit], len(every)

    def verify(self) -> list[str]:
        """What is wrong with the log (empty: the chain and the markdown are intact)."""
        problems: list[str] = []
        prev = GENESIS
        entries: list[Entry] = []
        lines = self.jsonl.read_bytes().split(b"\n") if self.jsonl.exists() else []
        if lines and lines[-1] == b"":
            lines.pop()
        elif lines:
            problems.append(f"activity.jsonl line {len(lines)} is incomplete (no line end)")
        for n, line in enumerate(lines, 1):
            try:
                e = Entry.from_json(line)
            except ValueError as exc:
                problems.append(f"activity.jsonl line {n} is not an entry: {exc}")
                continue
            if e.prev != prev:
                problems.append(f"activity.jsonl line {n} does not follow the entry before "
                                "(an entry was removed, inserted or reordered)")
            if e.digest() != e.hash:
                problems.append(f"activity.jsonl line {n} was edited (its hash does not "
                                "match its content)")
            prev = e.hash
            entries.append(e)
        md = self.md.read_text(errors="replace").splitlines() if self.md.exists() else []
        expected = [e.markdown() for e in entries]
        if expected != md:
            at = next((i for i, (a, b) in enumerate(zip(expected, md, strict=False))
                       if a != b),
                      min(len(expected), len(md)))
            problems.append(f"activity.md differs from the hash chain in activity.jsonl from "
                            f"line {at + 1} on ({len(md)} lines for {len(expected)} entries)")
        return problems


def _reverse_lines(path: Path, chunk: int = 65536) -> Iterator[bytes]:
    """The non-empty lines of ``path`` from the last to the first, read in chunks from the end
    (a line may be longer than a chunk)."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        pos = f.seek(0, os.SEEK_END)
        rest = b""
        while pos > 0:
            step = min(chunk, pos)
            pos -= step
            f.seek(pos)
            parts = (f.read(step) + rest).split(b"\n")
            rest = parts[0]
            for line in reversed(parts[1:]):
                if line.strip():
                    yield line
        if rest.strip():
            yield rest


def _append(path: Path, text: str) -> None:
    """One ``write`` in append mode, after a line end if a crash left the file without one."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        data = text.encode()
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
