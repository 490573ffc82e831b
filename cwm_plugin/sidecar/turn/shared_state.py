"""Session state shared by sidecar replicas through Redis (``sessions.shared_url``).

A session's :class:`~cwm_plugin.sidecar.turn.session.SessionState` decides its prompt's prefix
(the memory pinned to its conversation, its compaction) and when its background work is due.
Kept only in the process, a turn that lands on another replica selects its memory anew and
sends another prefix, so vLLM's prefix cache misses and a window freezes a prompt the session
never sent. With a shared URL each replica, at a turn's start, takes the session's state from
Redis when another replica has moved it on (``pull``: one ``HGETALL``), and puts it back when it
changed (``push``: after planning, awaited, so it is there before the client holds the answer;
after the turn's bookkeeping and after its background work, in the background).

One hash a session, ``cwm:session:<HMAC(owner, session)>``: ``v`` (a version bumped by every
write) and ``s`` (the state as JSON, sealed with its version: :class:`Sealer`, so the memory
pinned to a conversation is neither readable nor replayable in Redis without the server
secret), expiring ``shared_ttl_s`` after its last write. A write goes over the version its
replica read, else it is dropped (two turns of one session at once on two replicas: the first
write stands, the other replica reads it next turn), and a replica whose read failed does not
write (its own state may be older than Redis's). A Redis that is down or slow
(``shared_timeout_s``) costs a turn nothing but the sharing: the replica goes on with its own
state, the failure is logged once and counted
(``cwm_sidecar_memory_failures_total{stage="session_state"}``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
from dataclasses import asdict
from typing import Any

from cwm_plugin.sidecar.shared_redis import client_of
from cwm_plugin.sidecar.turn.failopen import FailOpen
from cwm_plugin.sidecar.turn.session import Compaction, SessionState, prompt_state

log = logging.getLogger(__name__)
STAGE = "session_state"
COUNTERS = ("turns_recorded", "turns_since_summary", "turns_since_facts", "checkpoints",
            "compaction_due", "calibration", "last_prompt_tokens")
# write the state over the version the writer read (ARGV[3]) and bump it, in one step; -1
# when another replica wrote since
WRITE = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
if cur ~= tonumber(ARGV[3]) then return -1 end
redis.call('HSET', KEYS[1], 'v', cur + 1, 's', ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
return cur + 1
"""


def snapshot(state: SessionState) -> dict[str, Any]:
    """What replicas share of a session's state (the prompt state and the counters)."""
    return {"prompt": prompt_state(state.pinned, state.compaction),
            **{name: getattr(state, name) for name in COUNTERS}}


def apply(state: SessionState, got: dict[str, Any]) -> None:
    """Take over a shared state (a malformed one changes nothing)."""
    try:
        counters = {name: type(getattr(state, name))(got[name]) for name in COUNTERS}
        prompt = got.get("prompt") or {}
        if not isinstance(prompt, dict):
            raise TypeError("prompt")
    except (KeyError, TypeError, ValueError):
        log.warning("a shared session state could not be read; this replica keeps its own")
        return
    restored = state.restored
    state.adopt(prompt)  # the pinned memory and the compaction (None where it has none)
    state.restored = restored or bool(prompt)
    for name, value in counters.items():
        setattr(state, name, value)


class Sealer:
    """What replicas keep in Redis, unreadable and unforgeable without the server secret: values
    sealed with AES-256-GCM under a key derived from the newest secret (any version still in
    its grace opens them, so a rotation loses nothing), the caller's associated data bound in
    (a value moved to another key, or replayed under another version, does not open); key
    names keyed by HMAC (whoever reads Redis cannot test for a tenant's session)."""

    def __init__(self, secrets: list[bytes] | bytes, purpose: str) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        versions = [secrets] if isinstance(secrets, bytes) else list(secrets)
        self._aeads = [AESGCM(hmac.new(s, f"cwm-shared\x00{purpose}".encode(),
                                       hashlib.sha256).digest()) for s in versions]
        self._namer = hmac.new(versions[0], f"cwm-shared-name\x00{purpose}".encode(),
                               hashlib.sha256).digest()

    def name(self, *parts: str) -> str:
        return hmac.new(self._namer, "\x00".join(parts).encode(), hashlib.sha256).hexdigest()[:40]

    def seal(self, aad: str, data: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._aeads[0].encrypt(nonce, data, aad.encode())

    def open(self, aad: str, sealed: bytes) -> bytes | None:
        """The data, or None when it does not open (another secret, key or version; damage)."""
        from cryptography.exceptions import InvalidTag

        for aead in self._aeads:
            try:
                return aead.decrypt(sealed[:12], sealed[12:], aad.encode())
            except (InvalidTag, ValueError):
                continue
        return None


class SharedSessions:
    """The sessions' shared state in one Redis (see the module docstring)."""

    def __init__(self, redis: Any, secrets: list[bytes] | bytes, *, ttl_s: int,
                 timeout_s: float, failopen: FailOpen) -> None:
        self._redis, self._owned = client_of(redis, timeout_s)
        self._sealer = Sealer(secrets, "sessions")
        self._write = self._redis.register_script(WRITE)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.failopen = failopen

    def key(self, owner: str, session: str) -> str:
        return "cwm:session:" + self._sealer.name(owner, session)

    async def pull(self, tenant: str, owner: str, session: str, state: SessionState) -> None:
        """Take the session's shared state if another replica moved it on since this one
        last saw it (never raises). A pull that fails leaves the replica's own state, which
        this turn then does not write back (``state.shared_pulled``): it may be older."""
        key = self.key(owner, session)
        try:
            got = await asyncio.wait_for(self._redis.hgetall(key), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the replica's own state serves
            state.shared_pulled = False
            self.failopen.failed(tenant, STAGE, exc)
            return
        state.shared_pulled = True
        version = int(got.get(b"v", 0) or 0)
        if version < state.shared_version:  # Redis lost it (flushed, restarted): start over
            state.shared_version, state.shared_seen = version, None
        if version <= state.shared_version or b"s" not in got:
            return
        raw = self._sealer.open(f"{key}\x00{version}", got[b"s"])
        try:
            data = json.loads(raw) if raw is not None else None
        except ValueError:
            data = None
        if isinstance(data, dict):
            apply(state, data)
            state.shared_seen = snapshot(state)
        state.shared_version = version

    async def push(self, tenant: str, owner: str, session: str, state: SessionState) -> None:
        """Write the session's state if it changed since this replica last read or wrote it,
        and only over the version it read (another replica's newer write wins; never
        raises)."""
        now = snapshot(state)
        if now == state.shared_seen or not state.shared_pulled:
            return
        key = self.key(owner, session)
        nxt = state.shared_version + 1
        try:
            sealed = self._sealer.seal(f"{key}\x00{nxt}",
                                       json.dumps(now, default=_plain).encode())
            version = int(await asyncio.wait_for(self._write(
                keys=[key], args=[sealed, self.ttl_s, state.shared_version]), self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - shared again at the next change
            self.failopen.failed(tenant, STAGE, exc)
            return
        if version < 0:  # another replica wrote first: its state stands, read next turn
            return
        state.shared_seen = now
        state.shared_version = version

    async def aclose(self) -> None:
        if self._owned:
            await self._redis.aclose()


def _plain(value: Any) -> Any:
    if isinstance(value, Compaction):
        return asdict(value)
    raise TypeError(f"{type(value).__name__} is not shared")
