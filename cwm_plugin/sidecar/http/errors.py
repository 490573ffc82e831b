"""OpenAI-shaped errors: ``{"error": {"message", "type", "code", "param"}}`` with an HTTP status.

Every failure the sidecar answers goes through here, from :class:`cwm_plugin.errors.CWMError`
or from an upstream reply, so clients see one shape whatever went wrong.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from cwm_plugin.errors import CWMError

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "upstream_error",
    504: "upstream_error",
}


class BodyTooLarge(CWMError):
    code = "request_too_large"
    http_status = 413


class ModelNotFound(CWMError):
    code = "model_not_found"
    http_status = 404


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"),
                      "code": code, "param": param}}


def error_response(status: int, message: str, code: str, *,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status, headers=headers)


def from_cwm_error(exc: CWMError) -> JSONResponse:
    """The error's status and message, with the headers it carries (``Retry-After``)."""
    return error_response(exc.http_status, str(exc), exc.code,
                          headers=getattr(exc, "headers", None))


def sse_error(status: int, message: str, code: str) -> bytes:
    """An error as one SSE event, for failures after a stream has started."""
    return f"data: {json.dumps(error_body(status, message, code))}\n\n".encode()


def upstream_error_response(status: int, content: bytes,
                            headers: dict[str, str] | None = None) -> JSONResponse:
    """Relay an upstream error: keep an OpenAI-shaped body as it is, wrap anything else;
    ``headers`` (``Retry-After``, ``x-request-id``) go back with it."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    out_status = 502 if status >= 500 else status
    message = None
    if isinstance(body, dict):
        inner = body.get("error") if isinstance(body.get("error"), dict) else body
        message = inner.get("message") if isinstance(inner.get("message"), str) else None
        if message is not None and status < 500 and "error" in body \
                and isinstance(inner.get("type"), str):
            return JSONResponse(body, status_code=status, headers=headers)  # OpenAI-shaped
    if message is None:
        message = content[:300].decode(errors="replace") if content else f"HTTP {status}"
    code = "upstream_error" if status >= 500 else "upstream_rejected"
    return error_response(out_status, f"upstream (HTTP {status}): {message}", code,
                          headers=headers)
