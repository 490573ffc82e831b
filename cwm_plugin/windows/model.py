"""What a context window is: its manifest (stored), its public view, names and store keys.

A window's manifest lives in the KV store itself (so it is as durable and as shared as the
blocks: a second server on the same Redis sees it) under its *owner*'s group: a tenant's
windows under ``cwm-win\0 + sha256(tenant)[:10]``, a user's (owner ``tenant/u-...``) under
that and ``sha256(owner)[:8]``, then ``sha256(name)[:16]``. So one listing finds an owner's
windows, one listing of the tenant's 18 bytes finds the tenant's and every user's in it (the
tenant's quota), and one tenant can never name, list or touch another's. Manifests are sealed
(with encryption at rest) under their tenant's manifest salt. A user's windows in the former
layout (:func:`former_place`: a group and a salt of the user's own) are found there and moved
into the tenant's group by the catalog. The manifest holds secrets -- the salt the session was
frozen under and the window's own salt (the key scope its pinned blocks live under) -- which
:meth:`Manifest.public` never shows.

:func:`check_manifest` is the one validator of a manifest: every one the engine stores (a
freeze's, a clone's, an import's, a rename or edit) passes it, so a stored window never holds
a field that a list, a thaw or the tenant's quota would trip on.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from cwm_plugin.connector.records import json_tensor, tensor_json
from cwm_plugin.errors import InvalidInput
from cwm_plugin.salts import tenant_of, user_of

PREFIX = b"cwm-win\0"
THAW_PREFIX = b"cwm-wth\0"
MANIFEST_LAYOUT = "cwm-window-manifest"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
TAG = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
MAX_TAGS = 32
MAX_DESCRIPTION = 4096
NAME_BYTES = 16                   # a manifest key's name part
HASH_ALGOS = frozenset({"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"})  # vLLM's
DIGEST = re.compile(r"[0-9a-f]{32}")   # a worker's namespace digest (16 bytes)
BLOCK_HASH = re.compile(r"(?:[0-9a-f]{2}){1,64}")


def check_window_name(name: str, what: str = "window name") -> str:
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
    """The first 18 bytes of every manifest key of the tenant and of its users."""
    return PREFIX + hashlib.sha256(b"cwm-win-tenant\0" + tenant.encode()).digest()[:10]


def owner_group(owner: str) -> bytes:
    """The prefix of an owner's manifest keys (see the module docstring)."""
    group = tenant_group(tenant_of(owner))
    return group + hashlib.sha256(b"cwm-win-user\0" + owner.encode()).digest()[:8] \
        if user_of(owner) else group


def manifest_key(owner: str, name: str) -> bytes:
    return owner_group(owner) + hashlib.sha256(name.encode()).digest()[:NAME_BYTES]


def thaw_key(owner: str, name: str) -> bytes:
    """Where a window's last thaw is noted: beside the manifest, never in it, so a thaw
    racing a delete cannot bring the manifest back."""
    return THAW_PREFIX + manifest_key(owner, name)[len(PREFIX):]


def manifest_salt(owner: str) -> str:
    """What the owner's manifests are sealed under when the store encrypts at rest: its
    tenant's (one listing reads the tenant's and its users' windows)."""
    return "cwm-window-manifest\0" + tenant_of(owner)


@dataclass(frozen=True)
class Place:
    """Where a window's manifest and its thaw note are stored, and the salt sealing both."""

    key: bytes
    note: bytes
    salt: str


def place_of(owner: str, name: str) -> Place:
    """Where ``owner``'s window ``name`` is stored."""
    return Place(manifest_key(owner, name), thaw_key(owner, name), manifest_salt(owner))


def former_group(owner: str) -> bytes:
    """The prefix of a user's manifest keys in the former layout, where a user's windows had a
    group of their own (the one a tenant named ``owner`` would have) and were sealed under the
    user's own salt; the catalog moves what it finds there into the tenant's group."""
    return tenant_group(owner)


def former_salt(owner: str) -> str:
    """What a user's manifests are sealed under in the former layout: the user's own salt."""
    return "cwm-window-manifest\0" + owner


def former_place(owner: str, name: str) -> Place:
    """Where user ``owner``'s window ``name`` is stored in the former layout."""
    key = former_group(owner) + hashlib.sha256(name.encode()).digest()[:NAME_BYTES]
    return Place(key, THAW_PREFIX + key[len(PREFIX):], former_salt(owner))


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


