"""Where window operations run: worker threads, at most a share of them per tenant.

The window engine is blocking (store I/O; a freeze may wait for a turn's record or for a
durable tier), so its operations run on threads of their own, never on the event loop and
never on the threads chat's turns plan on. Each tenant has its own bound
(``windows.tenant_threads`` operations at once): the ones past it wait in the event loop,
holding no thread, behind that tenant's own operations only. The pool has room for every
tenant's share at once (threads are started as they are needed), so no tenant's window routes
ever queue behind another's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class TenantPool:
    def __init__(self, tenants: int, share: int) -> None:
        """``tenants``: how many principals there are; ``share``: one's operations at once."""
        self.share = share
        self._pool = ThreadPoolExecutor(max(1, tenants) * share,
                                        thread_name_prefix="cwm-windows")
        self._bounds: dict[str, asyncio.Semaphore] = {}

    async def run(self, tenant: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on a thread, within ``tenant``'s share."""
        bound = self._bounds.setdefault(tenant, asyncio.Semaphore(self.share))
        async with bound:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
