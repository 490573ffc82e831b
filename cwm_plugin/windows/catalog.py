"""The stored windows of every owner: their manifests and thaw notes, read, listed and edited.

:class:`WindowCatalog` reads and writes manifests (:mod:`.model`) without touching the blocks
they name, except to drop a window's keys with it. ``list`` filters, sorts and pages an
owner's manifests; ``status`` says per durable tier how many of the window's blocks it holds
and whether that tier alone could restore it; ``patch`` renames a window (its keys stay: they
belong to the window's own salt, not its name; the new name is claimed under the tenant's lock
like any other) or changes its tags and description.

* **One lock per tenant** (re-entrant: one tenant never waits for another's operations): every
  step that pins or names a window -- a claim, a rename, a move, a delete, the removal of an
  expired window, a commit's quota check (:mod:`.tenancy`) -- holds it. It guards the rest of
  what this process keeps of the tenant (:class:`~.tenant_state.TenantState`): the bytes its
  live windows pin (:meth:`WindowCatalog.pinned_bytes`, a running total a claim adds to and a
  drop takes from) and the users whose former layout it looked at.
* **An expired window is gone**: the read that finds it past its ``expires`` (a get, a list,
  a name check) drops its keys, pins, manifest and thaw note under the lock (unless the
  manifest changed meanwhile), so its name and its bytes are free at once.
* **The former layout**: a user's windows written when each user had a manifest group of its
  own (:func:`~.model.former_place`) are moved into the tenant's group the first time this
  process lists or names that user's windows (remembered per user, the newest ``REMEMBER`` of
  each tenant, so one tenant's users never push out another's):
  manifest and thaw note re-keyed and re-sealed, blocks untouched. A move is a claim of the
  new key (atomic: of two processes moving one window, one claims it; the other finds the same
  window there and drops the former keys, as a retry after a crash does); a name the user has
  in the tenant's group already keeps the former window where it is (logged).

Every manifest written passes :func:`~.model.check_manifest`; one read that does not is logged
and taken for absent (never dropped: a stricter rule must not delete windows).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

from cwm_plugin.connector import records
from cwm_plugin.errors import AlreadyExists, CWMError, InvalidInput, NotFound
from cwm_plugin.salts import tenant_of, user_of
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.store.replication import presence
from cwm_plugin.windows.model import (
    MANIFEST_LAYOUT,
    MAX_DESCRIPTION,
    NAME_BYTES,
    Manifest,
    Place,
    check_manifest,
    check_tags,
    check_window_name,
    former_group,
    former_place,
    former_salt,
    manifest_key,
    manifest_salt,
    owner_group,
    place_of,
    tenant_group,
    thaw_key,
)
from cwm_plugin.windows.rekey import BlockKeys
from cwm_plugin.windows.tenant_state import TenantState

log = logging.getLogger(__name__)
REMEMBER = 65_536  # users of a tenant whose former layout this process looked at
SORTS = {"created": lambda m: m.created, "updated": lambda m: m.updated,
         "name": lambda m: m.name, "tokens": lambda m: len(m.tokens),
         "size": lambda m: m.stored_bytes}
# the context-window-manager's names for the same orders
SORT_ALIASES = {"created_at": "created", "updated_at": "updated", "token_count": "tokens",
                "total_size_bytes": "size"}


def sort_key(sort: str) -> str:
    """Our name of a sort order (``created_at`` -> ``created``); unknown ones are a 400."""
    name = SORT_ALIASES.get(sort, sort)
    if name not in SORTS:
        raise InvalidInput(f"cannot sort by {sort[:40]!r}",
                           hint=f"one of {', '.join([*SORTS, *SORT_ALIASES])}")
    return name


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "fp8": 1, "int8": 1, "uint8": 1}.get(dtype, 2)


class WindowCatalog:
    """The windows stored in ``store`` (see the module docstring)."""

    def __init__(self, store: KVStore, blocks: BlockKeys) -> None:
        self.store = store
        self.blocks = blocks
        self._tenants: dict[str, TenantState] = {}
        self._tenants_guard = threading.Lock()

    def state(self, owner: str) -> TenantState:
        """What this process keeps of ``owner``'s tenant (a user's windows are their
        tenant's); read and changed holding its ``lock``."""
        tenant = tenant_of(owner)
        with self._tenants_guard:
            state = self._tenants.get(tenant)
            if state is None:
                state = self._tenants[tenant] = TenantState()
            return state

    def lock(self, owner: str) -> threading.RLock:
        """The lock of ``owner``'s tenant (a user's windows share their tenant's)."""
        return self.state(owner).lock

    def pinned_bytes(self, owner: str, *, fresh: bool = False) -> int:
        """What the live windows of ``owner``'s tenant and of all its users pin: the running
        total, derived from their manifests first, when it is stale, or when ``fresh``."""
        state = self.state(owner)
        with state.lock:
            if fresh or state.stale():
                state.derive(self.manifests(tenant_of(owner), whole_tenant=True))
            return state.total

    # --- reading ------------------------------------------------------------------------------

    def _load(self, key: bytes, owner: str, salt: str | None = None) -> Manifest | None:
        """The manifest stored under ``key`` (expired or not; ``salt``: what seals it, by
        default the owner's); one that is not a valid manifest is logged and taken for
        absent."""
        t = self.store.get(key, salt=salt or manifest_salt(owner), primary=True)
        if t is None:
            return None
        try:
            return check_manifest(Manifest.from_tensor(t))
        except (CWMError, KeyError, TypeError, ValueError) as exc:  # logged once per key
            self.store.tier_set.log_once(
                f"manifest-{key.hex()}", "a window manifest of tenant %s is unreadable and "
                "ignored: %s", tenant_of(owner), str(exc)[:200])
            return None

    def read(self, key: bytes, owner: str) -> Manifest | None:
        """The live manifest under ``key``: an expired one is dropped here."""
        m = self._load(key, owner)
        if m is not None and m.expired():
            self._expire(key, m)
            return None
        return m

    def find(self, owner: str, name: str) -> Manifest | None:
        """``owner``'s live window named ``name``, if there is one."""
        self._follow_layout(owner)
        return self.read(manifest_key(owner, name), owner)

    def get(self, owner: str, name: str) -> Manifest:
        m = self.find(owner, check_window_name(name))
        if m is None or m.tenant != owner or m.name != name:
            raise NotFound(f"no window named {name!r}",
                           hint="list windows with `cwm window ls`")
        return m

    def manifests(self, owner: str, *, whole_tenant: bool = False) -> list[Manifest]:
        """Every live window of ``owner`` (a tenant, or a user in it: ``tenant/u-...``);
        ``whole_tenant``: of the owner's tenant and of every user in it."""
        tenant = tenant_of(owner)
        if not whole_tenant:
            self._follow_layout(owner)
        prefix = tenant_group(tenant) if whole_tenant else owner_group(owner)
        keys = self._keys_under(prefix, exact=not whole_tenant)  # a tenant's own: not its
        return [m for k in sorted(keys) if (m := self.read(k, owner)) is not None  # users'
                and (tenant_of(m.tenant) == tenant if whole_tenant else m.tenant == owner)]

    def _keys_under(self, prefix: bytes, *, exact: bool) -> set[bytes]:
        """The manifest keys starting with ``prefix`` (``exact``: only a name part after it,
        no longer keys)."""
        keys: set[bytes] = set()
        for infos in self.store.list_keys(prefix, limit=100_000).values():
            keys |= {i.key for i in infos if not exact or len(i.key) == len(prefix) + NAME_BYTES}
        return keys

    def last_thaw(self, m: Manifest) -> dict | None:
        t = self.store.get(thaw_key(m.tenant, m.name), salt=manifest_salt(m.tenant),
                           primary=True)
        return records.tensor_json(t) if t is not None else None

    # --- writing ------------------------------------------------------------------------------

    def ttl(self, m: Manifest) -> float | None:
        """How long the pins of window ``m`` last: until it expires (at least a second), or
        for good (None)."""
        return None if m.expires is None else max(1.0, m.expires - time.time())

    def claim(self, m: Manifest) -> None:
        """Store ``m`` under its name unless a live window has it (a name an expired window
        held is free: the read drops that one), and pin it."""
        check_manifest(m)
        key = manifest_key(m.tenant, m.name)
        with self.lock(m.tenant):
            if not self._store_new(key, m) and (self.read(key, m.tenant) is not None
                                                or not self._store_new(key, m)):
                raise AlreadyExists(f"a window named {m.name!r} already exists",
                                    hint="choose another name or delete that window first")
            try:
                self.store.pin_many([key], ttl_s=self.ttl(m))  # as safe as its blocks
            except BaseException:
                self.store.delete_many([key])
                raise
            self.state(m.tenant).add(m)

    def _store_new(self, key: bytes, m: Manifest) -> bool:
        return self.store.claim(key, m.to_tensor(), layout=MANIFEST_LAYOUT,
                                salt=manifest_salt(m.tenant))

    def rewrite(self, m: Manifest) -> None:
        """Replace a window's manifest; if a delete removed it meanwhile, the rewrite (which
        would stand unpinned) is taken back."""
        check_manifest(m)
        m.updated = time.time()
        key = manifest_key(m.tenant, m.name)
        self.store.put(key, m.to_tensor(), layout=MANIFEST_LAYOUT,
                       salt=manifest_salt(m.tenant), replace=True).result()
        if not self.store.pinned(key):
            self.store.delete_many([key])
            raise NotFound(f"window {m.name!r} was deleted meanwhile")

    def note_thaw(self, m: Manifest, note: dict[str, Any]) -> None:
        """Note the last thaw (written before the thaw answers, so a status right after sees
        it; a failure is logged, never fails the thaw)."""
        try:
            self.store.put(thaw_key(m.tenant, m.name), records.json_tensor(note),
                           layout="cwm-window-thaw", salt=manifest_salt(m.tenant),
                           replace=True).result()
        except Exception as exc:  # a full or closed store: the thaw itself stands
            log.warning("window %s: its thaw note could not be saved: %s", m.name, exc)

    def drop(self, m: Manifest) -> None:
        """Unpin and delete window ``m``'s keys, its manifest and its thaw note."""
        keys = [k for ks in self.blocks.of_window(m) for k in ks]
        mkey = manifest_key(m.tenant, m.name)
        with self.lock(m.tenant):
            self.store.unpin_many([*keys, mkey])
            self.store.delete_many([*keys, mkey, thaw_key(m.tenant, m.name)])
            self.state(m.tenant).remove(m)

    def _expire(self, key: bytes, m: Manifest) -> None:
        """Drop window ``m`` (read under ``key``, expired) with its keys, pins and thaw note,
        if it is still there and still that window (not renewed, not replaced)."""
        if manifest_key(m.tenant, m.name) != key:
            return
        with self.lock(m.tenant):
            now = self._load(key, m.tenant)
            if now is not None and now.window_salt == m.window_salt and now.expired():
                self.drop(now)
                log.info("window %s of tenant %s expired: its name and pins are free", m.name,
                         tenant_of(m.tenant))

    def move(self, m: Manifest, owner: str, name: str, src: Place | None = None) -> Manifest:
        """Claim ``m`` as ``owner``'s window ``name`` (atomic: of two moves to one name, one
        wins), then drop its manifest and thaw note where it was (``src``, by default its
        place now; its blocks stay)."""
        src = src or place_of(m.tenant, m.name)
        moved = replace(m, tenant=owner, name=name)
        with self.lock(owner):
            self.claim(moved)
            self.store.unpin_many([src.key])
            self.store.delete_many([src.key, src.note])
        return moved

    def patch(self, owner: str, name: str, *, new_name: str | None = None,
              tags: list[str] | None = None, description: str | None = None) -> Manifest:
        """Rename a window and/or replace its tags or description."""
        m = self.get(owner, name)
        m.auto = False  # edited: the caller's now, never pruned as an auto-checkpoint
        if tags is not None:
            m.tags = check_tags(tags)
        if description is not None:
            m.description = str(description)[:MAX_DESCRIPTION]
        if new_name is None or new_name == name:
            self.rewrite(m)
            return m
        check_window_name(new_name)
        if self.find(owner, new_name) is not None:
            raise AlreadyExists(f"a window named {new_name!r} already exists",
                                hint="choose another name")
        with self.lock(owner):
            m = self.move(m, owner, new_name)  # atomic: one of two renames to one name wins
            for child in self.manifests(owner):
                if child.parent == name:  # keep the lineage
                    child.parent = new_name
                    self.rewrite(child)
        return m

    # --- the former layout --------------------------------------------------------------------

    def _follow_layout(self, owner: str) -> None:
        """Move user ``owner``'s windows from the former layout into its tenant's group, once
        in this process (see the module docstring; a move that fails is logged, and the next
        listing or naming of the user's windows tries again)."""
        state = self.state(owner)
        if user_of(owner) is None or owner in state.users:
            return
        with state.lock:
            if owner in state.users:
                return
            outcomes = [self._upgrade(owner, key) for key in
                        sorted(self._keys_under(former_group(owner), exact=True))]
            if outcomes.count("moved"):
                log.info("tenant %s: %d windows of a user moved from the former layout into "
                         "the tenant's group", tenant_of(owner), outcomes.count("moved"))
            if "failed" not in outcomes:
                state.remember(owner, REMEMBER)

    def _upgrade(self, owner: str, key: bytes) -> str:
        """Move the window stored under the former layout's ``key`` into the tenant's group
        with its thaw note: moved, cleared (moved already: the former keys left went), stays
        (unreadable, or its name is taken) or failed."""
        m = self._load(key, owner, former_salt(owner))
        if m is None or m.tenant != owner or former_place(owner, m.name).key != key:
            return "stays"   # unreadable (logged) or not this user's
        src = former_place(owner, m.name)
        note = self.store.get(src.note, salt=src.salt, primary=True)
        try:
            moved = self.move(m, owner, m.name, src)
        except AlreadyExists:
            there = self._load(manifest_key(owner, m.name), owner)
            if there is None or there.window_salt != m.window_salt:
                log.warning("tenant %s: a user's window in the former layout stays there: the "
                            "user has a window named %r", tenant_of(owner), m.name)
                return "stays"
            self.store.unpin_many([src.key])   # moved by another process, or before a crash:
            self.store.delete_many([src.key, src.note])   # what is left of it goes
            return "cleared"
        except CWMError as exc:  # the store's pin quota, say: the user's windows stay listable
            log.warning("tenant %s: a user's window could not move from the former layout "
                        "(%s); it is tried again", tenant_of(owner), exc)
            return "failed"
        if note is not None:
            self.note_thaw(moved, records.tensor_json(note))
        return "moved"

    # --- views --------------------------------------------------------------------------------

    def list(self, owner: str, *, tag: str | None = None, tags: list[str] | None = None,
             model: str | None = None, session: str | None = None, text: str | None = None,
             sort: str = "created", descending: bool = True, limit: int = 50,
             offset: int = 0) -> tuple[list[Manifest], int]:
        """(one page of the owner's windows, how many match); ``tags``: all of them."""
        order = SORTS[sort_key(sort)]
        want = set(tags or []) | ({tag} if tag else set())
        needle = (text or "").lower()
        found = [m for m in self.manifests(owner) if want <= set(m.tags)
                 and (model is None or m.model == model)
                 and (session is None or m.session == session)
                 and (not needle or needle in m.name.lower() or needle in m.description.lower())]
        found.sort(key=order, reverse=descending)
        return found[offset:offset + max(0, limit)], len(found)

    def status(self, owner: str, name: str) -> dict[str, Any]:
        m = self.get(owner, name)
        wkeys = self.blocks.of_window(m)
        flat = [k for ks in wkeys for k in ks]
        held = presence(self.store, flat)
        tiers: dict[str, dict[str, Any]] = {}
        stored = 0
        n = m.num_blocks
        infos_by_tier = self.store.info_many(flat)
        for tier, there in held.items():  # the durable tiers (pins live there)
            present = [i for i in infos_by_tier.get(tier, []) if i is not None]
            size = sum(i.size or 0 for i in present)
            blocks = sum(all(there[w * n + i] for w in range(len(wkeys))) for i in range(n))
            pinned = sum(i.pinned and not i.leased for i in present)   # leases are not its
            tiers[tier] = {"blocks": blocks, "pinned": pinned, "bytes": size,
                           "complete": blocks == n}
            stored = max(stored, size)
        ns = m.namespace
        raw = len(flat) * int(ns.get("num_layers", 0)) * 2 * int(ns.get("num_kv_heads", 0)) * \
            int(ns.get("head_size", 0)) * m.block_size * _dtype_bytes(str(ns.get("dtype", "")))
        children = [c.name for c in self.manifests(owner) if c.parent == name]
        restorable = self.blocks.restorable(wkeys)
        warnings = [f"the {t} tier holds {v['blocks']} of {m.num_blocks} blocks"
                    for t, v in tiers.items() if not v["complete"]]
        return {**m.public(), "last_thaw": self.last_thaw(m),
                "restorable_tokens": restorable * m.block_size,
                "restorable_blocks": restorable, "tiers": tiers, "stored_bytes": stored,
                "raw_bytes": raw, "compression_ratio": round(raw / stored, 3) if stored else None,
                "children": children, "lineage": self.lineage(owner, m),
                "blocks_expected": m.num_blocks, "blocks_found": restorable,
                "cache_complete": restorable == m.num_blocks, "warnings": warnings,
                "namespace": m.namespace.get("model_fingerprint")}

    def lineage(self, owner: str, m: Manifest) -> list[str]:
        """The window's ancestors, oldest first (as far as they still exist)."""
        out: list[str] = []
        parent = m.parent
        while parent and parent not in out and len(out) < 64:
            out.insert(0, parent)
            up = self.find(owner, parent)
            parent = up.parent if up is not None else None
        return out
