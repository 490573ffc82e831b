"""Line-aware chunking of a session's turns into overlapping chunks of about N tokens.

A turn is rendered as one *unit* ``"<role>: <content>"``. A chunk is a run of whole units:
units are added while the chunk stays within ``chunk_tokens``; the next chunk starts at the
earliest unit such that the units it repeats from the previous chunk total at most
``overlap`` tokens (whole units only, so the overlap is "about" ``overlap``). A unit is split
only when it alone exceeds a chunk: at its line breaks, and a single over-long line at word
boundaries; the pieces keep the turn id.

Chunking is a pure function of the units, so chunking from the start of the last chunk gives
the same chunks as chunking everything again: that is how new turns are indexed incrementally
(only the open, last chunk changes) and why a rebuild from the files gives identical ids.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cwm_plugin.memory.models import Chunk, Turn
from cwm_plugin.memory.tokens import TokenCounter


@dataclass
class Unit:
    """One indivisible line of a chunk: a turn, or a piece of an over-long turn."""

    text: str
    turn_id: str
    ts: str
    tokens: int


def turn_units(turn: Turn, counter: TokenCounter, max_tokens: int) -> list[Unit]:
    text = f"{turn.role}: {turn.content.strip()}"
    n = counter.count(text)
    if n <= max_tokens:
        return [Unit(text, turn.turn_id, turn.ts, n)]
    pieces: list[str] = []
    for line in text.splitlines() or [text]:
        if counter.count(line) <= max_tokens:
            pieces.append(line)
            continue
        cur: list[str] = []
        for word in line.split(" "):
            if cur and counter.count(" ".join([*cur, word])) > max_tokens:
                pieces.append(" ".join(cur))
                cur = []
            cur.append(word)  # a single word longer than a chunk stays whole
        if cur:
            pieces.append(" ".join(cur))
    units: list[Unit] = []
    buf: list[str] = []
    for p in pieces:  # pack consecutive lines back together while they fit
        if buf and counter.count("\n".join([*buf, p])) > max_tokens:
            units.append(Unit("\n".join(buf), turn.turn_id, turn.ts, 0))
            buf = []
        buf.append(p)
    if buf:
        units.append(Unit("\n".join(buf), turn.turn_id, turn.ts, 0))
    for u in units:
        u.tokens = counter.count(u.text)
    return units


def chunk_id(session: str, text: str) -> str:
    return hashlib.sha256(f"{session}\n{text}".encode()).hexdigest()


def make_chunk(session: str, units: list[Unit], counter: TokenCounter | None,
               tokens: int | None = None) -> Chunk:
    """The chunk of ``units``; ``tokens`` (known from a saved index) skips the counting."""
    header = f"[session {session}, {units[0].ts[:10]}]"
    text = "\n".join([header, *(u.text for u in units)])
    turn_ids: list[str] = []
    for u in units:
        if not turn_ids or turn_ids[-1] != u.turn_id:
            turn_ids.append(u.turn_id)
    return Chunk(chunk_id=chunk_id(session, text), session=session, text=text,
                 turn_ids=turn_ids, lines=[u.text for u in units],
                 tokens=tokens if tokens is not None else counter.count(text),  # type: ignore[union-attr]
                 ts=units[-1].ts)


def spans(units: list[Unit], start: int, chunk_tokens: int, overlap: int,
          header_tokens: int = 12) -> list[tuple[int, int]]:
    """``(begin, end)`` unit ranges of the chunks from ``start``; the last one may be open."""
    out: list[tuple[int, int]] = []
    i = start
    n = len(units)
    while i < n:
        used = header_tokens
        j = i
        while j < n and (j == i or used + units[j].tokens + 1 <= chunk_tokens):
            used += units[j].tokens + 1
            j += 1
        out.append((i, j))
        if j >= n:
            break
        k = j  # the earliest start whose repeated units fit in the overlap
        tail = 0
        while k - 1 > i and tail + units[k - 1].tokens + 1 <= overlap:
            tail += units[k - 1].tokens + 1
            k -= 1
        i = k
    return out


def chunk_units(session: str, units: list[Unit], counter: TokenCounter, chunk_tokens: int,
                overlap: int, start: int = 0) -> list[tuple[int, int, Chunk]]:
    head = counter.count(f"[session {session}, 2000-01-01]")
    return [(b, e, make_chunk(session, units[b:e], counter))
            for b, e in spans(units, start, chunk_tokens, overlap, head)]
