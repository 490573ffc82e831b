"""Reading a request body as a JSON object: bounded in size (413), strictly parsed and bounded
in nesting depth (400: a deeply nested body would otherwise exhaust Python's recursion while
being parsed or re-encoded for the upstream)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from cwm_plugin.errors import InvalidInput
from cwm_plugin.sidecar.http.errors import BodyTooLarge

LIMIT_HINT = "send less; the operator sets the limit per route (max_body_bytes, " \
             "max_body_bytes_by_route)"


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; never reads more than ``limit`` bytes (its declared ``Content-Length`` was
    checked when the caller was authenticated: ``identity/caller.py``)."""
    buf = bytearray()
    async for chunk in body_chunks(request, limit):
        buf += chunk
    return bytes(buf)


async def body_chunks(request: Request, limit: int, hint: str | None = None
                      ) -> AsyncIterator[bytes]:
    """The body as it comes in, chunk by chunk; :class:`BodyTooLarge` (``hint``) as soon as it
    is over ``limit`` bytes (a chunked body declares no size)."""
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body over {limit} bytes",
                               hint=hint or LIMIT_HINT)
        yield chunk


def too_deep(obj: Any, max_depth: int) -> bool:
    """Whether ``obj`` nests lists/dicts deeper than ``max_depth`` (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))
    return False


def parse_json_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:  # deeper than Python's parser goes
        raise InvalidInput(f"the request body is nested deeper than {max_depth} levels") \
            from None
    except (ValueError, UnicodeDecodeError):
        raise InvalidInput("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    if too_deep(body, max_depth):
        raise InvalidInput(f"the request body is nested deeper than {max_depth} levels")
    return body


async def read_json_body(request: Request, limit: int, max_depth: int = 64) -> dict[str, Any]:
    """The body as a dict (see the module docstring)."""
    return parse_json_object(await read_body(request, limit), max_depth)


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidInput("`model` must be a non-empty string")
    return model