def _int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _time(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _text(v: Any, most: int) -> bool:
    return isinstance(v, str) and len(v) <= most


def _valid(check, value: Any) -> bool:
    try:
        check(value)
    except InvalidInput:
        return False
    return True


def _fields(m: Manifest, keyed: bool) -> dict[str, bool]:
    """Each field of ``m``: whether it is of its type and range."""
    ns = m.namespace
    blocks = m.num_blocks
    return {
        "name": _valid(check_window_name, m.name),
        "tenant": _text(m.tenant, 256) and m.tenant.isprintable() and bool(m.tenant),
        "session": _text(m.session, 256) and m.session.isprintable(),
        "frozen_salt": _text(m.frozen_salt, 512),
        "window_salt": _text(m.window_salt, 512) and (bool(m.window_salt) or not keyed),
        "tokens": isinstance(m.tokens, list) and len(m.tokens) <= 1 << 24
        and all(_int(t, 0, (1 << 31) - 1) for t in m.tokens),
        "block_size": _int(m.block_size, 1, 1 << 16),
        "hash_block_size": _int(m.hash_block_size, 1, 1 << 16),
        "hash_algo": isinstance(m.hash_algo, str) and m.hash_algo in HASH_ALGOS
        and (not isinstance(ns, dict) or ns.get("hash_algo", m.hash_algo) == m.hash_algo),
        "workers": isinstance(m.workers, list) and 0 < len(m.workers) <= 4096
        and all(isinstance(w, tuple | list) and len(w) == 2 and isinstance(w[0], str)
                and DIGEST.fullmatch(w[0]) is not None and _int(w[1], 0, 0xFFFF)
                for w in m.workers),
        "num_blocks": _int(blocks, 0, 1 << 24) and isinstance(m.tokens, list)
        and _int(m.block_size, 1, 1 << 16) and blocks <= len(m.tokens) // m.block_size,
        "window_hashes": isinstance(m.window_hashes, list)
        and len(m.window_hashes) == (blocks if keyed else 0)
        and all(isinstance(h, str) and BLOCK_HASH.fullmatch(h) is not None
                for h in m.window_hashes),
        "namespace": isinstance(ns, dict) and all(isinstance(k, str) for k in ns)
        and isinstance(ns.get("model", ""), str)
        and all(_int(ns.get(k, 0), 0, 1 << 20)
                for k in ("num_layers", "num_kv_heads", "head_size")),
        "lora": m.lora is None or (isinstance(m.lora, list) and len(m.lora) == 2
                                   and all(isinstance(x, str) for x in m.lora)),
        "messages": m.messages is None or (isinstance(m.messages, list)
                                           and all(isinstance(x, dict) for x in m.messages)),
        "tags": _valid(check_tags, m.tags) and isinstance(m.tags, list),
        "description": _text(m.description, MAX_DESCRIPTION),
        "created": _time(m.created),
        "updated": _time(m.updated),
        "parent": m.parent is None or _valid(check_window_name, m.parent),
        "last_thaw": m.last_thaw is None or isinstance(m.last_thaw, dict),
        "version": _int(m.version, 1, 1 << 16),
        "turn": m.turn is None or _int(m.turn, 1, (1 << 63) - 1),
        "prompt": isinstance(m.prompt, dict),
        "stored_bytes": _int(m.stored_bytes, 0, 1 << 62),
        "expires": m.expires is None or _time(m.expires),
        "prompt_prefix": _text(m.prompt_prefix, MAX_DESCRIPTION),
        "auto": isinstance(m.auto, bool),
        "served_model": _text(m.served_model, 256),
    }


def check_manifest(m: Manifest, *, keyed: bool = True) -> Manifest:
    """The one validator of a window's manifest (see the module docstring): every field of its
    type and range, else :class:`InvalidInput` naming the fields. ``keyed`` False: a manifest
    not yet given its window salt and hashes (an import being checked)."""
    bad = [name for name, ok in _fields(m, keyed).items() if not ok]
    if bad:
        raise InvalidInput(f"invalid window manifest: {', '.join(bad)} out of type or range",
                           hint="a window's fields are what a freeze records; see the API "
                                "reference")
    m.tags = check_tags(m.tags)
    return m
