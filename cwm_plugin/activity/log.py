"""An append-only activity log, so one provider picks up where another left off.

Each entry -- who (principal), when, session, project, what was done, its output, the context
use (used / limit / %) -- is appended to ``activity.jsonl`` with the SHA-256 of the previous
entry and its own: a hash chain, so an edited, removed or reordered line is visible to
:meth:`ActivityLog.verify`. ``activity.md`` beside it is the readable truth, one line an entry
ending in the first 12 hex digits of the entry's hash, and is checked against the chain too.
Appends from several processes take turns under a file lock, so the chain stays linear.
Nothing here rewrites or deletes an entry, and no API does.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cwm_plugin.errors import InvalidInput

GENESIS = "0" * 64
MAX_FIELD = 4000


@dataclass
class Entry:
    principal: str
    what: str
    session: str | None = None
    project: str | None = None
    output: str = ""
    used_tokens: int | None = None
    limit_tokens: int | None = None
    time: float = field(default_factory=time.time)
    prev: str = GENESIS
    hash: str = ""

    @property
    def percent(self) -> float | None:
        if not self.used_tokens or not self.limit_tokens:
            return None
        return round(100 * self.used_tokens / self.limit_tokens, 1)

    def body(self) -> dict:
        d = asdict(self)
        d.pop("hash")
        return d

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.body(), sort_keys=True,
                                         separators=(",", ":")).encode()).hexdigest()

    def markdown(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.time))
        ctx = (f" [context {self.used_tokens}/{self.limit_tokens} = {self.percent}%]"
               if self.percent is not None else "")
        where = " ".join(x for x in (f"session {self.session}" if self.session else "",
                                     f"project {self.project}" if self.project else "") if x)
        out = f" -> {_one_line(self.output)}" if self.output else ""
        return (f"- {when}Z **{self.principal}**{' (' + where + ')' if where else ''}: "
                f"{_one_line(self.what)}{out}{ctx} `{self.hash[:12]}`")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:500]


class ActivityLog:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.root / "activity.jsonl"
        self.md = self.root / "activity.md"
        self._lock = threading.Lock()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock, open(self.root / ".activity.lock", "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            yield

    def append(self, entry: Entry) -> Entry:
        """Chain and append one entry (both files, fsynced); returns it with its hash."""
        for name in ("principal", "what", "output", "session", "project"):
            value = getattr(entry, name)
            if value is not None and len(str(value)) > MAX_FIELD:
                raise InvalidInput(f"activity field {name} is over {MAX_FIELD} characters")
        if not entry.principal or not entry.what:
            raise InvalidInput("an activity entry needs a principal and what was done")
        with self._locked():
            entry.prev = self._last_hash()
            entry.time = time.time()
            entry.hash = entry.digest()
            _append(self.jsonl, json.dumps(asdict(entry), sort_keys=True) + "\n")
            _append(self.md, entry.markdown() + "\n")
        return entry

    def _last_hash(self) -> str:
        if not self.jsonl.exists() or self.jsonl.stat().st_size == 0:
            return GENESIS
        with open(self.jsonl, "rb") as f:
            f.seek(max(0, self.jsonl.stat().st_size - 65536))
            last = f.read().splitlines()[-1]
        return json.loads(last)["hash"]

    def entries(self) -> list[Entry]:
        if not self.jsonl.exists():
            return []
        return [Entry(**json.loads(line)) for line in self.jsonl.read_text().splitlines()
                if line.strip()]

    def quick(self, *, hours: float = 24.0, limit: int = 10) -> list[Entry]:
        """The last ``limit`` entries of the last ``hours``: where to pick up."""
        since = time.time() - hours * 3600
        return [e for e in self.entries() if e.time >= since][-limit:]

    def verify(self) -> list[str]:
        """What is wrong with the log (empty: the chain and the markdown are intact)."""
        problems: list[str] = []
        prev = GENESIS
        entries: list[Entry] = []
        if self.jsonl.exists():
            for n, line in enumerate(self.jsonl.read_text().splitlines(), 1):
                try:
                    e = Entry(**json.loads(line))
                except (ValueError, TypeError) as exc:
                    problems.append(f"activity.jsonl line {n} is not an entry: {exc}")
                    continue
                if e.prev != prev:
                    problems.append(f"activity.jsonl line {n} does not follow the line before "
                                    "(an entry was removed, inserted or reordered)")
                if e.digest() != e.hash:
                    problems.append(f"activity.jsonl line {n} was edited (its hash does not "
                                    "match its content)")
                prev = e.hash
                entries.append(e)
        md = self.md.read_text().splitlines() if self.md.exists() else []
        if [e.markdown() for e in entries] != md:
            problems.append("activity.md differs from the hash chain in activity.jsonl")
        return problems


def _append(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
