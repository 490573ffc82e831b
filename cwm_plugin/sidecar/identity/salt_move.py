"""A session's KV and a user's windows stay reachable through a secret rotation: they move to
the new salt and the user's new name.

After a rotation (``settings/secret_versions.py``) every session's ``cache_salt`` changes, so
without more its KV would be computed again. With a windows store (``windows:``: the KV store
vLLM's connector writes), a session's first salted request while an older version is in its
grace period derives the salts it may have had under each older version in turn
(``Authenticator.salts_under``: the same derivation under that version, its session name too
when that came from the user; for a user's own session also the salt without the user) and,
for the first that left a context record, re-keys that context under the new salt before the
request is forwarded (:meth:`~cwm_plugin.windows.engine.WindowEngine.move_session`: thaw's
re-keying, the same blobs under new keys, no tensor copy), so vLLM restores the prefix instead
of computing it.

A user's windows belong to ``tenant/`` + the user's name under the newest secret
(:func:`~cwm_plugin.sidecar.identity.authenticator.owner_of`), so after a rotation they are
where the user's name under an older version put them: a user's first request in the grace
period -- a chat turn or a windows route -- moves them to the newest name
(:meth:`~cwm_plugin.windows.engine.WindowEngine.adopt`: the manifests only, under the tenant's
lock) before the request goes on, so the user lists, thaws and counts them as before the
rotation.

Once per salt (and per user for windows): requests arriving meanwhile wait for the same move, and
the salts done are remembered (a digest each, the newest ``REMEMBER``; one forgotten, or a process
restarted, costs one store lookup: a new salt with a context record is not moved again). Counted in
``cwm_sidecar_salt_moves_total{tenant,outcome}`` (moved, none, failed) and logged once. A failure
never fails the request (it computes, as without a store). Once every older version is past its
``until``, nothing is looked up any more. The store work runs on the window threads, within the
tenant's share (``tenant_bounds.py``: a move past its bound fails, and the session's next
request tries again); a request waits ``MOVE_WAIT_S`` at most for its move (it goes on
meanwhile, and the request computes its prefix).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from prometheus_client import Counter

from cwm_plugin.salts import owner_of as owner_name
from cwm_plugin.sidecar.identity.authenticator import Authenticator, Identity, owner_of
from cwm_plugin.sidecar.identity.tenant_bounds import TenantPool
from cwm_plugin.sidecar.settings.secret_versions import SecretVersion, alive
from cwm_plugin.windows.engine import WindowEngine

log = logging.getLogger(__name__)
REMEMBER = 65_536  # salts whose move is done, remembered by digest
MOVE_WAIT_S = 2.0  # a request waits this long for its session's move, then computes its prefix


@dataclass
class SaltMover:
    """Moves sessions' KV from their salts under older secret versions to the newest's, and
    users' windows from their names under older versions to the newest's."""

    engine: WindowEngine
    auth: Authenticator
    older: list[SecretVersion]  # the versions after the newest, newest first
    counter: Counter  # SidecarMetrics.salt_moves
    pool: TenantPool  # the window threads (Sidecar.window_pool)
    _values: list[tuple[SecretVersion, bytes]] = field(init=False, repr=False)
    _running: dict[str, asyncio.Future[int]] = field(default_factory=dict, init=False,
                                                     repr=False)
    _done: OrderedDict[bytes, None] = field(default_factory=OrderedDict, init=False,
                                            repr=False)
    _warned: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self._values = [(v, v.read()) for v in self.older if alive(v)]

    def secrets(self, now: datetime | None = None) -> list[bytes]:
        """The older versions still in their grace period, newest first."""
        return [value for v, value in self._values if alive(v, now)]

    async def before_forward(self, ident: Identity, body: Mapping[str, object],
                             salt: str) -> int:
        """Move the KV of the request's session to ``salt`` (its salt now), and the user's
        windows to its newest name, if this is their first request here in a grace period;
        the blocks moved (0: none, or moved before)."""
        await self.move_windows(ident)
        try:  # the move goes on if the request stops waiting (its next request finds it)
            return await asyncio.wait_for(self._once(
                salt, lambda: self._move(ident, body, salt, self.secrets())), MOVE_WAIT_S)
        except Exception:  # counted and logged by _move; or past MOVE_WAIT_S: computes
            return 0

    async def move_windows(self, ident: Identity) -> int:
        """Move the windows the caller's user has under its names from older secret versions
        to its name now (once per user in a grace period; a failure is logged and tried
        again by the user's next request); how many moved."""
        if ident.user is None:
            return 0
        owner = owner_of(ident)
        former = [owner_name(ident.tenant, self.auth.user_session(ident.tenant, ident.user, s))
                  for s in self.secrets()]
        try:
            return await self._once("windows\0" + owner, lambda: self.pool.run(
                ident.tenant, lambda: self.engine.adopt(owner, former)))
        except Exception as exc:  # the store, say: the request goes on
            log.warning("tenant %s: a user's windows could not move to its name under the "
                        "newest secret (%s); its next request tries again", ident.tenant, exc)
            return 0

    async def _once(self, what: str, work: Callable[[], Awaitable[int]]) -> int:
        """``work()`` the first time ``what`` comes in a grace period; later calls while it
        runs wait for it (0), calls after it are 0 at once."""
        if not self.secrets():
            self._done.clear()
            return 0
        key = hashlib.sha256(what.encode()).digest()[:16]
        if key in self._done:
            return 0
        move = self._running.get(what)
        if move is not None:  # under way: wait for it
            await asyncio.shield(move)
            return 0
        move = self._running[what] = asyncio.ensure_future(work())
        move.add_done_callback(lambda f: self._finished(
            what, key, done=not f.cancelled() and f.exception() is None))
        return await asyncio.shield(move)  # a client gone away leaves it to finish

    def _finished(self, what: str, key: bytes, *, done: bool = True) -> None:
        self._running.pop(what, None)
        if not done:  # failed: the next request tries again
            return
        self._done[key] = None
        if len(self._done) > REMEMBER:
            self._done.popitem(last=False)

    async def _move(self, ident: Identity, body: Mapping[str, object], salt: str,
                    older: list[bytes]) -> int:
        tenant = ident.tenant
        for old in [o for secret in older for o in self.auth.salts_under(secret, ident, body)]:
            if old == salt:
                continue
            try:
                blocks = await self.pool.run(
                    tenant, lambda old=old: self.engine.move_session(old, salt))
            except Exception as exc:  # the store, or the tenant's bound: the request computes
                self.counter.labels(tenant, "failed").inc()
                (log.debug if self._warned else log.warning)(
                    "tenant %s: a session's KV could not move to its new salt after the secret "
                    "rotation (%s); this request computes its prefix and the next tries again "
                    "(later failures: counted in cwm_sidecar_salt_moves_total{outcome=failed})",
                    tenant, exc)
                self._warned = True
                raise  # not done: the session's next request tries again
            if blocks:
                self.counter.labels(tenant, "moved").inc()
                log.info("tenant %s: a session's KV (%d blocks) moved to its new salt after "
                         "the secret rotation", tenant, blocks)
                return blocks
        self.counter.labels(tenant, "none").inc()
        return 0
