"""Content addresses of blobs."""

from __future__ import annotations

import hashlib


def blob_id_of(blob: bytes) -> str:
    """Content address of a blob: the first 160 bits of its SHA-256, in hex."""
    return hashlib.sha256(blob).hexdigest()[:40]
