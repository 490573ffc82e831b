"""Bounded background saving: a thread pool, one in-flight save per key, backpressure.

``submit(key, fn)`` runs ``fn()`` on the pool and returns a future; a second submit of a key
whose save is still running gets the same future, unless it replaces the key's content
(``replace=True``): then it runs after the one in flight, so of two context records written
by two requests finishing together the later one is kept. At most ``depth``
submitted saves are pending: the next ``submit`` blocks until one finishes (backpressure on
the caller), or with ``wait`` seconds given raises :class:`QueueFull` after that long (vLLM's
step must not wait for a stuck disk or Redis: the caller drops that save and counts it).

``behind(fn, key=..., nbytes=...)`` queues follow-up work (write-behind to slower tiers) on a
pool of its own, bounded in bytes: at most ``behind_bytes`` of blobs wait there. When it is
full, ``wait=True`` blocks the submitter (a save worker, so backpressure reaches ``submit``'s
callers through the save slots) and ``wait=False`` drops the job and counts it (promotions on
the read path must never block a read). ``wait_key`` waits for a key's save and its
write-behinds; ``flush`` waits for everything.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cwm_plugin.store.threads import unpin

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """``depth`` saves are pending and the caller asked not to wait for a slot."""


class SaveQueue:
    def __init__(self, workers: int, depth: int, *, behind_bytes: int = 256 << 20,
                 name: str = "cwm-store") -> None:
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=unpin)
        self._behind_pool = cf.ThreadPoolExecutor(workers, thread_name_prefix=f"{name}-behind",
                                                  initializer=unpin)
        self.depth = depth
        self._slots = threading.BoundedSemaphore(depth)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._pending: set[cf.Future] = set()
        self._inflight: dict[bytes, cf.Future] = {}
        self._after: dict[bytes, tuple[Callable[[], Any], cf.Future]] = {}  # replace follow-ups
        self._behind_of: dict[bytes, set[cf.Future]] = {}
        self.behind_limit = behind_bytes
        self.behind_bytes = 0          # blob bytes held by queued or running write-behinds
        self.behind_peak = 0
        self.dropped = 0               # write-behinds dropped because the queue was full
        self.closed = False

    def inflight(self, key: bytes) -> cf.Future | None:
        with self._lock:
            return self._inflight.get(key)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def submit(self, key: bytes, fn: Callable[[], Any], *, replace: bool = False,
               wait: float | None = None) -> cf.Future:
        """``fn`` on the pool; while the key's save runs, the same future, or with ``replace``
        (new content for the key: a context record, a window's manifest) a follow-up run
        after it, the newest one only (last writer wins; a replaced follow-up's future
        completes with the one that replaced it). ``wait``: the longest to wait for a slot
        (None: as long as it takes), then :class:`QueueFull`."""
        if self.closed:
            raise RuntimeError("the KV store is closed")
        with self._lock:                            # claim the key atomically
            if key in self._inflight:
                if not replace:
                    return self._inflight[key]
                follow: cf.Future = cf.Future()
                superseded = self._after.get(key)
                self._after[key] = (fn, follow)
                self._pending.add(follow)
                if superseded is not None:
                    follow.add_done_callback(lambda f, old=superseded[1]: self._copy(f, old))
                return follow
            outer: cf.Future = cf.Future()
            self._inflight[key] = outer
            self._pending.add(outer)
        try:
            if not self._slots.acquire(timeout=wait):     # backpressure: blocks at depth
                raise QueueFull(f"{self.depth} saves pending")
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

    def behind(self, fn: Callable[[], Any], *, key: bytes | None = None, nbytes: int = 0,
               wait: bool = True) -> bool:
        """Queue ``fn`` after the current work; False if it was dropped (queue full and
        ``wait`` False)."""
        with self._room:
            while self.behind_bytes and self.behind_bytes + nbytes > self.behind_limit:
                if not wait:
                    self.dropped += 1
                    return False
                self._room.wait()
            self.behind_bytes += nbytes
            self.behind_peak = max(self.behind_peak, self.behind_bytes)
        try:
            fut = self._behind_pool.submit(fn)
        except BaseException:
            self._release(nbytes)
            raise
        with self._lock:
            self._pending.add(fut)
            if key is not None:
                self._behind_of.setdefault(key, set()).add(fut)
        fut.add_done_callback(lambda f: self._behind_done(key, f, nbytes))
        return True

    def _behind_done(self, key: bytes | None, fut: cf.Future, nbytes: int) -> None:
        with self._lock:
            if key is not None:
                futs = self._behind_of.get(key)
                if futs is not None:
                    futs.discard(fut)
                    if not futs:
                        del self._behind_of[key]
        self._finished(None, fut)
        self._release(nbytes)

    def _release(self, nbytes: int) -> None:
        with self._room:
            self.behind_bytes -= nbytes
            self._room.notify_all()

    def wait_key(self, key: bytes, timeout: float | None = None) -> None:
        """Wait until ``key``'s save and its write-behinds are done (their errors are the
        save's business: counted and logged there, not raised here)."""
        fut = self.inflight(key)
        if fut is not None:
            cf.wait([fut], timeout=timeout)
        with self._lock:
            behind = list(self._behind_of.get(key, ()))
        if behind:
            cf.wait(behind, timeout=timeout)

    def _chain(self, key: bytes, inner: cf.Future, outer: cf.Future) -> None:
        with self._lock:
            after = self._after.pop(key, None)
            if after is not None:
                self._inflight[key] = after[1]  # (waiters on the key see the follow-up)
        if after is None:
            self._slots.release()               # else the follow-up runs in this slot
        self._finished(key, outer)
        self._copy(inner, outer)
        if after is not None:
            fn, follow = after
            try:
                nxt = self._pool.submit(fn)
            except BaseException as exc:            # (shut down meanwhile)
                self._slots.release()
                self._finished(key, follow)
                follow.set_exception(exc)
                return
            nxt.add_done_callback(lambda f: self._chain(key, f, follow))

    def _copy(self, done: cf.Future, to: cf.Future) -> None:
        """``to`` completes as ``done`` did."""
        self._finished(None, to)
        if done.cancelled():                        # dropped by shutdown(drop_queued=True)
            to.cancel()
        elif done.exception() is not None:
            to.set_exception(done.exception())
        else:
            to.set_result(done.result())

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

    def shutdown(self, *, drop_queued: bool = False) -> None:
        """Stop taking work and wait for the writes running now; with ``drop_queued`` the ones
        not started yet are cancelled (their futures say so) instead of run."""
        self.closed = True
        self._pool.shutdown(wait=True, cancel_futures=drop_queued)
        self._behind_pool.shutdown(wait=True, cancel_futures=drop_queued)
