"""Reading a request body as a JSON object, bounded in size (413) and strictly parsed (400)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from cwm_plugin.errors import InvalidInput
from cwm_plugin.sidecar.openai_errors import BodyTooLarge


async def read_json_body(request: Request, limit: int) -> dict[str, Any]:
    """The body as a dict; never reads more than ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            raise InvalidInput("invalid Content-Length header") from None
        if too_big:
            raise BodyTooLarge(f"request body over {limit} bytes",
                               hint="send less history; the sidecar keeps it in memory")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise BodyTooLarge(f"request body over {limit} bytes")
    try:
        body = json.loads(buf)
    except (ValueError, UnicodeDecodeError):
        raise InvalidInput("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    return body


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidInput("`model` must be a non-empty string")
    return model
