"""The window engine: freeze, thaw, clone and delete context windows on the real KV blocks in
the store (list, status and patch: :mod:`.catalog`). No HTTP in here (REST, CLI and MCP call
this).

The engine owns its parts: the blocks' keys (:mod:`.rekey`), the catalog of manifests
(:mod:`.catalog`), the tenants' quota (:mod:`.tenancy`) and the sessions' records
(:mod:`.sessions`); it keeps the surface its callers use (``get``, ``list``, ``status``,
``patch``, ``adopt``, ``move_session``, ...) by delegating to them.

* **freeze** takes the session's latest client turn -- or turn ``N`` of its last few -- from
  the connector's context record and the sidecar's conversation record of the same arrival
  (:mod:`.conversation`: the client's messages, what was merged into the prompt), waiting for
  a record only while the caller says one is on its way (else a turn that is not kept is
  refused at once, naming the kept ones), checks that this process hashes blocks like the
  vLLM that saved them, waits until every block is on *every* durable tier (copying a block a
  tier lacks from one that has it: with Redis in ``behind`` mode the disk has it first) or
  refuses naming what each tier holds, re-keys the blocks under a fresh *window salt* (the
  same blobs, new keys: ``link_many``, no tensor copy), pins those keys (under the store's pin
  quota and the tenant's, :mod:`.tenancy`) and claims the name.
* **thaw** re-keys the window's blocks under the target session's salt and writes that
  session's records (a connector record and a conversation record for the window's turn), so
  its next request -- assembled by the sidecar with the window's prompt state -- hits them,
  and the thawed session can be frozen again at once. **clone** re-keys under a new window
  salt: a branch sharing the blobs. **delete** unpins and drops the window's keys; a blob is
  freed only when no key (a clone's, a session's) points to it.
* With encryption at rest a blob opens only under its salt, so re-keying re-seals the stored
  bytes for the new salt (a byte copy; nothing is decoded or re-encoded).

Tenants are isolated by the manifest keys (:mod:`.model`): another tenant's window is
indistinguishable from an unknown one.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from cwm_plugin.connector import records
from cwm_plugin.errors import AlreadyExists, CWMError, NotFound
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.windows import hashing
from cwm_plugin.windows.catalog import WindowCatalog
from cwm_plugin.windows.conversation import ConversationRecord, ConversationRecords
from cwm_plugin.windows.model import MAX_DESCRIPTION, Manifest, check_tags, check_window_name
from cwm_plugin.windows.rekey import BlockKeys, WindowIncomplete
from cwm_plugin.windows.sessions import SessionKV
from cwm_plugin.windows.tenancy import TenantWindows

log = logging.getLogger(__name__)


class ModelMismatch(CWMError):
    """A window thawed for a model or KV layout other than the one it was frozen on."""

    code = "model_mismatch"
    http_status = 409


@dataclass
class ThawResult:
    name: str
    session: str
    tokens: int
    restorable_tokens: int
    blocks: int
    messages: list[dict] | None = None
    warm: dict[str, Any] | None = None
    prompt: dict[str, Any] = field(default_factory=dict, repr=False)  # for the sidecar
    turn: int | None = None
    model: str = ""
    expected: int = 0  # the window's blocks (``blocks``: those restored)
    warnings: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list, repr=False)   # what a warm-up sends

    def public(self) -> dict[str, Any]:
        hits = (self.warm or {}).get("hits")
        return {"name": self.name, "session": self.session, "tokens": self.tokens,
                "restorable_tokens": self.restorable_tokens, "blocks": self.blocks,
                "messages": self.messages, "warm": self.warm, "turn": self.turn,
                "model": self.model, "warnings": list(self.warnings),
                "window_name": self.name, "session_id": self.session,
                "block_count": self.expected, "blocks_expected": self.expected,
                "blocks_found": self.blocks,
                "cache_hit": bool(hits) if hits is not None else None,
                "cache_efficiency": round(hits / self.restorable_tokens, 4)
                if hits is not None and self.restorable_tokens else None}


class WindowEngine:
    """Context windows on one KV store (see the module docstring)."""

    def __init__(self, store: KVStore, *, wait_s: float = 30.0, keep_turns: int = 8,
                 settle_s: float = 3.0,
                 tenant_quota_bytes: int | Literal["auto"] | None = "auto", principals: int = 1,
                 export_key: bytes | None = None, max_ttl_s: float | None = None) -> None:
        """``wait_s``: how long a freeze waits for a record and its blocks; ``settle_s``: how
        long it waits for write-behind before copying what a durable tier lacks;
        ``keep_turns``: client turns a session keeps records of; ``tenant_quota_bytes``:
        blob bytes the windows of one tenant and its users may pin (``auto``: the store's pin
        quota divided by the ``principals``; None: no tenant quota;
        :func:`~.tenancy.tenant_quota`);
        ``export_key``: signs export files, and imports take only files it signed (None:
        unsigned files, :mod:`.portable`); ``max_ttl_s``: the longest a window lives (None:
        any TTL, or none)."""
        self.store = store
        self.max_ttl_s = max_ttl_s
        self.wait_s = wait_s
        self.export_key = export_key
        self.conversations = ConversationRecords(store, keep_turns)
        self.blocks = BlockKeys(store, settle_s)
        self.catalog = WindowCatalog(store, self.blocks)
        self.tenancy = TenantWindows(store, self.catalog, tenant_quota_bytes, principals)
        self.sessions = SessionKV(store, self.blocks, self.conversations)

    # --- the parts' surface -------------------------------------------------------------------

    def get(self, owner: str, name: str) -> Manifest:
        return self.catalog.get(owner, name)

    def list(self, owner: str, **filters: Any) -> tuple[list[Manifest], int]:
        """(one page of the owner's windows, how many match): :meth:`WindowCatalog.list`."""
        return self.catalog.list(owner, **filters)

    def manifests(self, owner: str, *, whole_tenant: bool = False) -> list[Manifest]:
        return self.catalog.manifests(owner, whole_tenant=whole_tenant)

    def status(self, owner: str, name: str) -> dict[str, Any]:
        return self.catalog.status(owner, name)

    def patch(self, owner: str, name: str, *, new_name: str | None = None,
              tags: list[str] | None = None, description: str | None = None) -> Manifest:
        """Rename a window and/or replace its tags or description."""
        return self.catalog.patch(owner, name, new_name=new_name, tags=tags,
                                  description=description)

    def window_keys(self, m: Manifest) -> list[list[bytes]]:
        return self.blocks.of_window(m)

    def tenant_bytes(self, tenant: str) -> int:
        return self.tenancy.tenant_bytes(tenant)

    def adopt(self, owner: str, former: Sequence[str]) -> int:
        return self.tenancy.adopt(owner, former)

    def kept_turns(self, salt: str) -> list[int]:
        return self.sessions.kept_turns(salt)

    def move_session(self, old_salt: str, new_salt: str) -> int:
        return self.sessions.move_session(old_salt, new_salt)

    def clear_session(self, salt: str) -> int:
        return self.sessions.clear_session(salt)

    # --- operations ---------------------------------------------------------------------------

    def freeze(self, tenant: str, name: str, *, session: str, salt: str,
               messages: list[dict] | None = None, tags: Sequence[str] = (),
               description: str = "", wait_s: float | None = None, turn: int | None = None,
               ttl_s: float | None = None, prompt_prefix: str = "",
               auto: bool = False, coming: Mapping[int, float] | None = None,
               coming_s: float | None = None) -> Manifest:
        """Freeze the session's latest client turn (or ``turn``); ``messages`` override the
        conversation the sidecar recorded; ``ttl_s``: the window is gone after that long;
        ``coming``: the session's turns whose records are on their way (turn -> arrival:
        waited for up to ``coming_s``, at most ``wait_s``; a turn neither kept nor coming is
        refused at once)."""
        check_window_name(name)
        tags = check_tags(tags)
        if self.max_ttl_s is not None and (ttl_s is None or ttl_s > self.max_ttl_s):
            ttl_s = self.max_ttl_s
        if self.catalog.find(tenant, name) is not None:
            raise AlreadyExists(f"a window named {name!r} already exists",
                                hint="choose another name or delete that window first")
        wait = self.wait_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait  # for the record (what is coming) and its blocks
        patience = wait if coming_s is None else min(wait, coming_s)
        found = self.sessions.record(salt, time.monotonic() + patience, turn, coming)
        if found is None:
            if turn is not None:
                kept = ", ".join(map(str, self.kept_turns(salt))) or "none"
                raise NotFound(f"turn {turn} of session {session!r} is not kept (kept: {kept})",
                               hint=f"a session keeps its last {self.conversations.keep} "
                                    "client turns; freeze without a turn for the latest")
            raise NotFound(f"session {session!r} has no saved context yet",
                           hint="send at least one request in that session (through vLLM "
                                "with the cwm connector and a durable store) before freezing; "
                                "a request that just finished leaves its record when its "
                                "blocks are saved: try again in a moment")
        rec, hashes = found
        keys = self.blocks.keys(rec.workers, hashes)
        self.blocks.complete(keys, f"session {session!r}", deadline, block_size=rec.block_size,
                             tokens=len(rec.tokens))
        conv = self.conversations.read(salt, rec.turn, rec.arrived) \
            if rec.turn is not None else None
        wsalt = "cwm-window:" + secrets.token_hex(16)
        whashes = self.blocks.chain(rec, rec.tokens, wsalt, len(hashes))
        now = time.time()
        m = Manifest(name=name, tenant=tenant, session=session, frozen_salt=salt,
                     window_salt=wsalt, tokens=list(rec.tokens), block_size=rec.block_size,
                     hash_block_size=rec.hash_block_size, hash_algo=rec.hash_algo,
                     workers=list(rec.workers), window_hashes=[h.hex() for h in whashes],
                     namespace=rec.namespace, lora=rec.lora, num_blocks=len(hashes),
                     messages=messages if messages is not None else
                     (conv.messages if conv else None),
                     tags=tags, description=description[:MAX_DESCRIPTION], created=now,
                     updated=now, turn=rec.turn, prompt=conv.prompt if conv else {},
                     expires=now + ttl_s if ttl_s else None,
                     prompt_prefix=str(prompt_prefix)[:MAX_DESCRIPTION], auto=auto,
                     served_model=rec.model)
        wkeys = self.blocks.keys(rec.workers, whashes)
        self.tenancy.pin_new(m, wkeys, lambda: self.blocks.rekey(keys, wkeys, salt, wsalt))
        log.info("window %s frozen for tenant %s: %d blocks, %d tokens (turn %s)", name, tenant,
                 len(hashes), len(rec.tokens), rec.turn)
        return m

    def thaw(self, tenant: str, name: str, *, session: str, salt: str,
             model: str | None = None) -> ThawResult:
        """Re-key the window under ``salt`` and write the session's records. A warm-up (a
        one-token request through vLLM, so the blocks are in its cache) is the caller's: it
        has the upstream; see :meth:`note_warm`."""
        m = self.get(tenant, name)
        if model is not None:
            self._check_model(m, model)
        wkeys = self.blocks.of_window(m)
        n = self.blocks.restorable(wkeys)
        if n == 0 and m.num_blocks:
            raise WindowIncomplete(f"window {name!r} has lost its first block; nothing is "
                                   "restorable", hint="delete it and freeze the session again")
        hashing.verified_chain([bytes.fromhex(h) for h in m.window_hashes[:n]], m.tokens,
                               salt=m.window_salt, block_size=m.block_size,
                               hash_block_size=m.hash_block_size, hash_algo=m.hash_algo,
                               lora=m.lora)
        thashes = self.blocks.chain(m, m.tokens, salt, n)
        self.blocks.rekey([ks[:n] for ks in wkeys], self.blocks.keys(m.workers, thashes),
                          m.window_salt, salt)
        rec = records.ContextRecord(
            tokens=list(m.tokens), block_hashes=[h.hex() for h in thashes], workers=m.workers,
            block_size=m.block_size, hash_block_size=m.hash_block_size, hash_algo=m.hash_algo,
            namespace=m.namespace, lora=m.lora, created=time.time(), turn=m.turn, model=m.model)
        conv = ConversationRecord(m.turn, m.messages, m.prompt, m.model) \
            if m.turn is not None else None
        self.sessions.write(salt, rec, conv)
        warnings = [] if n == m.num_blocks else [
            f"{m.num_blocks - n} of the window's {m.num_blocks} blocks are gone: only its "
            f"first {n * m.block_size} tokens are restored"]
        result = ThawResult(name, session, len(m.tokens), n * m.block_size, n, m.messages,
                            prompt=dict(m.prompt), turn=m.turn, model=m.model,
                            expected=m.num_blocks, warnings=warnings, token_ids=list(m.tokens))
        self.catalog.note_thaw(m, {"session": session, "time": time.time(),
                            "restorable_tokens": result.restorable_tokens})
        return result

    def note_warm(self, tenant: str, name: str, session: str, warm: dict[str, Any]) -> None:
        """Record what vLLM measured when a thawed window was warmed up."""
        m = self.get(tenant, name)
        self.catalog.note_thaw(m, {**(self.catalog.last_thaw(m) or {}), "session": session,
                            "hits": warm.get("hits"), "warm_seconds": warm.get("seconds")})

    def _check_model(self, m: Manifest, model: str) -> None:
        t = self.store.get(records.served_key(model), primary=True)
        if t is None:
            if model != m.model:
                raise ModelMismatch(f"window {m.name!r} was frozen on model {m.model!r}, not "
                                    f"{model!r}", hint="thaw it on the model it was frozen on")
            return
        served = records.tensor_json(t).get("namespace", {})
        diff = sorted(k for k in set(served) | set(m.namespace)
                      if served.get(k) != m.namespace.get(k))
        if diff:
            what = "; ".join(f"{k}: {m.namespace.get(k)!r} vs {served.get(k)!r}"
                             for k in diff[:6])
            raise ModelMismatch(f"window {m.name!r} was frozen on another model or KV layout "
                                f"than {model!r} is served with ({what})",
                                hint="thaw it on a server with the settings it was frozen on")

    def clone(self, tenant: str, name: str, new_name: str, *, description: str | None = None,
              tags: Sequence[str] | None = None) -> Manifest:
        check_window_name(new_name)
        m = self.get(tenant, name)
        if self.catalog.find(tenant, new_name) is not None:
            raise AlreadyExists(f"a window named {new_name!r} already exists",
                                hint="choose another name")
        wkeys = self.blocks.of_window(m)
        n = self.blocks.restorable(wkeys)
        if n < m.num_blocks:
            raise WindowIncomplete(f"window {name!r} has {n} of its {m.num_blocks} blocks",
                                   hint="clone a complete window, or freeze the session again")
        wsalt = "cwm-window:" + secrets.token_hex(16)
        hashes = self.blocks.chain(m, m.tokens, wsalt, n)
        now = time.time()
        clone = Manifest(**{**asdict(m), "name": new_name, "window_salt": wsalt,
                            "window_hashes": [h.hex() for h in hashes], "parent": name,
                            "created": now, "updated": now, "last_thaw": None,
                            "auto": False,
                            "tags": check_tags(tags) if tags is not None else m.tags,
                            "description": m.description if description is None
                            else str(description)[:MAX_DESCRIPTION]})
        clone.workers = [tuple(w) for w in clone.workers]
        ckeys = self.blocks.keys(m.workers, hashes)
        self.tenancy.pin_new(clone, ckeys,
                             lambda: self.blocks.rekey(wkeys, ckeys, m.window_salt, wsalt))
        return clone

    def delete(self, tenant: str, name: str) -> None:
        m = self.get(tenant, name)
        self.catalog.drop(m)
        log.info("window %s deleted for tenant %s", name, tenant)
