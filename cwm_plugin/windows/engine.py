"""The window engine: freeze, thaw, clone, list, status and delete context windows, on the real
KV blocks in the store. No HTTP in here (REST, CLI and MCP call this).

* **freeze** finds the session's latest context record (left by the connector when a salted
  request finished), checks that this process hashes like the vLLM that saved it, waits for the
  blocks' pending saves to reach a durable tier, then re-keys them under a fresh *window salt*
  -- the same blobs, new keys (``link_many``, no tensor copy) -- pins those keys (under the
  store's pin quota) and claims the manifest name atomically. Each window owns its keys, so
  deleting one never unpins another's blocks, and the session's own keys stay a plain cache.
* **thaw** re-keys the window's blocks under the target session's salt: the next request of
  that session, with the same tokens, hits them in vLLM. **clone** re-keys them under a new
  window salt and pins those: a branch sharing the blobs. **delete** unpins and drops the
  window's keys; a blob is freed only when no key (a clone's, a session's) points to it.
* With encryption at rest a blob opens only under its salt, so re-keying re-seals the stored
  bytes for the new salt (a byte copy; nothing is decoded or re-encoded).

Tenants are isolated by the manifest keys (:mod:`.model`): another tenant's window is
indistinguishable from an unknown one.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cwm_plugin.connector import records
from cwm_plugin.errors import AlreadyExists, CWMError, NotFound
from cwm_plugin.store import crypto
from cwm_plugin.store.tiered import KVStore
from cwm_plugin.windows import hashing
from cwm_plugin.windows.model import (
    MANIFEST_LAYOUT,
    Manifest,
    check_name,
    check_tags,
    manifest_key,
    manifest_salt,
    tenant_group,
)

log = logging.getLogger(__name__)


class WindowIncomplete(CWMError):
    """Blocks a window needs are not (or no longer) stored."""

    code = "window_incomplete"
    http_status = 409


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
    token_ids: list[int] = field(default_factory=list, repr=False)   # what a warm-up sends

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "session": self.session, "tokens": self.tokens,
                "restorable_tokens": self.restorable_tokens, "blocks": self.blocks,
                "messages": self.messages, "warm": self.warm}


class WindowEngine:
    def __init__(self, store: KVStore, *, wait_s: float = 30.0) -> None:
        self.store = store
        self.wait_s = wait_s

    # --- manifests ----------------------------------------------------------------------------

    def _read(self, key: bytes, tenant: str) -> Manifest | None:
        t = self.store.get(key, salt=manifest_salt(tenant), primary=True)
        return Manifest.from_tensor(t) if t is not None else None

    def get(self, tenant: str, name: str) -> Manifest:
        m = self._read(manifest_key(tenant, check_name(name)), tenant)
        if m is None or m.tenant != tenant or m.name != name:
            raise NotFound(f"no window named {name!r}",
                           hint="list windows with `cwm window ls`")
        return m

    def _claim(self, m: Manifest) -> None:
        key = manifest_key(m.tenant, m.name)
        if not self.store.claim(key, m.to_tensor(), layout=MANIFEST_LAYOUT,
                                salt=manifest_salt(m.tenant)):
            raise AlreadyExists(f"a window named {m.name!r} already exists",
                                hint="choose another name or delete that window first")
        try:
            self.store.pin_many([key])    # as safe from eviction as the window's blocks
        except BaseException:
            self.store.delete_many([key])
            raise

    def _update(self, m: Manifest) -> None:
        m.updated = time.time()
        self.store.put(manifest_key(m.tenant, m.name), m.to_tensor(), layout=MANIFEST_LAYOUT,
                       salt=manifest_salt(m.tenant), replace=True).result()

    # --- keys ---------------------------------------------------------------------------------

    def _chain(self, m: Manifest | records.ContextRecord, tokens: Sequence[int], salt: str,
               n: int) -> list[bytes]:
        return hashing.chain(tokens, salt=salt, block_size=m.block_size,
                             hash_block_size=m.hash_block_size, hash_algo=m.hash_algo,
                             lora=m.lora, num_blocks=n)

    @staticmethod
    def _keys(workers: Sequence[tuple[str, int]], hashes: Sequence[bytes]) -> list[list[bytes]]:
        return [[bytes.fromhex(d) + int(r).to_bytes(2, "big") + h for h in hashes]
                for d, r in workers]

    def _restorable(self, keys: list[list[bytes]], *, durable: bool = True) -> int:
        """Blocks present for every worker, from the first block on."""
        n = len(keys[0]) if keys else 0
        if not n:
            return 0
        where = self.store.where_many([k for ks in keys for k in ks])
        ok = [all(where[w * n + i] is not None and (not durable or where[w * n + i] != "memory")
                  for w in range(len(keys))) for i in range(n)]
        return next((i for i, good in enumerate(ok) if not good), n)

    def _rekey(self, src: list[list[bytes]], dst: list[list[bytes]], src_salt: str,
               dst_salt: str) -> None:
        """Point ``dst`` keys at ``src`` keys' blobs (per worker, one batch per tier)."""
        pairs = [(d, s) for ds, ss in zip(dst, src, strict=True)
                 for d, s in zip(ds, ss, strict=True)]
        if self.store.config.encryption_key:
            self._reseal(pairs, src_salt, dst_salt)
        else:
            self.store.link_many(pairs)
        missing = sum(1 for ks in dst for k, w in zip(ks, self.store.where_many(ks),
                                                      strict=True) if w is None)
        if missing:
            self.store.delete_many([k for ks in dst for k in ks])
            raise WindowIncomplete(f"{missing} blocks vanished while being re-keyed",
                                   hint="they were evicted meanwhile; retry, or re-run the "
                                        "conversation so its blocks are saved again")

    def _reseal(self, pairs: list[tuple[bytes, bytes]], src_salt: str, dst_salt: str) -> None:
        master = crypto.parse_master_key(self.store.config.encryption_key or "")
        src_c, dst_c = (crypto.BlobCipher.derive(master, s) for s in (src_salt, dst_salt))
        futures = []
        for new, old in pairs:
            blob = self.store.get_blob(old)
            if blob is None:
                continue
            plain = crypto.unseal(blob, src_c)
            futures.append(self.store.put_blob(new, dst_c.seal(plain), replace=True))
        for f in futures:
            f.result()

    def _wait_stored(self, keys: list[list[bytes]], wait_s: float) -> int:
        deadline = time.monotonic() + wait_s
        n = len(keys[0]) if keys else 0
        while True:
            got = self._restorable(keys)
            if got >= n or time.monotonic() >= deadline:
                return got
            time.sleep(0.2)

    def _latest(self, salt: str, deadline: float
                ) -> tuple[records.ContextRecord, list[bytes]] | None:
        """The salt's latest context record and its verified block hashes, waiting until
        ``deadline`` (monotonic) for one being written (a request that just finished)."""
        t = self.store.get(records.record_key(salt), salt=salt, primary=True)
        while t is None and time.monotonic() < deadline:
            time.sleep(0.2)
            t = self.store.get(records.record_key(salt), salt=salt, primary=True)
        if t is None:
            return None
        rec = records.ContextRecord.from_tensor(t)
        hashes = rec.hashes()
        hashing.verified_chain(hashes, rec.tokens, salt=salt, block_size=rec.block_size,
                               hash_block_size=rec.hash_block_size, hash_algo=rec.hash_algo,
                               lora=rec.lora)
        return rec, hashes

    # --- operations ---------------------------------------------------------------------------

    def move_session(self, old_salt: str, new_salt: str) -> int:
        """Re-key a session's latest context from ``old_salt`` to ``new_salt`` (its salt after
        a secret rotation): the blocks stored from the first on get keys under the
        new salt (the same blobs, as :meth:`thaw` does) and the new salt a context record, so
        its next request hits them. The old keys stay a plain cache. Returns the blocks moved
        (0: no record or no stored first block under ``old_salt``, or the new salt has one)."""
        if self.store.where_many([records.record_key(new_salt)])[0] is not None:
            return 0  # moved before (by another process), or the session went on already
        found = self._latest(old_salt, time.monotonic())
        if found is None:
            return 0
        rec, hashes = found
        keys = self._keys(rec.workers, hashes)
        n = self._restorable(keys, durable=False)  # the sidecar's store has no memory tier
        if n == 0:
            return 0
        moved = self._chain(rec, rec.tokens, new_salt, n)
        self._rekey([ks[:n] for ks in keys], self._keys(rec.workers, moved), old_salt, new_salt)
        rec = replace(rec, block_hashes=[h.hex() for h in moved])
        self.store.put(records.record_key(new_salt), rec.to_tensor(),
                       layout=records.RECORD_LAYOUT, salt=new_salt).result()  # a newer wins
        return n


    def freeze(self, tenant: str, name: str, *, session: str, salt: str,
               messages: list[dict] | None = None, tags: Sequence[str] = (),
               description: str = "", wait_s: float | None = None) -> Manifest:
        check_name(name)
        tags = check_tags(tags)
        if self._read(manifest_key(tenant, name), tenant) is not None:
            raise AlreadyExists(f"a window named {name!r} already exists",
                                hint="choose another name or delete that window first")
        wait = self.wait_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait
        found = self._latest(salt, deadline)
        if found is None:
            raise NotFound(f"session {session!r} has no saved context yet",
                           hint="send at least one request in that session (through vLLM "
                                "with the cwm connector and a durable store) before freezing")
        rec, hashes = found
        keys = self._keys(rec.workers, hashes)
        got = self._wait_stored(keys, max(0.0, deadline - time.monotonic()))
        if got < len(hashes):
            raise WindowIncomplete(
                f"{len(hashes) - got} of {len(hashes)} blocks of session {session!r} are not on "
                f"a durable tier; {got * rec.block_size} of {len(rec.tokens)} tokens are "
                "restorable", hint="they were evicted or are still being written; retry, or "
                                   "re-send the conversation so its blocks are saved again")
        wsalt = "cwm-window:" + secrets.token_hex(16)
        whashes = self._chain(rec, rec.tokens, wsalt, len(hashes))
        wkeys = self._keys(rec.workers, whashes)
        m = Manifest(name=name, tenant=tenant, session=session, frozen_salt=salt,
                     window_salt=wsalt, tokens=list(rec.tokens), block_size=rec.block_size,
                     hash_block_size=rec.hash_block_size, hash_algo=rec.hash_algo,
                     workers=list(rec.workers), window_hashes=[h.hex() for h in whashes],
                     namespace=rec.namespace, lora=rec.lora, num_blocks=len(hashes),
                     messages=messages, tags=tags, description=description[:4096],
                     created=time.time(), updated=time.time())
        self._pin_new(m, keys, wkeys, salt)
        log.info("window %s frozen for tenant %s: %d blocks, %d tokens", name, tenant,
                 len(hashes), len(rec.tokens))
        return m

    def _pin_new(self, m: Manifest, src: list[list[bytes]], wkeys: list[list[bytes]],
                 src_salt: str) -> None:
        """Re-key into the window's keys, pin them, claim the name; undo all on failure."""
        flat = [k for ks in wkeys for k in ks]
        self._rekey(src, wkeys, src_salt, m.window_salt)
        try:
            pinned = self.store.pin_many(flat)
            if pinned and not any(len(set(got)) == len(set(flat)) for got in pinned.values()):
                # a block evicted between the re-key and the pin: no durable tier holds the
                # whole window, and a thaw would restore only a prefix of it
                lost = len(set(flat)) - max(len(set(got)) for got in pinned.values())
                raise WindowIncomplete(f"{lost} blocks were evicted while being pinned",
                                       hint="retry, or re-run the conversation so its "
                                            "blocks are saved again")
            self._claim(m)
        except BaseException:
            self.store.delete_many(flat)
            raise

    def thaw(self, tenant: str, name: str, *, session: str, salt: str,
             model: str | None = None) -> ThawResult:
        """Re-key the window under ``salt``. A warm-up (a one-token request through vLLM, so
        the blocks are in its cache) is the caller's: it has the upstream; see
        :meth:`note_warm`."""
        m = self.get(tenant, name)
        if model is not None:
            self._check_model(m, model)
        wkeys = self._keys(m.workers, [bytes.fromhex(h) for h in m.window_hashes])
        n = self._restorable(wkeys)
        if n == 0 and m.num_blocks:
            raise WindowIncomplete(f"window {name!r} has lost its first block; nothing is "
                                   "restorable", hint="delete it and freeze the session again")
        hashing.verified_chain([bytes.fromhex(h) for h in m.window_hashes[:n]], m.tokens,
                               salt=m.window_salt, block_size=m.block_size,
                               hash_block_size=m.hash_block_size, hash_algo=m.hash_algo,
                               lora=m.lora)
        tkeys = self._keys(m.workers, self._chain(m, m.tokens, salt, n))
        self._rekey([ks[:n] for ks in wkeys], tkeys, m.window_salt, salt)
        result = ThawResult(name, session, len(m.tokens), n * m.block_size, n, m.messages,
                            token_ids=list(m.tokens))
        m.last_thaw = {"session": session, "time": time.time(),
                       "restorable_tokens": result.restorable_tokens}
        self._update(m)
        return result

    def note_warm(self, tenant: str, name: str, warm: dict[str, Any]) -> None:
        """Record what vLLM measured when a thawed window was warmed up."""
        m = self.get(tenant, name)
        m.last_thaw = {**(m.last_thaw or {}), "hits": warm.get("hits"),
                       "warm_seconds": warm.get("seconds")}
        self._update(m)

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

    def clone(self, tenant: str, name: str, new_name: str) -> Manifest:
        check_name(new_name)
        m = self.get(tenant, name)
        if self._read(manifest_key(tenant, new_name), tenant) is not None:
            raise AlreadyExists(f"a window named {new_name!r} already exists",
                                hint="choose another name")
        wkeys = self._keys(m.workers, [bytes.fromhex(h) for h in m.window_hashes])
        n = self._restorable(wkeys)
        if n < m.num_blocks:
            raise WindowIncomplete(f"window {name!r} has {n} of its {m.num_blocks} blocks",
                                   hint="clone a complete window, or freeze the session again")
        wsalt = "cwm-window:" + secrets.token_hex(16)
        hashes = self._chain(m, m.tokens, wsalt, n)
        clone = Manifest(**{**m.__dict__, "name": new_name, "window_salt": wsalt,
                            "window_hashes": [h.hex() for h in hashes], "parent": name,
                            "created": time.time(), "updated": time.time(),
                            "last_thaw": None})
        self._pin_new(clone, wkeys, self._keys(m.workers, hashes), m.window_salt)
        return clone

    def delete(self, tenant: str, name: str) -> None:
        m = self.get(tenant, name)
        keys = [k for ks in self._keys(m.workers, [bytes.fromhex(h) for h in m.window_hashes])
                for k in ks]
        self.store.unpin_many(keys)
        self.store.delete_many([*keys, manifest_key(tenant, name)])
        log.info("window %s deleted for tenant %s", name, tenant)

    def list(self, tenant: str, *, tag: str | None = None, model: str | None = None,
             session: str | None = None, text: str | None = None, sort: str = "created",
             descending: bool = True, limit: int = 50, offset: int = 0
             ) -> tuple[list[Manifest], int]:
        """(one page of the tenant's windows, how many match)."""
        keys: set[bytes] = set()
        for infos in self.store.list_keys(tenant_group(tenant), limit=100_000).values():
            keys |= {i.key for i in infos}
        found = [m for k in sorted(keys) if (m := self._read(k, tenant)) is not None
                 and m.tenant == tenant]
        needle = (text or "").lower()
        found = [m for m in found if (tag is None or tag in m.tags)
                 and (model is None or m.model == model)
                 and (session is None or m.session == session)
                 and (not needle or needle in m.name.lower() or needle in m.description.lower())]
        order = {"created": lambda m: m.created, "updated": lambda m: m.updated,
                 "name": lambda m: m.name, "tokens": lambda m: len(m.tokens)}
        if sort not in order:
            raise CWMError(f"cannot sort by {sort!r}", hint=f"one of {', '.join(order)}")
        found.sort(key=order[sort], reverse=descending)
        return found[offset:offset + max(0, limit)], len(found)

    def status(self, tenant: str, name: str) -> dict[str, Any]:
        m = self.get(tenant, name)
        wkeys = self._keys(m.workers, [bytes.fromhex(h) for h in m.window_hashes])
        flat = [k for ks in wkeys for k in ks]
        tiers: dict[str, dict[str, Any]] = {}
        stored = 0
        for tier, infos in self.store.info_many(flat).items():
            present = [i for i in infos if i is not None]
            size = sum(i.size or 0 for i in present)
            tiers[tier] = {"blocks": len(present), "pinned": sum(i.pinned for i in present),
                           "bytes": size}
            stored = max(stored, size)
        ns = m.namespace
        raw = len(flat) * int(ns.get("num_layers", 0)) * 2 * int(ns.get("num_kv_heads", 0)) * \
            int(ns.get("head_size", 0)) * m.block_size * _dtype_bytes(str(ns.get("dtype", "")))
        children = [c.name for c in self.list(tenant, limit=100_000)[0] if c.parent == name]
        restorable = self._restorable(wkeys)
        return {**m.public(), "restorable_tokens": restorable * m.block_size,
                "restorable_blocks": restorable, "tiers": tiers, "stored_bytes": stored,
                "raw_bytes": raw, "compression_ratio": round(raw / stored, 3) if stored else None,
                "children": children, "namespace": m.namespace.get("model_fingerprint")}


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "fp8": 1, "int8": 1, "uint8": 1}.get(dtype, 2)
