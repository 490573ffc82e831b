"""The sidecar's background work: local tasks, and a bounded queue for the model's own work.

Summaries and fact extraction each cost a call to the served model, which competes with the
clients' requests, so they go through one bounded queue (:meth:`Background.submit`) worked by
``workers`` tasks (1 by default): at most ``limit`` jobs wait. A job is keyed by tenant and
session and only says "this session has work due": the job reads, when it runs, everything
its session needs (the turns after the summary's and the facts' last covered turn), so a
second submission while one is waiting is *merged* into it, and a job *dropped* (the
backpressure) loses nothing: the session's turns stay uncovered and its next turn asks
again. A checkpoint is never dropped (``force``: the session is compacted from its summary).
Clients never wait for the queue.

The queue is shared by tenants the way the session tracker is: each tenant is sure of
``share`` waiting jobs (by default ``limit`` // the number of principals) and may use what the
others leave free. When the queue is full, a tenant holding its share or more has its own new
job dropped; one under its share takes the place of the newest waiting job (not a checkpoint)
of the tenant holding the most, which is over its share: however much work one tenant queues,
no other tenant's job within its share is dropped. Workers take the tenants in turn (the
oldest job of the tenant served longest ago), so one tenant's backlog never runs ahead of
another tenant's single job. A tenant's dropped work is logged once (again after one of its
jobs was queued since); a drop never fails a request. Counted in ``cwm_sidecar_background_jobs_total{outcome}``
(queued, merged, dropped, done, failed) and ``cwm_sidecar_background_queue_depth`` (waiting +
running).

Cheap local work (indexing a recorded turn, warming an index) runs as plain tasks
(:meth:`Background.spawn`). ``pending`` counts both, for tests and shutdown.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (memory folder, session)


@dataclass
class Job:
    """A session's due work; ``merge`` folds a later submission into a waiting one."""

    run: Callable[[Job], Awaitable[Any]]
    checkpoint: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def merge(self, later: Job) -> None:
        self.checkpoint = self.checkpoint or later.checkpoint
        self.info.update(later.info)


class Background:
    """Running tasks plus the bounded job queue, ``share`` of it sure for each tenant (None:
    ``limit``, no tenant is sure of any) (see the module docstring)."""

    def __init__(self, limit: int = 64, workers: int = 1, metrics: Any = None,
                 share: int | None = None) -> None:
        self.limit = limit
        self.share = share or limit
        self.workers = workers
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()
        self._waiting: dict[str, OrderedDict[Key, Job]] = {}  # tenant -> jobs, oldest first
        self._size = 0  # jobs waiting
        self._served: dict[str, int] = {}  # tenant (a principal) -> its last turn
        self._turn = 0
        self._quiet: set[str] = set()  # tenants whose dropped work was logged
        self._running = 0
        self._wake: asyncio.Event | None = None
        self._workers: list[asyncio.Task] = []

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def submit(self, tenant: str, key: Key, job: Job, *, force: bool = False) -> str:
        """Queue ``tenant``'s ``job`` for ``key``: "queued", "merged" (one was waiting) or
        "dropped"."""
        mine = self._waiting.get(tenant)
        waiting = mine.get(key) if mine is not None else None
        if waiting is not None:
            waiting.merge(job)
            outcome = "merged"
        elif self._size >= self.limit and not force and not self._make_room(tenant):
            outcome = "dropped"
            self._dropped(tenant)
        else:
            self._waiting.setdefault(tenant, OrderedDict())[key] = job
            self._size += 1
            self._quiet.discard(tenant)
            outcome = "queued"
            self._start_workers()
            assert self._wake is not None
            self._wake.set()
        self._count(outcome)
        return outcome

    def _make_room(self, tenant: str) -> bool:
        """Drop the newest waiting job (not a checkpoint) of the tenant holding the most, if
        ``tenant`` is under its share and that one over it; whether it did."""
        if len(self._waiting.get(tenant, ())) >= self.share:
            return False
        for victim in sorted(self._waiting, key=lambda t: -len(self._waiting[t])):
            jobs = self._waiting[victim]
            if len(jobs) <= self.share:
                return False
            key = next((k for k in reversed(jobs) if not jobs[k].checkpoint), None)
            if key is not None:
                del jobs[key]
                self._size -= 1
                self._count("dropped")
                self._dropped(victim)
                return True
        return False

    def _dropped(self, tenant: str) -> None:
        """Log a tenant's dropped work once (again once one of its jobs was queued since)."""
        if tenant not in self._quiet:
            self._quiet.add(tenant)
            log.warning("background queue full: work due for tenant %s's sessions waits for "
                        "their next turns (counted in cwm_sidecar_background_jobs_total"
                        "{outcome=\"dropped\"})", tenant)

    def _next(self) -> Job:
        """The oldest job of the tenant served longest ago (the tenants take turns)."""
        tenant = min(self._waiting, key=lambda t: self._served.get(t, -1))
        jobs = self._waiting[tenant]
        _, job = jobs.popitem(last=False)
        self._size -= 1
        self._turn += 1
        self._served[tenant] = self._turn
        if not jobs:
            del self._waiting[tenant]
        return job

    def _start_workers(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        self._workers = [w for w in self._workers if not w.done()]
        while len(self._workers) < self.workers:
            self._workers.append(asyncio.get_running_loop().create_task(  # a context of its
                # own: not that of the request that happened to start it (pg_scope: each job
                # sets the one it may use)
                self._work(), name=f"background-worker-{len(self._workers)}",
                context=contextvars.Context()))

    async def _work(self) -> None:
        assert self._wake is not None
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            job = self._next()
            self._running += 1
            self._gauge()
            try:
                await job.run(job)
                self._count("done")
            except asyncio.CancelledError:
                raise
            except Exception:  # a job logs and counts its own failures; this is a last guard
                log.exception("background job failed")
                self._count("failed")
            finally:
                self._running -= 1
                self._gauge()

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.background_jobs.labels(outcome).inc()
        self._gauge()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.background_queue.set(self.depth)

    @property
    def depth(self) -> int:
        """Jobs waiting or running."""
        return self._size + self._running

    @property
    def pending(self) -> int:
        return len(self._tasks) + self.depth

    async def drain(self, timeout: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.pending and loop.time() < deadline:
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=max(0.0, deadline - loop.time()))
            else:
                await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.drain(timeout=5.0)
        for t in [*self._tasks, *self._workers]:
            t.cancel()
