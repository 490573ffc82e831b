"""Reading and editing a tenant's windows without touching their blocks: list, status, patch.

A mixin of :class:`~cwm_plugin.windows.engine.WindowEngine` (it needs the engine's store and
manifest helpers). ``list`` filters, sorts and pages an owner's manifests (an expired one is
dropped as it is read: :mod:`.tenancy`); ``status`` says per durable tier how many of the window's blocks it holds and
whether that tier alone could restore it; ``patch`` renames a window (its keys stay: they
belong to the window's own salt, not its name; the new name is claimed under the tenant's
lock like any other) or changes its tags and description.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cwm_plugin.errors import AlreadyExists, InvalidInput
from cwm_plugin.store.replication import presence
from cwm_plugin.windows.model import (
    MAX_DESCRIPTION,
    NAME_BYTES,
    Manifest,
    check_name,
    check_tags,
    manifest_key,
    owner_group,
    tenant_group,
    tenant_of,
)

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
    store: Any

    def get(self, tenant: str, name: str) -> Manifest: ...  # the engine's
    def _read(self, key: bytes, tenant: str) -> Manifest | None: ...
    def _keys(self, workers: Any, hashes: Any) -> list[list[bytes]]: ...
    def _restorable(self, keys: list[list[bytes]], *, durable: bool = True) -> int: ...
    def _rewrite(self, m: Manifest) -> None: ...
    def _last_thaw(self, m: Manifest) -> dict | None: ...
    _move: Callable[[Manifest, str, str], Manifest]   # the tenancy mixin's (not stubs: the
    _tenant_lock: Callable[[str], Any]                # engine's bases come after this one)

    def window_keys(self, m: Manifest) -> list[list[bytes]]:
        return self._keys(m.workers, [bytes.fromhex(h) for h in m.window_hashes])

    def manifests(self, owner: str, *, whole_tenant: bool = False) -> list[Manifest]:
        """Every live window of ``owner`` (a tenant, or a user in it: ``tenant/u-...``);
        ``whole_tenant``: of the owner's tenant and of every user in it."""
        tenant = tenant_of(owner)
        prefix = tenant_group(tenant) if whole_tenant else owner_group(owner)
        keys: set[bytes] = set()
        for infos in self.store.list_keys(prefix, limit=100_000).values():
            keys |= {i.key for i in infos  # a tenant's own: not its users' (longer keys)
                     if whole_tenant or len(i.key) == len(prefix) + NAME_BYTES}
        return [m for k in sorted(keys) if (m := self._read(k, owner)) is not None
                and (tenant_of(m.tenant) == tenant if whole_tenant else m.tenant == owner)]

    def list(self, tenant: str, *, tag: str | None = None, tags: list[str] | None = None,
             model: str | None = None, session: str | None = None, text: str | None = None,
             sort: str = "created", descending: bool = True, limit: int = 50,
             offset: int = 0) -> tuple[list[Manifest], int]:
        """(one page of the tenant's windows, how many match); ``tags``: all of them."""
        order = SORTS[sort_key(sort)]
        want = set(tags or []) | ({tag} if tag else set())
        needle = (text or "").lower()
        found = [m for m in self.manifests(tenant) if want <= set(m.tags)
                 and (model is None or m.model == model)
                 and (session is None or m.session == session)
                 and (not needle or needle in m.name.lower() or needle in m.description.lower())]
        found.sort(key=order, reverse=descending)
        return found[offset:offset + max(0, limit)], len(found)

    def status(self, tenant: str, name: str) -> dict[str, Any]:
        m = self.get(tenant, name)
        wkeys = self.window_keys(m)
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
        children = [c.name for c in self.manifests(tenant) if c.parent == name]
        restorable = self._restorable(wkeys)
        warnings = [f"the {t} tier holds {v['blocks']} of {m.num_blocks} blocks"
                    for t, v in tiers.items() if not v["complete"]]
        return {**m.public(), "last_thaw": self._last_thaw(m),
                "restorable_tokens": restorable * m.block_size,
                "restorable_blocks": restorable, "tiers": tiers, "stored_bytes": stored,
                "raw_bytes": raw, "compression_ratio": round(raw / stored, 3) if stored else None,
                "children": children, "lineage": self.lineage(tenant, m),
                "blocks_expected": m.num_blocks, "blocks_found": restorable,
                "cache_complete": restorable == m.num_blocks, "warnings": warnings,
                "namespace": m.namespace.get("model_fingerprint")}

    def lineage(self, tenant: str, m: Manifest) -> list[str]:
        """The window's ancestors, oldest first (as far as they still exist)."""
        out: list[str] = []
        parent = m.parent
        while parent and parent not in out and len(out) < 64:
            out.insert(0, parent)
            up = self._read(manifest_key(tenant, parent), tenant)
            parent = up.parent if up is not None else None
        return out

    def patch(self, tenant: str, name: str, *, new_name: str | None = None,
              tags: list[str] | None = None, description: str | None = None) -> Manifest:
        """Rename a window and/or replace its tags or description."""
        m = self.get(tenant, name)
        m.auto = False  # edited: the caller's now, never pruned as an auto-checkpoint
        if tags is not None:
            m.tags = check_tags(tags)
        if description is not None:
            m.description = str(description)[:MAX_DESCRIPTION]
        if new_name is None or new_name == name:
            self._rewrite(m)
            return m
        check_name(new_name)
        if self._read(manifest_key(tenant, new_name), tenant) is not None:
            raise AlreadyExists(f"a window named {new_name!r} already exists",
                                hint="choose another name")
        with self._tenant_lock(tenant):
            m = self._move(m, tenant, new_name)  # atomic: one of two renames to one name wins
            for child in self.manifests(tenant):
                if child.parent == name:  # keep the lineage
                    child.parent = new_name
                    self._rewrite(child)
        return m
