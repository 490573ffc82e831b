"""Background jobs that outlive their replica: recorded in Redis, claimed once across
replicas, claimed again when the replica running one dies (``sessions.shared_url``).

A session's due work (summary, facts, checkpoint: ``maintainer.py``) is queued on the replica
whose turn made it due (``queue.py``) and, with a shared URL, also *recorded* in Redis: one
entry a session (``cwm:jobs:*``, the session's owner and name hashed), sealed with the server
secret (it names the session's salt). The entry's place in a sorted set says when another
replica may take it:

- a new entry is the recording replica's alone for ``grace_s``;
- a replica about to run the job *claims* it (one Lua step: nobody else holds a live claim),
  which makes it its own for ``lease_s``, renewed every third of that while the job runs;
  a replica that finds it claimed by another skips it (that one is on it);
- done, the entry is removed, unless a turn recorded more work meanwhile (its generation
  moved): then the claim is let go and the entry is due again at once;
- every replica *sweeps* for entries whose grace or lease has passed (a replica that died
  before or while running its job) and queues them locally, so the work is done once by some
  replica, never lost with one. A job killed mid-way is run again from the session's cursors
  (the summary's and the facts' last covered turn), so it redoes at most the batch it was in,
  and a fact extracted twice is merged as a duplicate (``memory/service/facts_file.py``).

Redis that is down or slow never stops the work: the replica runs its own jobs unclaimed
(logged once, counted as ``stage="session_state"``), which at worst runs a job on two replicas.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from cwm_plugin.sidecar.shared_redis import client_of
from cwm_plugin.sidecar.turn.failopen import FailOpen
from cwm_plugin.sidecar.turn.shared_state import STAGE, Sealer

log = logging.getLogger(__name__)
INFO, DUE, CLAIM, GEN, CHECKPOINT = ("cwm:jobs:info", "cwm:jobs:due", "cwm:jobs:claim",
                                     "cwm:jobs:gen", "cwm:jobs:checkpoint")
SHARED = ("tenant", "folder", "session", "model", "salt", "max_model_len", "owner",
          "checkpoint")  # what another replica needs to run a session's job

RECORD = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if ARGV[4] == '1' then redis.call('HSET', KEYS[5], ARGV[1], 1) end
local gen = redis.call('HINCRBY', KEYS[4], ARGV[1], 1)
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
end
return gen
"""
CLAIM_JOB = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return {-1, 0} end
local holder = redis.call('HGET', KEYS[3], ARGV[1])
local due = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]) or '0')
if holder and holder ~= ARGV[2] and due > tonumber(ARGV[3]) then return {-2, 0} end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
return {tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0'),
        redis.call('HEXISTS', KEYS[5], ARGV[1])}
