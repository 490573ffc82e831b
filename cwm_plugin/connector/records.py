"""Context records: what the connector leaves in the store for each salted request it saved.

Only vLLM knows a request's exact token ids and block hashes. When a salted request whose
blocks were saved finishes, the scheduler writes a small record -- every token id, the
rank-free hashes of the saved blocks, each worker's key scope (namespace digest and rank),
the hashing settings and the namespace -- under a key derived from the salt, so the window
engine can later find a session's latest context from outside vLLM, freeze it (pin its
keys) and re-key it for another salt with vLLM's own hashing. With encryption at rest the
record is sealed under the request's salt like its blocks (it holds token ids).

Keys: ``cwm-ctx\\0`` + 10 bytes of ``sha256(salt)`` (the salt's group) + ``latest``: each
finished request of a salt replaces the record (its old blob is freed), so the key always holds
the newest; + ``turn`` + a 2-byte slot when the request named its client turn
(:mod:`~cwm_plugin.connector.params`): the record is kept under the turn's slot too, so a
session's last few client turns can be frozen. The sidecar's own conversation records (what it
merged into the prompt, the client's messages) live in the same group
(:mod:`cwm_plugin.windows.conversation`).

Records never go backwards: a record carries when its client turn *arrived* (the sidecar's
clock, ``at`` in the request's parameters; else when it was written), and a record of a turn
that arrived earlier never replaces one of a later turn under the same key, whichever request
finished first (:func:`write_record` with ``order``: checked on the store's saving thread,
never on vLLM's step).

Records are written only to a store whose records someone can read (:func:`readable`): their
readers (the window engine in the sidecar or the CLI) open the disk and Redis tiers, never a
vLLM process's memory, so a memory-only store keeps none (said once at start). A record that
cannot be saved is logged once per kind of failure.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from cwm_plugin.connector.warn_once import WarnOnce
from cwm_plugin.store.save_queue import QueueFull

log = logging.getLogger(__name__)
_warn = WarnOnce(log)

PREFIX = b"cwm-ctx\0"
RECORD_LAYOUT = "cwm-context-record"
SERVED_LAYOUT = "cwm-served-record"


SERVED_PREFIX = b"cwm-srv\0"


def served_key(model: str) -> bytes:
    """Where a server leaves the namespace it serves ``model`` under (replaced at each start),
    so a window thawed for ``model`` can name what differs from the one it was frozen on."""
    return SERVED_PREFIX + hashlib.sha256(model.encode()).digest()[:10] + b"latest"


def salt_group(salt: str) -> bytes:
    """The 18-byte key prefix of one salt's records."""
    return PREFIX + hashlib.sha256(b"cwm-ctx-salt\0" + salt.encode()).digest()[:10]


def context_record_key(salt: str) -> bytes:
    return salt_group(salt) + b"latest"


def turn_record_key(salt: str, slot: int) -> bytes:
    """Where the record of the client turn in ``slot`` (turn % keep) is kept."""
    return salt_group(salt) + b"turn" + int(slot).to_bytes(2, "big")


@dataclass
class ContextRecord:
    tokens: list[int]                   # every token id of the request (prompt + output)
    block_hashes: list[str]             # hex, rank-free KV-block hashes of the saved blocks
    workers: list[tuple[str, int]]      # (scoped namespace digest hex, TP rank) per worker
    block_size: int
    hash_block_size: int
    hash_algo: str
    namespace: dict = field(default_factory=dict)   # the first worker's KeyNamespace fields
    lora: list[str] | None = None       # [name, path] of the request's adapter
    created: float = 0.0
    version: int = 1
    turn: int | None = None             # the client turn the request said it was
    num_prompt_tokens: int | None = None  # tokens[:num_prompt_tokens] were the prompt
    arrived: float | None = None        # unix time its client turn arrived (orders records)
    model: str = ""                     # the name vLLM serves the model under

    @property
    def order(self) -> float:
        return order_of({"arrived": self.arrived, "created": self.created})

    @property
    def saved_tokens(self) -> int:
        return len(self.block_hashes) * self.block_size

    def hashes(self) -> list[bytes]:
        return [bytes.fromhex(h) for h in self.block_hashes]

    def keys_of(self, hashes: list[bytes]) -> list[list[bytes]]:
        """Per worker, the store keys of ``hashes`` (the same scopes, other hashes)."""
        return [[bytes.fromhex(d) + int(r).to_bytes(2, "big") + h for h in hashes]
                for d, r in self.workers]

    def to_tensor(self) -> torch.Tensor:
        return json_tensor(asdict(self))

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> ContextRecord:
        d = tensor_json(tensor)
        d["workers"] = [tuple(w) for w in d["workers"]]
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def order_of(record: dict) -> float:
    """Where a record (a context or a conversation record, as JSON) stands among its key's:
    when its client turn arrived, else when it was written."""
    value = record.get("arrived") or record.get("created") or 0.0
    return float(value) if isinstance(value, int | float) else 0.0


def newer_stored(store: Any, key: bytes, salt: str | None, order: float) -> Callable[[], bool]:
    """Whether ``key`` holds a record that stands after ``order`` (read when asked: a damaged
    or unreadable one does not)."""
    def check() -> bool:
        try:
            t = store.get(key, salt=salt, primary=True)
            return t is not None and order_of(tensor_json(t)) > order
        except Exception:  # unreadable: the new record replaces it
            return False
    return check


def readable(store: Any) -> bool:
    """Whether records written to ``store`` reach their readers (it has a disk or Redis tier)."""
    return bool(store.durable)


def write_record(store: Any, key: bytes, obj: object, layout: str, *, what: str,
                 salt: str | None = None, wait: float | None = None,
                 order: float | None = None) -> bool:
    """Save a JSON record under ``key`` (replacing an older one) in the background; a failure
    is logged, never raised (records are recomputable; serving goes on). ``wait`` (on vLLM's
    step: 0): how long to wait when the store's save queue is full before the record is
    dropped. ``order`` (:func:`order_of` the record): the write is skipped if ``key`` holds a
    record that stands after it. Returns whether it was queued."""
    def done(fut: Any) -> None:
        if not fut.cancelled() and (exc := fut.exception()) is not None:
            _warn(f"{what}-{type(exc).__name__}", "could not save %s: %s (said once)", what,
                  exc)

    try:
        store.put(key, json_tensor(obj), layout=layout, salt=salt, replace=True, wait=wait,
                  unless=None if order is None else newer_stored(store, key, salt, order)
                  ).add_done_callback(done)
    except QueueFull:         # the caller counts it
        return False
    except Exception as exc:  # a closed or full store
        _warn(f"{what}-{type(exc).__name__}", "could not save %s: %s (said once)", what, exc)
        return False
    return True


def json_tensor(obj: object) -> torch.Tensor:
    """A JSON document as a uint8 tensor (how records travel through the block store)."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def tensor_json(tensor: torch.Tensor) -> dict:
    return json.loads(bytes(tensor.numpy().tobytes()).decode())
