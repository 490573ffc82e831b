"""Context records: what the connector leaves in the store for each salted request it saved.

Only vLLM knows a request's exact token ids and block hashes. When a salted request whose
blocks were saved finishes, the scheduler writes a small record -- every token id, the
rank-free hashes of the saved blocks, each worker's key scope (namespace digest and rank),
the hashing settings and the namespace -- under a key derived from the salt, so the window
engine can later find a session's latest context from outside vLLM, freeze it (pin its
keys) and re-key it for another salt with vLLM's own hashing. With encryption at rest the
record is sealed under the request's salt like its blocks (it holds token ids).

Key: ``cwm-ctx\\0`` + 10 bytes of ``sha256(salt)`` + ``latest``: each finished request of a
salt replaces the record (its old blob is freed), so the key always holds the newest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import torch

PREFIX = b"cwm-ctx\0"
RECORD_LAYOUT = "cwm-context-record"


def salt_group(salt: str) -> bytes:
    """The 18-byte key prefix of one salt's records."""
    return PREFIX + hashlib.sha256(b"cwm-ctx-salt\0" + salt.encode()).digest()[:10]


def record_key(salt: str) -> bytes:
    return salt_group(salt) + b"latest"


@dataclass
class ContextRecord:
    tokens: list[int]                   # every token id of the request (prompt + output)
    block_hashes: list[str]             # hex, rank-free KV-block hashes of the saved blocks
    workers: list[tuple[str, int]]      # (scoped namespace digest hex, TP rank) per worker
    block_size: int
    hash_block_size: int
    hash_algo: str
    namespace: dict = field(default_factory=dict)   # the first worker's Namespace fields
    lora: list[str] | None = None       # [name, path] of the request's adapter
    created: float = 0.0
    version: int = 1

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
        data = json.dumps(asdict(self), separators=(",", ":")).encode()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> ContextRecord:
        d = json.loads(bytes(tensor.numpy().tobytes()).decode())
        d["workers"] = [tuple(w) for w in d["workers"]]
        return cls(**d)
