"""The sidecar's background work: local tasks, and a bounded queue for the model's own work.

Summaries and fact extraction each cost a call to the served model, which competes with the
clients' requests, so they go through one bounded queue (:meth:`Background.submit`) worked by
``workers`` tasks (1 by default): at most ``limit`` jobs wait. A job is keyed by tenant and
session and only says "this session has work due": the job reads, when it runs, everything
its session needs (the turns after the summary's and the facts' last covered turn), so a
second submission while one is waiting is *merged* into it, and a submission refused because
the queue is full (*dropped*: the backpressure) loses nothing: the session's turns stay
uncovered and its next turn asks again. A checkpoint is never dropped (``force``: the
session is compacted from its summary). Clients never wait for the queue. Counted in
``cwm_sidecar_background_jobs_total{outcome}`` (queued, merged, dropped, done, failed) and
``cwm_sidecar_background_queue_depth`` (waiting + running).

Cheap local work (indexing a recorded turn, warming an index) runs as plain tasks
(:meth:`Background.spawn`). ``pending`` counts both, for tests and shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


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
    """Running tasks plus the bounded job queue (see the module docstring)."""

    def __init__(self, limit: int = 64, workers: int = 1, metrics: Any = None) -> None:
        self.limit = limit
        self.workers = workers
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()
        self._waiting: OrderedDict[tuple[str, str], Job] = OrderedDict()
        self._running = 0
        self._wake: asyncio.Event | None = None
        self._workers: list[asyncio.Task] = []

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def submit(self, key: tuple[str, str], job: Job, *, force: bool = False) -> str:
        """Queue ``job`` for ``key``: "queued", "merged" (one was waiting) or "dropped"."""
        waiting = self._waiting.get(key)
        if waiting is not None:
            waiting.merge(job)
            outcome = "merged"
        elif len(self._waiting) >= self.limit and not force:
            outcome = "dropped"
        else:
            self._waiting[key] = job
            outcome = "queued"
            self._start_workers()
            assert self._wake is not None
            self._wake.set()
        self._count(outcome)
        return outcome

    def _start_workers(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        self._workers = [w for w in self._workers if not w.done()]
        while len(self._workers) < self.workers:
            self._workers.append(asyncio.get_running_loop().create_task(
                self._work(), name=f"background-worker-{len(self._workers)}"))

    async def _work(self) -> None:
        assert self._wake is not None
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            _, job = self._waiting.popitem(last=False)
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
        return len(self._waiting) + self._running

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
