"""What a context window is: its manifest (stored), its public view, names and store keys.

A window's manifest lives in the KV store itself (so it is as durable and as shared as the
blocks: a second server on the same Redis sees it) under
``cwm-win\\0 + sha256(tenant)[:10] + sha256(name)[:16]``: the first 18 bytes group one
tenant's windows (listing), and one tenant can never name, list or touch another's. The
manifest holds secrets -- the salt the session was frozen under and the window's own salt
(the key scope its pinned blocks live under) -- which :meth:`Manifest.public` never shows.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from cwm_plugin.connector.records import json_tensor, tensor_json
from cwm_plugin.errors import InvalidInput

PREFIX = b"cwm-win\0"
THAW_PREFIX = b"cwm-wth\0"
MANIFEST_LAYOUT = "cwm-window-manifest"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
TAG = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
MAX_TAGS = 32
MAX_DESCRIPTION = 4096


def check_name(name: str, what: str = "window name") -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        shown = repr(name)[:60]
        raise InvalidInput(f"invalid {what} {shown}",
                           hint="use 1 to 128 letters, digits, '_' or '-'")
    return name


def check_tags(tags: list[str] | tuple[str, ...] | None) -> list[str]:
    tags = list(tags or [])
    if len(tags) > MAX_TAGS or not all(isinstance(t, str) and TAG.fullmatch(t) for t in tags):
        raise InvalidInput(f"invalid tags {tags!r:.80}",
                           hint=f"at most {MAX_TAGS} tags of letters, digits, '_.:-'")
    return sorted(set(tags))


def tenant_group(tenant: str) -> bytes:
    return PREFIX + hashlib.sha256(b"cwm-win-tenant\0" + tenant.encode()).digest()[:10]


def manifest_key(tenant: str, name: str) -> bytes:
    return tenant_group(tenant) + hashlib.sha256(name.encode()).digest()[:16]


def thaw_key(tenant: str, name: str) -> bytes:
    """Where a window's last thaw is noted: beside the manifest, never in it, so a thaw
    racing a delete cannot bring the manifest back."""
    return THAW_PREFIX + manifest_key(tenant, name)[len(PREFIX):]


def manifest_salt(tenant: str) -> str:
    """What manifests are sealed under when the store encrypts at rest."""
    return "cwm-window-manifest\0" + tenant


@dataclass
class Manifest:
    name: str
    tenant: str
    session: str                    # the session it was frozen from (an id, shown)
    frozen_salt: str                # secret: the session's cache_salt at freeze
    window_salt: str                # secret: the key scope of this window's pinned blocks
    tokens: list[int]
    block_size: int
    hash_block_size: int
    hash_algo: str
    workers: list[tuple[str, int]]  # (scoped namespace digest hex, TP rank) per worker
    window_hashes: list[str] = field(default_factory=list)   # hex chain under window_salt
    namespace: dict = field(default_factory=dict)
    lora: list[str] | None = None
    num_blocks: int = 0             # blocks pinned (full blocks of ``tokens``, saved ones)
    messages: list[dict] | None = None
    tags: list[str] = field(default_factory=list)
    description: str = ""
    created: float = 0.0
    updated: float = 0.0
    parent: str | None = None       # lineage: the window this one was cloned from
    last_thaw: dict | None = None   # (read from the thaw record: see ``thaw_key``)
    version: int = 1
    turn: int | None = None         # the client turn frozen (None: the session's latest)
    prompt: dict = field(default_factory=dict)   # what the sidecar merged into the prompt
    stored_bytes: int = 0           # blob bytes of its blocks at freeze (the tenant's quota)
    expires: float | None = None    # unix time its pins lapse and it is gone (None: never)
    prompt_prefix: str = ""         # a caller's note of the prompt (context-window-manager)
    auto: bool = False              # made by auto-checkpoint (pruned; a clone or edit is not)
    served_model: str = ""          # the name vLLM served the model under ("": the namespace's)

    @property
    def pinned_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def model(self) -> str:
        """The model's served name (what requests and routes name it by)."""
        return self.served_model or str(self.namespace.get("model", ""))

    def expired(self, now: float | None = None) -> bool:
        return self.expires is not None and (now or time.time()) >= self.expires

    def public(self) -> dict[str, Any]:
        """Everything a client may see (no salts, no token ids). The second group repeats
        figures under the names the context-window-manager tools return."""
        return {"name": self.name, "session": self.session, "model": self.model,
                "tokens": len(self.tokens), "pinned_tokens": self.pinned_tokens,
                "blocks": self.num_blocks, "tags": list(self.tags),
                "description": self.description, "created": self.created,
                "updated": self.updated, "parent": self.parent, "turn": self.turn,
                "messages": len(self.messages) if self.messages is not None else None,
                "memory_merged": bool(self.prompt), "expires": self.expires,
                "last_thaw": self.last_thaw,
                "window_name": self.name, "session_id": self.session,
                "block_count": self.num_blocks, "token_count": len(self.tokens),
                "total_size_bytes": self.stored_bytes, "created_at": self.created}

    def to_tensor(self) -> torch.Tensor:
        return json_tensor(asdict(self))

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Manifest:
        d = tensor_json(tensor)
        d["workers"] = [tuple(w) for w in d["workers"]]
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
