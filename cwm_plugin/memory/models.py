"""Plain data types shared by the memory package (and by the sidecar through the façade)."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

CATEGORIES = ("preference", "goal", "decision", "fact")


@dataclass
class MemoryConfig:
    """Knobs of the memory service; the search defaults are explained in ``search.py``."""

    root: Path
    chunk_tokens: int = 400
    chunk_overlap: int = 80
    bm25_weight: float = 0.5
    vector_weight: float = 0.5
    candidate_multiplier: int = 4
    mmr_lambda: float | None = None
    recency_half_life_days: float | None = None
    recent_turns: int = 6  # history messages kept verbatim (a tool call stays with its results)
    vector_context_lines: int = 1  # each line's vector has the line before it as context ...
    # ... embedded together ("pair") or mixed ("mix", index/chunks.py)
    vector_context_mode: str = "mix"
    chunk_vector_weight: float = 1.0  # weight of the chunk centroid's cosine (index/chunks.py)
    max_facts: int = 8  # durable memories offered to a selection
    # What a selection packs (``selection/select.py``): the best "turn" lines (``lines.py``,
    # ``pack.py``) or whole "chunk"s; the line scores' parts and the neighbours a line brings along.
    retrieval_unit: str = "turn"
    turn_neighbours: int = 0
    context_bm25_weight: float = 0.5
    chunk_prior_weight: float = 0.5
    speaker_weight: float = 0.2
    date_weight: float = 0.2
    # Look at the files for changes by other processes at most this often (seconds; 0: on
    # every search). This process's own appends are indexed as they are written.
    sync_interval_s: float = 0.0
    # The truth in PostgreSQL (shared by replicas) instead of markdown files under ``root``;
    # ``root`` then keeps only derived data. ``repr=False``: a URL may carry a password.
    postgres_url: str | None = field(default=None, repr=False)
    postgres_pool_size: int = 8
    postgres_timeout_s: float = 5.0  # to connect, or to wait for a pooled connection
    # with postgres_url: "database" (search candidates from the index in PostgreSQL) or
    # "local" (this process's own index, built from the database)
    candidates: str = "database"

    def __post_init__(self) -> None:
        self.root = Path(self.root)


def new_turn_id() -> str:
    """A fresh turn id: the time in milliseconds (hex) and a random suffix."""
    return f"t{int(time.time() * 1000):x}-{secrets.token_hex(3)}"


@dataclass
class Turn:
    """One transcript turn as stored in ``sessions/<session>.md``."""

    turn_id: str
    role: str
    content: str
    ts: str  # ISO 8601, UTC

    def as_dict(self) -> dict[str, str]:
        return {"turn_id": self.turn_id, "id": self.turn_id, "role": self.role,
                "content": self.content, "ts": self.ts}


@dataclass
class Chunk:
    """A run of whole turns of one session; ``chunk_id`` is sha256 of session + text."""

    chunk_id: str
    session: str
    text: str
    turn_ids: list[str]
    lines: list[str]  # one rendered line per turn, in order (what the vectors embed)
    tokens: int
    ts: str  # timestamp of the newest turn


@dataclass
class Hit:
    """One search result: a chunk (or a durable memory) with its score and why."""

    text: str
    score: float
    source: str  # "session:<name>" or "memory"
    chunk_id: str
    turn_ids: list[str]
    reasons: dict[str, float] = field(default_factory=dict)


@dataclass
class Memory:
    """A durable memory from ``memories.md``. ``key``: its topic ("home city"), given by the
    extraction, so a newer fact on the same topic can replace it; ``source``: where it was
    said (``session:<name>#<first turn>..<last turn>``); a replaced memory keeps its line in
    the file's history with ``replaced_by`` (the newer memory's id) and ``until`` (when)."""

    id: str
    text: str
    category: str
    importance: float
    access_count: int
    created: str
    key: str = ""
    source: str = ""
    replaced_by: str = ""
    until: str = ""

    @property
    def active(self) -> bool:
        return not self.replaced_by


@dataclass
class Selection:
    """What :meth:`MemoryService.select_context` returns; ``tokens`` never exceeds the budget."""

    recent: list[dict]
    memory_block: str
    hits: list[Hit]
    summary: str | None
    facts: list[Memory]
    tokens: int
    reasons: list[str]
    fact_hits: list[Hit] = field(default_factory=list)  # the kept memories as search hits
