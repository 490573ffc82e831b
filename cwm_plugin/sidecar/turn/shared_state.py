"""Session state shared by sidecar replicas through Redis (``sessions.shared_url``).

A session's :class:`~cwm_plugin.sidecar.turn.session.SessionState` decides its prompt's prefix
(the memory pinned to its conversation, its compaction) and when its background work is due.
Kept only in the process, a turn that lands on another replica selects its memory anew and
sends another prefix, so vLLM's prefix cache misses and a window freezes a prompt the session
never sent. With a shared URL each replica, at a turn's start, takes the session's state from
Redis when another replica has moved it on (``pull``: one ``HGETALL``), and puts it back when it
changed (``push``: after planning, awaited, so it is there before the client holds the answer;
after the turn's bookkeeping and after its background work, in the background).

One hash a session, ``cwm:session:<sha256(owner, session)>``: ``v`` (a version bumped by every
write) and ``s`` (the state as JSON, sealed: :class:`Sealer`, so the memory pinned to a
conversation is not readable in Redis without the server secret), expiring ``shared_ttl_s``
after its last write. Writes
are last-writer-wins: two turns of one session at once on two replicas are not ordered (the
client did not order them either). A Redis that is down or slow (``shared_timeout_s``) costs a
turn nothing but the sharing: the replica goes on with its own state, the failure is logged
once and counted (``cwm_sidecar_memory_failures_total{stage="session_state"}``).
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

from cwm_plugin.sidecar.turn.failopen import FailOpen
from cwm_plugin.sidecar.turn.session import Compaction, SessionState, prompt_state

log = logging.getLogger(__name__)
STAGE = "session_state"
COUNTERS = ("turns_recorded", "turns_since_summary", "turns_since_facts", "checkpoints",
            "compaction_due", "calibration", "last_prompt_tokens")
# bump the version and write the state in one step; answer the new version
WRITE = """
local v = redis.call('HINCRBY', KEYS[1], 'v', 1)
redis.call('HSET', KEYS[1], 's', ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
return v
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
    """AES-256-GCM under a key derived from the server secret (every replica holds it), the
    Redis key as associated data: what replicas share in Redis is unreadable without the
    secret, and a value moved to another key does not open."""

    def __init__(self, secret: bytes, purpose: str) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(hmac.new(secret, f"cwm-shared\x00{purpose}".encode(),
                                     hashlib.sha256).digest())

    def seal(self, key: str, data: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._aead.encrypt(nonce, data, key.encode())

    def open(self, key: str, sealed: bytes) -> bytes | None:
        """The data, or None when it does not open (another secret, another key, damage)."""
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(sealed[:12], sealed[12:], key.encode())
        except (InvalidTag, ValueError):
            return None


class SharedSessions:
    """The sessions' shared state in one Redis (see the module docstring)."""

    def __init__(self, url: str, secret: bytes, *, ttl_s: int, timeout_s: float,
                 failopen: FailOpen) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(url, socket_timeout=timeout_s,
                                        socket_connect_timeout=timeout_s)
        self._sealer = Sealer(secret, "sessions")
        self._write = self._redis.register_script(WRITE)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.failopen = failopen

    @staticmethod
    def key(owner: str, session: str) -> str:
        return "cwm:session:" + hashlib.sha256(f"{owner}\x00{session}".encode()).hexdigest()

    async def pull(self, tenant: str, owner: str, session: str, state: SessionState) -> None:
        """Take the session's shared state if another replica moved it on since this one
        last saw it (never raises)."""
        try:
            got = await asyncio.wait_for(self._redis.hgetall(self.key(owner, session)),
                                         self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the replica's own state serves
            self.failopen.failed(tenant, STAGE, exc)
            return
        version = int(got.get(b"v", 0) or 0)
        if version <= state.shared_version or b"s" not in got:
            return
        raw = self._sealer.open(self.key(owner, session), got[b"s"])
        try:
            data = json.loads(raw) if raw is not None else None
        except ValueError:
            data = None
        if isinstance(data, dict):
            apply(state, data)
            state.shared_seen = snapshot(state)
        state.shared_version = version

    async def push(self, tenant: str, owner: str, session: str, state: SessionState) -> None:
        """Write the session's state if it changed since this replica last read or wrote it
        (never raises)."""
        now = snapshot(state)
        if now == state.shared_seen:
            return
        try:
            key = self.key(owner, session)
            sealed = self._sealer.seal(key, json.dumps(now, default=_plain).encode())
            version = await asyncio.wait_for(self._write(keys=[key], args=[sealed, self.ttl_s]),
                                             self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - shared again at the next change
            self.failopen.failed(tenant, STAGE, exc)
            return
        state.shared_seen = now
        state.shared_version = max(state.shared_version, int(version))

    async def aclose(self) -> None:
        await self._redis.aclose()


def _plain(value: Any) -> Any:
    if isinstance(value, Compaction):
        return asdict(value)
    raise TypeError(f"{type(value).__name__} is not shared")
