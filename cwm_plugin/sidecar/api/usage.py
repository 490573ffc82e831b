"""``GET /v1/usage``: the calling tenant's own usage (``?model=`` narrows it); a request acting
for a user gets that user's rows. The ledger itself: :mod:`cwm_plugin.sidecar.usage`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from cwm_plugin.sidecar.identity.authenticator import owner_of
from cwm_plugin.sidecar.identity.caller import identity_of


def usage_router(sidecar: Any) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/usage")
    async def usage(request: Request, model: str | None = None) -> dict[str, Any]:
        ident = identity_of(request)
        return await sidecar.usage.shared_report(
            ident.tenant, model, owner_of(ident) if ident.user is not None else None)

    return router
