"""One hash chain of the activity log: one principal's entries, ``activity.jsonl`` and
``activity.md`` in one folder (:class:`Chain`), and the entry itself (:class:`Entry`).

Each entry -- who (principal), when, session, project, model, what was done, its output, the
context use (used / limit / %) -- is appended to ``activity.jsonl`` with the SHA-256 of the
previous entry of the same chain and its own, so an edited, removed, inserted or reordered line
is visible to :meth:`Chain.verify`, as is an entry of another principal copied in.
``activity.md`` beside it is the readable truth, one line an entry ending in the first 12 hex
digits of the entry's hash, and is checked against the chain too. A :class:`Chain` does no
locking: :class:`~cwm_plugin.activity.log.ActivityLog` holds the chain's lock around an append.

A hash chain without a secret shows naive edits; someone who can write the files can also
recompute every hash after an edit, or cut entries off the end. :meth:`Chain.head` (the last
hash) is what to record elsewhere to detect that. A line cut short by a crash is reported by
``verify`` and never breaks later appends: the next entry starts on a new line and chains to
the last complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
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


class Chain:
    """``<stem>.jsonl`` (the hashes) and ``<stem>.md`` (readable) in ``folder``: the entries of
    ``principal`` (None: of anyone, the single-chain format ``log.py`` moves);
    ``label``: how :meth:`verify` names the folder (a path relative to the log's root)."""

    def __init__(self, folder: Path, principal: str | None, *, stem: str = "activity",
                 label: str = "") -> None:
        self.folder = folder
        self.principal = principal
        self.jsonl = folder / f"{stem}.jsonl"
        self.md = folder / f"{stem}.md"
        self._label = label

    def extend(self, entries: list[Entry], *, keep_time: bool = False) -> list[Entry]:
        """Chain and append ``entries`` (both files, one fsync each; the caller holds the
        chain's lock); ``keep_time``: as they are (entries moved from another log), else now."""
        if not entries:
            return entries
        self.folder.mkdir(parents=True, exist_ok=True)
        prev, rows, lines = self.head(), [], []
        for entry in entries:
            entry.prev = prev
            entry.time = entry.time if keep_time else time.time()
            entry.hash = prev = entry.digest()
            rows.append(json.dumps(asdict(entry), sort_keys=True) + "\n")
            lines.append(entry.markdown() + "\n")
        _append(self.jsonl, "".join(rows))
        _append(self.md, "".join(lines))
        return entries

    def head(self) -> str:
        """The hash of the last complete entry (``GENESIS`` for an empty chain)."""
        return next((e.hash for e in self.newest_first()), GENESIS)

    def newest_first(self) -> Iterator[Entry]:
        """The readable entries, from the last one back (a line cut short is left out)."""
        for line in _reverse_lines(self.jsonl):
            try:
                yield Entry.from_json(line)
            except ValueError:
                continue  # a line cut short by a crash (verify reports it)

    def entries(self) -> list[Entry]:
        """Every readable entry, oldest first."""
        return list(reversed(list(self.newest_first())))

    def verify(self) -> list[str]:
        """What is wrong with the chain (empty: it and the markdown are intact)."""
        problems: list[str] = []
        name, md_name = self._label + self.jsonl.name, self._label + self.md.name
        prev = GENESIS
        entries: list[Entry] = []
        lines = self.jsonl.read_bytes().split(b"\n") if self.jsonl.exists() else []
        if lines and lines[-1] == b"":
            lines.pop()
        elif lines:
            problems.append(f"{name} line {len(lines)} is incomplete (no line end)")
        for n, line in enumerate(lines, 1):
            try:
                e = Entry.from_json(line)
            except ValueError as exc:
                problems.append(f"{name} line {n} is not an entry: {exc}")
                continue
            if e.prev != prev:
                problems.append(f"{name} line {n} does not follow the entry before "
                                "(an entry was removed, inserted or reordered)")
            if e.digest() != e.hash:
                problems.append(f"{name} line {n} was edited (its hash does not "
                                "match its content)")
            if self.principal is not None and e.principal != self.principal:
                problems.append(f"{name} line {n} is an entry of another principal "
                                "(moved in from another chain)")
            prev = e.hash
            entries.append(e)
        md = self.md.read_text(errors="replace").splitlines() if self.md.exists() else []
        expected = [e.markdown() for e in entries]
        if expected != md:
            at = next((i for i, (a, b) in enumerate(zip(expected, md, strict=False))
                       if a != b),
                      min(len(expected), len(md)))
            problems.append(f"{md_name} differs from the hash chain in {name} from "
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
