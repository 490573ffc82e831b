"""``cwm memory import``: past conversations into a folder's memory, in bulk.

Formats (``read_conversations``):

- **OpenAI messages, JSONL** (``*.jsonl``): one conversation a line, ``{"messages": [...]}``
  (optionally ``"session"``: its session name, and ``"ts"``: ISO time) or a bare list of
  messages. ``user``, ``assistant`` and ``tool`` messages are imported (text parts of a
  content list joined; an assistant's tool calls written as ``[tool call name(arguments)]``);
  system and developer messages are instructions, not conversation, and are left out.
- **LoCoMo** (``*.json``): a sample or a list of samples with ``session_N`` lists of turns
  ``{speaker, text}`` and ``session_N_date_time``; each session becomes one session named
  ``<sample>-s<N>``, each turn a line ``<speaker>: <text>``, timed by the session's date.

Faster than recording turn by turn (``import_sessions``): each session's file is written in one
append, then every new line of every session is embedded in one pass over the texts sorted by
length (so a batch pads to almost nothing, where a session's lines in file order pad every
batch to its longest line), and the index takes the prepared vectors session by session and
is saved once. With the local MiniLM model a large import is embedded by a pool of worker
processes of one torch thread each. Progress is shown in tokens (the index tokenizer's), and
the result says tokens/s.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.files.markdown import utc_iso
from cwm_plugin.memory.files.names import check_memory_name, check_role
from cwm_plugin.memory.index.embeddings import MiniLMEmbedder
from cwm_plugin.memory.models import Turn, new_turn_id

SLICE = 2048  # texts embedded per call (sorted by length; the embedder batches inside)
POOL_MIN = 4096  # texts below which worker processes cost more (loading) than they save
_SESSION = re.compile(r"session_(\d+)")
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_ROLE_UNSAFE = re.compile(r"[^A-Za-z0-9 _.'-]")


@dataclass
class ImportedConversation:
    session: str
    turns: list[tuple[str, str]]  # (role or speaker, text)
    ts: str | None = None


@dataclass
class ImportStats:
    sessions: int
    turns: int
    chunks: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "")


def _openai_turns(messages: list[Any], where: str) -> list[tuple[str, str]]:
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidInput(f"{where}: every message needs a string `role`")
        role = m["role"]
        if role not in ("user", "assistant", "tool"):
            continue
        calls = [f"[tool call {(c.get('function') or {}).get('name', '?')}"
                 f"({(c.get('function') or {}).get('arguments', '')})]"
                 for c in m.get("tool_calls") or [] if isinstance(c, dict)]
        text = "\n".join(x for x in [_text(m.get("content")), *calls] if x)
        if text.strip():
            out.append((role, text))
    return out


def read_jsonl(path: Path, prefix: str) -> Iterator[ImportedConversation]:
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path.name} line {n}"
            try:
                obj = json.loads(line)
            except ValueError:
                raise InvalidInput(f"{where} is not JSON") from None
            messages = obj.get("messages") if isinstance(obj, dict) else obj
            if not isinstance(messages, list):
                raise InvalidInput(f"{where}: expected {{\"messages\": [...]}} or a list")
            session = obj.get("session") if isinstance(obj, dict) else None
            name = _SAFE.sub("_", str(session))[:64] if session else f"{prefix}-{n:06d}"
            ts = obj.get("ts") if isinstance(obj, dict) else None
            yield ImportedConversation(name, _openai_turns(messages, where),
                               None if ts is None else iso_time(ts, f"{where}: `ts`"))


def locomo_datetime(raw: Any) -> datetime | None:
    """A LoCoMo session's ``date_time`` ("1:56 pm on 8 May, 2023", month names full or
    abbreviated) as UTC, or None."""
    for fmt in ("%I:%M %p on %d %B, %Y", "%I:%M %p on %d %b, %Y"):
        try:
            return datetime.strptime(str(raw), fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None


def _locomo_time(raw: Any) -> str | None:
    when = locomo_datetime(raw)
    return utc_iso(when) if when else None


def iso_time(raw: object, where: str = "ts") -> str:
    """An imported time stamp (ISO 8601; ``Z`` or an offset, else UTC) as :func:`utc_iso`
    writes it: a stamp goes into a record's heading and names a daily file, so anything else
    is refused rather than written."""
    if isinstance(raw, str):
        try:
            return utc_iso(datetime.fromisoformat(raw.strip().replace("Z", "+00:00")))
        except ValueError:
            pass
    raise InvalidInput(f"{where}: {str(raw)[:40]!r} is not an ISO 8601 time",
                       hint="write times as 2024-05-08T13:56:00Z (or leave them out)")


def speaker_role(raw: object) -> str:
    """A LoCoMo speaker as a role (``check_role``: one short line of safe characters)."""
    role = _ROLE_UNSAFE.sub("_", " ".join(str(raw or "").split()))[:64].strip(" _.'-")
    return role or "speaker"


def read_locomo(path: Path, prefix: str) -> Iterator[ImportedConversation]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        raise InvalidInput(f"{path.name} is not JSON") from None
    samples = data if isinstance(data, list) else [data]
    for i, sample in enumerate(samples):
        conv = sample.get("conversation", sample) if isinstance(sample, dict) else None
        if not isinstance(conv, dict):
            continue
        name = _SAFE.sub("_", str(sample.get("sample_id") or f"{prefix}-{i}"))[:48]
        for key in sorted((k for k in conv if _SESSION.fullmatch(k)),
                          key=lambda k: int(k.split("_")[1])):
            turns = [(speaker_role(t.get("speaker")), str(t.get("text") or ""))
                     for t in conv[key] if isinstance(t, dict) and t.get("text")]
            yield ImportedConversation(f"{name}-s{key.split('_')[1]}", turns,
                               _locomo_time(conv.get(f"{key}_date_time")))


def read_conversations(path: Path) -> Iterator[ImportedConversation]:
    """The conversations in a file (by its extension: ``.jsonl`` or ``.json``)."""
    prefix = _SAFE.sub("_", path.stem)[:40] or "import"
    if path.suffix == ".jsonl":
        return read_jsonl(path, prefix)
    if path.suffix == ".json":
        return read_locomo(path, prefix)
    raise InvalidInput(f"{path.name}: unknown format", hint="use .jsonl (OpenAI messages, "
                       "one conversation a line) or .json (LoCoMo)")


@cache
def _worker_model(folder: str, dtype: str) -> MiniLMEmbedder:
    """This worker process's own model, loaded once (one torch thread: the processes share
    the cores, not threads inside one, which stall when another process holds a core), in the
    precision the service's model settled on."""
    return MiniLMEmbedder(Path(folder), threads=1, dtype=dtype)


