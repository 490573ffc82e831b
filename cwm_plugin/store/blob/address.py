"""Content addresses of blobs."""

from __future__ import annotations

import hashlib


def blob_id_of(blob: bytes) -> str:
    """Content address of a blob: the first 160 bits of its SHA-256, in hex."""
    return hashlib.sha256(blob).hexdigest()[:40]


def twin_id_of(blob_id: str) -> str:
    """The id of a blob's uncompressed twin (the memory tier's copy of the same block): a
    function of the blob's own id, as the twin is of the blob (the same tensor and header),
    so the twin's bytes need no hashing of their own."""
    return hashlib.sha256(b"uncompressed:" + blob_id.encode()).hexdigest()[:40]
