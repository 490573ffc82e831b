"""A tenant's windows as one account: its quota, and its users' windows after a secret
rotation.

:class:`TenantWindows` works over the engine's :class:`~.catalog.WindowCatalog` and holds the
catalog's tenant lock (one re-entrant lock per tenant) for every commit of a window -- a
freeze, a clone or an import (:meth:`TenantWindows.pin_new`) -- so the check of the tenant's
quota and the pin it allows are one step in this process.

* **The quota** (``quota_bytes``) counts the blob bytes of every live window of the tenant
  *and of all its users* (owners ``tenant/u-...``: a user is a name any holder of the
  tenant's key may send, so a per-user count would bound nothing). A window's bytes are what
  the store holds under its keys, measured while its lock is held, just before its pin: never
  a figure from a caller or a file. The tenant's total is a running one
  (:meth:`~.catalog.WindowCatalog.pinned_bytes`: derived from its manifests once, then kept
  by each claim and drop; derived again before a refusal and every
  :data:`~.tenant_state.RESCAN_S`), never a scan of every manifest per commit. By default
  (``auto``) each tenant's quota is its share of the store's pin quota
  (:meth:`~cwm_plugin.store.kv_store.KVStore.pin_quota`, per key group) among the
  deployment's principals, so no tenant can pin what the others need (:func:`tenant_quota`:
  a number is taken as it is, None is no tenant quota). A quota counts a window's blocks of
  every rank and model against a pin quota of one rank and model: the tenants' windows never
  fill a key group's pin quota between them.
* **A secret rotation** renames users: their owner is ``tenant/`` + the user's name under the
  newest secret. :meth:`TenantWindows.adopt` moves the windows a user has under its names from
  older versions (the sidecar calls it once per user in the grace period, ``salt_move.py``):
  the manifests only, the blocks stay under their window salts.

Across processes sharing a store (sidecars on one Redis, ``cwm window --store`` beside a
sidecar) the lock and the running total are this process's: a process sees the windows
another commits when it derives its total again (before a refusal, and at least every
``RESCAN_S``), so the quota can be overshot by what other processes commit in that time;
names stay exclusive (the store's claim is atomic), and an expired window's removal re-reads
the manifest first, so it takes back only a window that is still the expired one (a name
re-claimed by another process between that read and the removal is the one cross-process race
left).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Literal

from cwm_plugin.errors import AlreadyExists, InvalidInput
from cwm_plugin.salts import tenant_of
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.store.tiers.base import QuotaExceeded
from cwm_plugin.windows.catalog import WindowCatalog
from cwm_plugin.windows.model import Manifest
from cwm_plugin.windows.rekey import WindowIncomplete

log = logging.getLogger(__name__)


def tenant_quota(store: KVStore, quota: int | Literal["auto"] | None,
                 principals: int) -> int | None:
    """The blob bytes the windows of one tenant and its users may pin: ``auto``: the store's
    pin quota (:meth:`~cwm_plugin.store.kv_store.KVStore.pin_quota`) divided by
    ``principals`` (the sidecar's tenants plus providers; at least one); a number: that; None:
    no tenant quota (only the store's pin quota bounds a tenant: one may pin it all). Explicit
    quotas that together exceed the pin quota are taken as they are, with a warning."""
    pool = store.pin_quota()
    n = max(1, principals)
    if quota == "auto":
        return None if pool is None else pool // n
    if quota is None or pool is None or quota * n <= pool:
        return quota
    log.warning("windows.tenant_quota_bytes %s for each of %d principals (tenants and "
                "providers) is %s bytes, over the store's pin quota of %s: a tenant's windows "
                "can take pins the others need (auto: %s each)", f"{quota:,}", n,
                f"{quota * n:,}", f"{pool:,}", f"{pool // n:,}")
    return quota


class TenantWindows:
    """The quota and the moves of a tenant's windows (see the module docstring);
    ``quota_bytes``: blob bytes the windows of one tenant and its users may pin, or ``auto``
    (:func:`tenant_quota`); ``principals``: how many tenants and providers share the store."""

    def __init__(self, store: KVStore, catalog: WindowCatalog,
                 quota_bytes: int | Literal["auto"] | None = "auto", principals: int = 1
                 ) -> None:
        self.store = store
        self.catalog = catalog
        self.quota_bytes = tenant_quota(store, quota_bytes, principals)

    def stored_bytes(self, keys: list[list[bytes]]) -> int:
        """The blob bytes the store holds under ``keys`` (the fullest tier's count)."""
        infos = self.store.info_many([k for ks in keys for k in ks])
        return max((sum(i.size or 0 for i in got if i is not None) for got in infos.values()),
                   default=0)

    def tenant_bytes(self, tenant: str) -> int:
        """What the live windows of ``tenant`` and of all its users pin."""
        return self.catalog.pinned_bytes(tenant)

    def check_quota(self, owner: str, more: int) -> None:
        """Refuse ``more`` bytes that would take the tenant of ``owner`` past its quota (its
        running total, derived again from the store before a refusal)."""
        if self.quota_bytes is None:
            return
        tenant = tenant_of(owner)
        with self.catalog.lock(tenant):
            used = self.catalog.pinned_bytes(tenant)
            if used + more > self.quota_bytes:
                used = self.catalog.pinned_bytes(tenant, fresh=True)
        if used + more > self.quota_bytes:
            raise QuotaExceeded(
                f"the windows of tenant {tenant!r} (its users' included) pin {used} bytes; "
                f"this one ({more} bytes) would take them past the tenant's quota of "
                f"{self.quota_bytes}",
                hint="delete windows you no longer need, or give them a TTL")

    def pin_new(self, m: Manifest, wkeys: list[list[bytes]],
                 write: Callable[[], None]) -> None:
        """Put the window's blocks under its keys (``write``: a re-key, or an import's blobs);
        then, holding the tenant's lock, measure what they take, check the tenant's quota,
        pin them on every durable tier and claim the name. Undo all on failure."""
        flat = [k for ks in wkeys for k in ks]
        try:
            write()
            with self.catalog.lock(m.tenant):
                m.stored_bytes = self.stored_bytes(wkeys)
                self.check_quota(m.tenant, m.stored_bytes)
                pinned = self.store.pin_many(flat, ttl_s=self.catalog.ttl(m))
                short = {t.name: len(set(flat)) - len(set(pinned.get(t.name, [])))
                         for t in self.store.pin_tiers()}
                if any(short.values()):
                    # a block evicted between the write and the pin, or a tier down: a thaw
                    # on a server that has only that tier would restore a prefix of the window
                    where = ", ".join(f"{t}: {k}" for t, k in short.items() if k)
                    raise WindowIncomplete(f"{max(short.values())} blocks were evicted while "
                                           f"being pinned ({where})", hint="retry, or re-run "
                                           "the conversation so its blocks are saved again")
                self.catalog.claim(m)
        except BaseException:
            self.store.delete_many(flat)
            raise

    def adopt(self, owner: str, former: Sequence[str]) -> int:
        """Move the windows of the ``former`` owners (the user's names under older versions of
        the secret) to ``owner``; a name ``owner`` has already stays where it was (logged).
        Returns how many moved."""
        moved = 0
        with self.catalog.lock(owner):
            for old in former:
                if old == owner or tenant_of(old) != tenant_of(owner):
                    continue
                for m in self.catalog.manifests(old):
                    try:
                        self.catalog.move(m, owner, m.name)
                        moved += 1
                    except (AlreadyExists, InvalidInput) as exc:
                        log.warning("tenant %s: a window of a user's former name stays there "
                                    "(%s)", tenant_of(owner), exc)
        if moved:
            log.info("tenant %s: %d windows moved to a user's name under the newest secret",
                     tenant_of(owner), moved)
        return moved
