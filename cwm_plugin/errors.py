"""One exception hierarchy for the whole project.

Every error has a stable ``code``, a message that says what happened and what to do, and a
``retryable`` flag. The sidecar maps these to OpenAI-shaped errors, the CLI to an exit code and
one line, MCP to a tool error; a client of the sidecar raises the sidecar's error with its code
(:func:`remote_error`), so REST, CLI and MCP report the same failure the same way.
"""

from __future__ import annotations


class CWMError(Exception):
    """Base class: ``code`` is stable, the message says what to do."""

    code = "cwm_error"
    retryable = False
    http_status = 500

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message} ({hint})" if hint else message)

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "message": str(self), "retryable": self.retryable}


class ConfigError(CWMError):
    code = "config_error"
    http_status = 400


class InvalidInput(CWMError):
    """Bad input from a caller: a malformed name, an oversize body, a path traversal attempt."""

    code = "invalid_input"
    http_status = 400


class NotFound(CWMError):
    code = "not_found"
    http_status = 404


class AlreadyExists(CWMError):
    code = "already_exists"
    http_status = 409


class Forbidden(CWMError):
    code = "forbidden"
    http_status = 403


class CorruptBlob(CWMError):
    """A stored blob failed its checksum, was truncated, or is not ours."""

    code = "corrupt_blob"


class IncompatibleBlob(CWMError):
    """A well-formed blob that belongs to another model, layout or format version."""

    code = "incompatible_blob"


class RefusedBlob(IncompatibleBlob):
    """A well-formed blob that is not the one its key asked for: another key's or key group's,
    sealed under another salt, or not sealed where the store encrypts. ``reason`` names which
    (plaintext, foreign_group, foreign_key, foreign_salt); the block is a miss, recomputed."""

    code = "refused_blob"

    def __init__(self, message: str, *, reason: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.reason = reason


class StorageFull(CWMError):
    code = "storage_full"
    retryable = True
    http_status = 507


class TierUnavailable(CWMError):
    """A storage tier (e.g. Redis) cannot be reached right now."""

    code = "tier_unavailable"
    retryable = True
    http_status = 503


class MemoryUnavailable(CWMError):
    """The memory's shared database (PostgreSQL) cannot be reached right now; a turn is
    answered without memory until it is back."""

    code = "memory_unavailable"
    retryable = True
    http_status = 503


class UpstreamError(CWMError):
    code = "upstream_error"
    retryable = True
    http_status = 502


class UpstreamTimeout(UpstreamError):
    code = "upstream_timeout"
    http_status = 504


def _codes(cls: type[CWMError]) -> dict[str, type[CWMError]]:
    out: dict[str, type[CWMError]] = {}
    for sub in cls.__subclasses__():
        out.update(_codes(sub))
        out.setdefault(sub.code, sub)
    return out


def remote_error(code: str, message: str, status: int) -> CWMError:
    """An error another process answered (the sidecar, over HTTP), raised here with the same
    code: as the class this process knows for it, else as a :class:`CWMError` carrying the
    code and status (a code defined where this process never looks, say), never as a bare
    ``cwm_error``."""
    cls = _codes(CWMError).get(code)
    try:
        err = cls(message) if cls is not None else None
    except TypeError:  # a class that needs more than a message
        err = None
    if err is None:
        err = CWMError(message)
        err.code = code or CWMError.code
    err.http_status = status
    return err
