"""Exporting and importing windows over HTTP (:mod:`cwm_plugin.windows.portable`).

``GET /v1/windows/{name}/export`` answers the window's export file (``application/octet-stream``);
``POST /v1/windows/import[?name=]`` takes one as the raw body, at most ``windows.max_import_bytes``
(413 past it), received within ``windows.import_timeout_s`` of its start (408 past it, the
connection closed; the server's body pace, ``server.body_min_rate``, cuts a slower one sooner) and
spooled to a temporary file once it is over ``windows.import_spool_bytes`` (below that it stays in
memory). At most ``windows.imports_per_tenant`` of a tenant's are under way, else 429 at once
(``identity/tenant_bounds.py``); the bound is the tenant's only, so one tenant's imports never
refuse another's, and the memory imports hold is at most principals x ``imports_per_tenant`` x
``import_spool_bytes``. A file is checked whole before anything is written (a damaged, forged or unsigned file -- with
``windows.export_key`` the server signs its exports and takes only files signed under it -- or one
for another model is a 400 ``bad_window_file`` and the store is unchanged). Both authenticate before
reading or writing a byte, and need read (export) or write (import) access to the caller's home
namespace; windows are the caller's (its tenant's, or its user's).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from cwm_plugin.sidecar.api.schema import body_doc
from cwm_plugin.sidecar.http.body import body_chunks
from cwm_plugin.sidecar.identity.authenticator import Identity, owner_of
from cwm_plugin.sidecar.identity.tenant_bounds import TenantBound
from cwm_plugin.sidecar.server_limits import ClientTooSlow
from cwm_plugin.windows.model import check_window_name
from cwm_plugin.windows.portable import export_window, import_window
from cwm_plugin.windows.settings import WindowsSettings

CHUNK = 1 << 20
SPOOL = 8 << 20  # an export smaller than this stays in memory


def windows_files_router(sidecar: Any, run: Callable[..., Any],
                         caller: Callable[[Request, str], Identity]) -> APIRouter:
    """The two routes; ``run(ident, fn)`` runs ``fn(engine)`` in a thread, within the
    caller's tenant's share (503 without windows),
    ``caller(request, op)`` authenticates and checks access (windows.py)."""
    router = APIRouter()  # included by the windows router, under its /v1
    limit = sidecar.settings.body_limit("/v1/windows/import")
    w = sidecar.settings.windows or WindowsSettings()
    imports = TenantBound("window_imports", "window imports", w.imports_per_tenant, 0,
                          sidecar.metrics.rate_limited)

    @router.get("/windows/{name}/export")
    async def export(name: str, request: Request) -> StreamingResponse:
        ident = caller(request, "read")
        check_window_name(name)
        spool = tempfile.SpooledTemporaryFile(max_size=SPOOL)  # noqa: SIM115 - closed below
        try:
            summary = await run(ident, lambda e: export_window(e, owner_of(ident), name, spool))
        except BaseException:
            spool.close()
            raise
        spool.seek(0)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while data := await asyncio.to_thread(spool.read, CHUNK):
                    yield data
            finally:
                spool.close()

        return StreamingResponse(chunks(), media_type="application/octet-stream", headers={
            "Content-Disposition": f'attachment; filename="{name}.cwmw"',
            "Content-Length": str(summary["bytes"])})

    @router.post("/windows/import", openapi_extra=body_doc(binary=True))
    async def import_(request: Request, name: str | None = None) -> dict[str, Any]:
        ident = caller(request, "write")
        if name is not None:
            check_window_name(name)
        async with imports.hold(ident.tenant):
            with tempfile.SpooledTemporaryFile(max_size=w.import_spool_bytes) as spool:
                try:
                    async with asyncio.timeout(w.import_timeout_s):
                        async for chunk in body_chunks(request, limit,
                                                       "raise windows.max_import_bytes"):
                            await asyncio.to_thread(spool.write, chunk)
                except TimeoutError:
                    raise ClientTooSlow(
                        f"the window file did not arrive within {w.import_timeout_s:g} s",
                        hint="send it faster, or ask the operator for a higher "
                             "windows.import_timeout_s") from None
                spool.seek(0)
                m = await run(ident, lambda e: import_window(e, owner_of(ident), spool, name))
        return {"object": "window", **m.public()}

    return router