"""
RENEW = """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
"""
DONE = """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[3], ARGV[1])
if tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0') == tonumber(ARGV[3]) then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[5], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 1
end
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
return 2
"""


@dataclass
class Claim:
    job_id: str
    token: str
    generation: int
    checkpoint: bool  # a checkpoint was recorded for it (by any replica): it runs one


class SharedJobs:
    """The replicas' shared record of due background work (see the module docstring)."""

    def __init__(self, redis: Any, secrets: list[bytes] | bytes, *, failopen: FailOpen,
                 lease_s: float = 30.0,
                 grace_s: float = 5.0, timeout_s: float = 0.25) -> None:
        self._redis, self._owned = client_of(redis, timeout_s)
        self._sealer = Sealer(secrets, "jobs")
        self._scripts = {name: self._redis.register_script(src) for name, src in
                         (("record", RECORD), ("claim", CLAIM_JOB), ("renew", RENEW),
                          ("done", DONE))}
        self.failopen = failopen
        self.lease_s = lease_s
        self.grace_s = grace_s
        self.timeout_s = timeout_s
        self._sweeper: asyncio.Task | None = None

    async def _run(self, name: str, *args: Any) -> Any:
        return await asyncio.wait_for(
            self._scripts[name](keys=[INFO, DUE, CLAIM, GEN, CHECKPOINT], args=list(args)),
            self.timeout_s)

    async def record(self, info: dict[str, Any]) -> str | None:
        """Record a session's due work (``info``: :data:`SHARED` and more); its id, or None
        when Redis could not take it (the job then runs here, unclaimed)."""
        jid = self._sealer.name(str(info["owner"]), str(info["session"]))
        data = json.dumps({k: info.get(k) for k in SHARED}).encode()
        try:
            await self._run("record", jid, self._sealer.seal(jid, data),
                            time.time() + self.grace_s, "1" if info.get("checkpoint") else "0")
        except Exception as exc:  # noqa: BLE001 - the job runs here all the same
            self.failopen.failed(str(info.get("tenant")), STAGE, exc)
            return None
        return jid

    async def claim(self, tenant: str, jid: str) -> Claim | bool:
        """Make the job this replica's: a :class:`Claim`, False when another replica holds it
        or it is done already (skip it), True when Redis cannot say (run it unclaimed)."""
        token = secrets.token_hex(8)
        now = time.time()
        try:
            gen, checkpoint = await self._run("claim", jid, token, now, now + self.lease_s)
        except Exception as exc:  # noqa: BLE001
            self.failopen.failed(tenant, STAGE, exc)
            return True
        return False if int(gen) < 0 else Claim(jid, token, int(gen), bool(int(checkpoint)))

    async def hold(self, tenant: str, claim: Claim, work: Awaitable[Any]) -> None:
        """Run ``work`` under ``claim``, renewing it every third of the lease; then the entry
        is done (or due again, when more work was recorded meanwhile)."""
        renewing = asyncio.get_running_loop().create_task(self._renew(claim))
        try:
            await work
        finally:
            renewing.cancel()
        try:
            await self._run("done", claim.job_id, claim.token, claim.generation, time.time())
        except Exception as exc:  # noqa: BLE001 - the lease ends, a sweep runs it again
            self.failopen.failed(tenant, STAGE, exc)

    async def _renew(self, claim: Claim) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self._run("renew", claim.job_id, claim.token, time.time() + self.lease_s)
            except Exception as exc:  # noqa: BLE001 - tried again a third of a lease later
                log.debug("renewing the claim of a background job failed: %s", exc)

    async def due(self, limit: int = 32) -> list[tuple[str, dict[str, Any]]]:
        """Entries whose grace or lease has passed: ``(id, info)``, oldest first."""
        ids = await asyncio.wait_for(self._redis.zrangebyscore(
            DUE, "-inf", time.time(), start=0, num=limit), self.timeout_s)
        if not ids:
            return []
        blobs = await asyncio.wait_for(self._redis.hmget(INFO, ids), self.timeout_s)
        out, unreadable = [], []
        for raw_id, blob in zip(ids, blobs, strict=True):
            jid = raw_id.decode()
            data = self._sealer.open(jid, blob) if blob is not None else None
            if data is None:  # sealed under a secret no longer in its grace, or damaged
                unreadable.append(jid)
            else:
                out.append((jid, json.loads(data)))
        if unreadable:  # never left to hold the head of the queue
            log.warning("%d shared background jobs could not be opened (another server secret, "
                        "or damaged): dropped; their sessions' next turns ask again",
                        len(unreadable))
            pipe = self._redis.pipeline(transaction=False)
            for key in (INFO, CLAIM, GEN, CHECKPOINT):
                pipe.hdel(key, *unreadable)
            pipe.zrem(DUE, *unreadable)
            await asyncio.wait_for(pipe.execute(), self.timeout_s)
        return out

    def stop_sweeping(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def sweep(self, submit: Callable[[str, dict[str, Any]], None], every_s: float) -> None:
        """Start sweeping every ``every_s``: ``submit(id, info)`` queues a job found due."""
        async def loop() -> None:
            while True:
                await asyncio.sleep(every_s)
                try:
                    for jid, info in await self.due():
                        submit(jid, info)
                except Exception as exc:  # noqa: BLE001 - the next sweep tries again
                    log.debug("sweeping the shared background jobs failed: %s", exc)

        self._sweeper = asyncio.get_running_loop().create_task(loop(), name="cwm-job-sweeper")

    async def aclose(self) -> None:
        self.stop_sweeping()
        if self._owned:
            await self._redis.aclose()
