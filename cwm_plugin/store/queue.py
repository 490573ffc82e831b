"""Bounded background saving: a thread pool, one in-flight save per key, backpressure.

``submit(key, fn)`` runs ``fn()`` on the pool and returns a future; a second submit of a key
whose save is still running gets the same future. At most ``depth`` submitted saves are pending:
the next ``submit`` blocks until one finishes (backpressure on the caller). ``behind(fn)``
queues follow-up work (write-behind to slower tiers) that does not hold a slot; ``flush`` waits
for everything.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class SaveQueue:
    def __init__(self, workers: int, depth: int, *, name: str = "cwm-store") -> None:
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._slots = threading.BoundedSemaphore(depth)
        self._lock = threading.Lock()
        self._pending: set[cf.Future] = set()
        self._inflight: dict[bytes, cf.Future] = {}
        self.closed = False

    def inflight(self, key: bytes) -> cf.Future | None:
        with self._lock:
            return self._inflight.get(key)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def submit(self, key: bytes, fn: Callable[[], Any]) -> cf.Future:
        if self.closed:
            raise RuntimeError("the KV store is closed")
        with self._lock:                            # claim the key atomically
            if key in self._inflight:
                return self._inflight[key]
            outer: cf.Future = cf.Future()
            self._inflight[key] = outer
            self._pending.add(outer)
        try:
            self._slots.acquire()                   # backpressure: blocks at depth
            try:
                inner = self._pool.submit(fn)
            except BaseException:
                self._slots.release()
                raise
        except BaseException as exc:
            self._finished(key, outer)
            outer.set_exception(exc)
            raise
        inner.add_done_callback(lambda f: self._chain(key, f, outer))
        return outer

    def behind(self, fn: Callable[..., Any], *args: Any) -> None:
        fut = self._pool.submit(fn, *args)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(lambda f: self._finished(None, f))

    def _chain(self, key: bytes, inner: cf.Future, outer: cf.Future) -> None:
        self._slots.release()
        self._finished(key, outer)
        exc = inner.exception()
        if exc is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(inner.result())

    def _finished(self, key: bytes | None, fut: cf.Future) -> None:
        with self._lock:
            self._pending.discard(fut)
            if key is not None and self._inflight.get(key) is fut:
                del self._inflight[key]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for all pending work; False if some is still running after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return True
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            _, not_done = cf.wait(pending, timeout=left)
            if not_done and deadline is not None and time.monotonic() >= deadline:
                log.warning("store flush: %d writes still pending after %.1fs",
                            len(not_done), timeout)
                return False

    def shutdown(self) -> None:
        self.closed = True
        self._pool.shutdown(wait=True)