def _worker_embed(folder: str, dtype: str, texts: list[str]) -> np.ndarray:
    return _worker_model(folder, dtype).embed(texts)


@contextmanager
def embedding_pool(service: Any, workers: int, texts: int) -> Iterator[Callable | None]:
    """A function embedding with ``workers`` processes running the service's MiniLM model, for
    a large import (None: embed in this process, as the service does)."""
    inner = getattr(service.embedder, "inner", service.embedder)
    if workers < 2 or texts < POOL_MIN or not isinstance(inner, MiniLMEmbedder):
        yield None
        return
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that runs torch
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        folder, dtype = str(inner.folder), inner.dtype_used

        def compute(part: list[str]) -> np.ndarray:
            step = max(1, math.ceil(len(part) / (workers * 4)))  # sorted: similar lengths
            pieces = [part[i:i + step] for i in range(0, len(part), step)]
            return np.concatenate(list(pool.map(_worker_embed, [folder] * len(pieces),
                                                [dtype] * len(pieces), pieces)))

        yield compute


def import_sessions(service: Any, folder: str, conversations: list[ImportedConversation], *,
                    progress: bool = True, workers: int = 1) -> ImportStats:
    """Write and index ``conversations`` into ``folder``'s memory (see the module docstring);
    ``workers`` processes embed a large import (the local MiniLM model only)."""
    check_memory_name("folder", folder)
    t0 = time.perf_counter()
    merged: dict[str, list[Turn]] = {}  # one append a session, conversations in order
    for c in conversations:  # everything checked before anything is written
        check_memory_name("session", c.session)
        ts = utc_iso() if c.ts is None else iso_time(c.ts, f"session {c.session}: ts")
        merged.setdefault(c.session, []).extend(
            Turn(new_turn_id(), check_role(role), text, ts) for role, text in c.turns)
    if getattr(service.indexes, "in_database", False):
        return _import_in_database(service, folder, merged, t0, progress)
    with service.lock(folder):
        idx = service.indexes.get(folder)  # loaded or built first: appends land on top of it
        written = [(s, r, *service.files.append_turns(folder, s, r))
                   for s, r in merged.items() if r]
        units = [idx.units(r) for _, r, _, _ in written]
        prevs = [idx.last_unit(s) for s, _, _, _ in written]
        inputs = [idx.embed_inputs(p, us) for p, us in zip(prevs, units, strict=True)]
        texts = [(w, i, t) for w, ins in enumerate(inputs) for i, t in enumerate(ins)]
        tokens = sum(u.tokens for us in units for u in us)
        embedded = [np.zeros((len(ins), idx.embedder.dims), np.float32) for ins in inputs]
        order = sorted(range(len(texts)), key=lambda k: len(texts[k][2]))
        chars = sum(len(t) for _, _, t in texts)  # progress: tokens, pro rata of the text
        with tqdm(total=tokens, desc=f"import {folder}", unit="tok", unit_scale=True,
                  disable=not progress) as bar, \
                embedding_pool(service, workers, len(texts)) as compute:
            for a in range(0, len(order), SLICE):
                part = [texts[k] for k in order[a:a + SLICE]]
                got = service.embedder.embed([t for _, _, t in part], compute) if compute \
                    else service.embedder.embed([t for _, _, t in part])
                for (w, i, _), v in zip(part, got, strict=True):
                    embedded[w][i] = v
                bar.update(sum(len(t) for _, _, t in part) * tokens // max(1, chars))
        before = len(idx.chunks)
        for w, (session, records, start, end) in enumerate(written):
            vecs = idx.line_vectors(prevs[w], units[w], embedded[w])
            service.indexes.appended(folder, session, records, start, end,
                                     prepared=(units[w], vecs))
        service.indexes.save(folder)
        chunks = len(idx.chunks) - before
    return ImportStats(len(written), sum(len(r) for _, r, _, _ in written), chunks, tokens,
                       time.perf_counter() - t0)


def _import_in_database(service: Any, folder: str, merged: dict[str, list[Turn]], t0: float,
                        progress: bool) -> ImportStats:
    """With the index in PostgreSQL: every session appended, then indexed there a session at
    a time (one embedding call a session, in the transaction that writes its lines)."""
    written = []
    with service.lock(folder):
        for session, records in merged.items():
            if records:
                service.files.append_turns(folder, session, records)
                written.append((session, records))
    writer = service.indexes.writer
    tokens = sum(u.tokens for _, r in written for u in writer.shape.units(r))
    chunks = 0
    with tqdm(total=len(written), desc=f"import {folder}", unit="session",
              disable=not progress) as bar:
        for session, _ in written:
            chunks += max(0, writer.index_session(folder, session))
            bar.update(1)
    return ImportStats(len(written), sum(len(r) for _, r in written), chunks, tokens,
                       time.perf_counter() - t0)
