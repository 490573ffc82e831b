"""The sidecar's OpenAPI description (``GET /openapi.json``, authenticated like every route).

Routes read their bodies themselves, after authenticating (``identity/caller.py``), so FastAPI does
not see them: each declares its request body here (:func:`body_doc`: a pydantic model's schema, or a
raw file's), and every route the error shape it may answer (:data:`ERRORS`: OpenAI's
``{"error": {...}}`` for each status the sidecar sends). The relayed OpenAI routes are described by
the fields the sidecar itself reads or a client commonly sends (vLLM judges the rest; a body may
carry more). :func:`openapi` moves the nested models' definitions under ``components/schemas`` so
the document is one valid OpenAPI 3.1 file.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | int | None = None
    param: str | None = None


class ErrorBody(BaseModel):
    """Every error the sidecar answers (OpenAI's shape)."""

    error: ErrorDetail


ERROR_STATUSES = (400, 401, 403, 404, 405, 408, 409, 413, 422, 429, 502, 503, 504, 507)
ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorBody, "description": "an OpenAI-shaped error"} for s in ERROR_STATUSES}


def body_doc(model: type[BaseModel] | None = None, *, binary: bool = False,
             sse: bool = False) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its body itself: ``model``'s JSON body (or a
    raw file with ``binary``); ``sse``: its 200 may be an event stream."""
    if binary:
        content = {"application/octet-stream": {"schema": {"type": "string",
                                                           "format": "binary"}}}
    else:
        assert model is not None
        content = {"application/json": {"schema": model.model_json_schema(ref_template=REF)}}
    out: dict[str, Any] = {"requestBody": {"required": True, "content": content}}
    if sse:
        out["responses"] = {"200": {"description": "the answer, or its event stream",
                                    "content": {"application/json": {"schema": {}},
                                                "text/event-stream": {"schema": {}}}}}
    return out


def openapi(app: FastAPI) -> dict[str, Any]:
    """The app's schema, built once, nested definitions under ``components/schemas``."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path in doc.get("paths", {}).values():
            for op in path.values():
                for media in ((op.get("requestBody") or {}).get("content") or {}).values():
                    schemas.update(media.get("schema", {}).pop("$defs", {}))
        app.openapi_schema = doc
    return app.openapi_schema


# --- the relayed OpenAI routes' bodies, as far as the sidecar reads them ---------------------

class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = Field(default=None, max_length=20_000)
    name: str | None = Field(default=None, max_length=64)
    tool_call_id: str | None = Field(default=None, max_length=64)


class _Sampling(_Open):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=64)
    temperature: float | None = Field(default=None, ge=0, le=2)
    stream: bool = False
    user: str | None = Field(default=None, min_length=1, max_length=1024)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


class ChatBody(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=64)


class CompletionBody(_Sampling):
    """``POST /v1/completions``."""

    prompt: str = Field(max_length=20_000)


class ResponsesBody(_Sampling):
    """``POST /v1/responses``."""

    input: str = Field(max_length=20_000)


class EmbeddingsBody(_Open):
    """``POST /v1/embeddings``."""

    model: str = Field(min_length=1, max_length=256)
    input: str | list[str] = Field(max_length=64)


class TokenizeBody(_Open):
    """``POST /tokenize``: a ``prompt`` or chat ``messages``."""

    model: str | None = Field(default=None, max_length=256)
    prompt: str | None = Field(default=None, max_length=20_000)
    messages: list[ChatMessage] | None = Field(default=None, max_length=64)


class DetokenizeBody(_Open):
    """``POST /detokenize``."""

    model: str | None = Field(default=None, max_length=256)
    tokens: list[int] = Field(max_length=4096)


RELAYED = {"/v1/completions": CompletionBody, "/v1/responses": ResponsesBody,
           "/v1/embeddings": EmbeddingsBody, "/tokenize": TokenizeBody,
           "/detokenize": DetokenizeBody}
