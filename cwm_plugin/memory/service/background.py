"""Work a request found due but need not wait for: one thread, at most one job a folder queued.

A selection that finds a folder's look for other writers due (``folders.py``) queues it here
and goes on with the index it has; the next selection sees what the look found.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cwm_plugin import pg_scope

log = logging.getLogger(__name__)


class FolderJobs:
    """``soon(folder, job)`` runs ``job(folder)`` on a background thread, unless a job of
    that folder is queued or running already; ``idle()`` waits until nothing is; ``close()``
    waits for what is queued and takes no more."""

    def __init__(self, name: str = "cwm-memory-sync") -> None:
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._queued: set[str] = set()
        self._guard = threading.Condition()
        self._closed = False

    def soon(self, folder: str, job: Callable[[str], None]) -> bool:
        """Queue ``job(folder)``; False when one is queued already or this is closed."""
        with self._guard:
            if self._closed or folder in self._queued:
                return False
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix=self._name)
            self._queued.add(folder)
            self._pool.submit(pg_scope.carried(lambda: self._run(folder, job)))  # its scope
        return True

    def _run(self, folder: str, job: Callable[[str], None]) -> None:
        try:
            job(folder)
        except Exception:  # noqa: BLE001 - a background job must not kill the thread
            log.exception("background job for folder %s failed", folder)
        finally:
            with self._guard:
                self._queued.discard(folder)
                self._guard.notify_all()

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or running; False if ``timeout`` passed first."""
        with self._guard:
            return self._guard.wait_for(lambda: not self._queued, timeout)

    def close(self) -> None:
        with self._guard:
            self._closed, pool = True, self._pool
        if pool is not None:
            pool.shutdown(wait=True)
