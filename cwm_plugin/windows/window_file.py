"""The portable window file format (``.cwmw``): writing it and checking it, a block at a time.

Layout::

    b"CWMWIN\\x00\\x01"                 magic and format version
    u64 big-endian  header length
    header          JSON: format, version, manifest (everything but its salts), per blob
                    its worker, block, size and sha256, and ``signature`` (signed files)
    blobs           each block's blob as stored (the codec's bytes: compressed, checksummed;
                    never sealed: an export holds the KV in the clear, like the messages)
    32 bytes        sha256 of everything before it
    32 bytes        signed files only: HMAC-SHA256 under the export key of everything before
                    the sha256

The checksums find damage, not intent: anyone can change a file and recompute them. With an
export key (``windows.export_key``) a server signs the files it writes and refuses any file
that is unsigned or signed under another key, so only files from servers sharing the key are
imported.

Neither side holds more than one block in memory: :func:`write_file` spools the blobs while it
hashes them and writes the header before them; :func:`check_file` reads the file once,
verifying every checksum and the header's shape (a strict schema: any field of the wrong type
or range is a :class:`BadWindowFile`, never another error), and answers where each blob lies,
so the importer reads them back one by one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cwm_plugin.errors import CWMError

MAGIC = b"CWMWIN\x00\x01"
FORMAT = "cwm-window"
VERSION = 1
MAX_HEADER = 64 << 20
MAX_BLOB = 1 << 30
CHUNK = 1 << 20
SIGNATURE = "hmac-sha256"


class BadWindowFile(CWMError):
    """An export file that is damaged, truncated, of another format or for another model."""

    code = "bad_window_file"
    http_status = 400


class BlobEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    worker: int = Field(ge=0, le=4096)
    block: int = Field(ge=0, le=1 << 24)
    size: int = Field(gt=0, le=MAX_BLOB)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Header(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: str
    version: int
    manifest: dict[str, Any]
    blobs: list[BlobEntry] = Field(max_length=1 << 22)
    signature: str | None = None


@dataclass(frozen=True)
class CheckedFile:
    header: Header
    offsets: list[int]  # where each entry's blob starts in the file


class _Sums:
    """The file's sha256 and, with a key, its HMAC, over the same bytes."""

    def __init__(self, key: bytes | None) -> None:
        self.sha = hashlib.sha256()
        self.mac = hmac.new(key, digestmod=hashlib.sha256) if key is not None else None

    def update(self, data: bytes) -> None:
        self.sha.update(data)
        if self.mac is not None:
            self.mac.update(data)


def write_file(out: IO[bytes], manifest: dict[str, Any],
               blobs: Iterator[tuple[int, int, bytes]], key: bytes | None = None) -> int:
    """Write a window file of ``manifest`` and ``(worker, block, blob)`` to ``out``, signed
    under ``key`` when given; its size."""
    entries = []
    with tempfile.TemporaryFile() as spool:
        for worker, block, blob in blobs:
            spool.write(blob)
            entries.append({"worker": worker, "block": block, "size": len(blob),
                            "sha256": hashlib.sha256(blob).hexdigest()})
        header = json.dumps({"format": FORMAT, "version": VERSION, "exported": time.time(),
                             "manifest": manifest, "blobs": entries,
                             **({"signature": SIGNATURE} if key is not None else {})},
                            separators=(",", ":")).encode()
        digest = _Sums(key)
        size = 0
        for part in (MAGIC, struct.pack(">Q", len(header)), header):
            out.write(part)
            digest.update(part)
            size += len(part)
        spool.seek(0)
        while data := spool.read(CHUNK):
            out.write(data)
            digest.update(data)
            size += len(data)
    trailer = digest.sha.digest() + (digest.mac.digest() if digest.mac is not None else b"")
    out.write(trailer)
    return size + len(trailer)


def check_file(src: IO[bytes], key: bytes | None = None) -> CheckedFile:
    """Verify a window file (seekable) end to end without keeping its blobs; raise
    :class:`BadWindowFile` saying what is wrong. ``key``: the file must be signed under it."""
    digest = _Sums(key)
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        data = src.read(n)
        if len(data) != n:
            raise BadWindowFile(f"the window file is truncated (in its {what})",
                                hint="export the window again and copy the whole file")
        digest.update(data)
        pos += n
        return data

    if take(len(MAGIC), "start") != MAGIC:
        raise BadWindowFile("this is not a cwm window export (or of another format version)",
                            hint="export it with `cwm window export` of this version")
    (length,) = struct.unpack(">Q", take(8, "header length"))
    if length > MAX_HEADER:
        raise BadWindowFile("the window file's header is implausibly large (damaged?)")
    try:
        header = Header.model_validate(json.loads(take(length, "header")))
    except (ValueError, ValidationError, RecursionError) as exc:
        raise BadWindowFile(f"the window file's header is damaged "
                            f"({str(exc).splitlines()[0][:200]})") from None
    if header.format != FORMAT or header.version != VERSION \
            or header.signature not in (None, SIGNATURE):
        raise BadWindowFile(f"unsupported window file {header.format!r} version "
                            f"{header.version!r}", hint=f"this server reads {FORMAT} "
                                                        f"version {VERSION}")
    if key is not None and header.signature is None:
        raise BadWindowFile("the window file is not signed, and this server imports only "
                            "files signed under its export key",
                            hint="export it from a server with the same windows.export_key")
    offsets = []
    for e in header.blobs:
        offsets.append(pos)
        h = hashlib.sha256()
        left = e.size
        while left:
            part = take(min(CHUNK, left), f"block {e.block}")
            h.update(part)
            left -= len(part)
        if h.hexdigest() != e.sha256:
            raise BadWindowFile(f"block {e.block} of the window file is damaged (checksum "
                                "mismatch)", hint="export the window again")
    trailer = src.read(32)
    signature = src.read(32) if header.signature is not None else b""
    if trailer != digest.sha.digest() or len(signature) != (32 if header.signature else 0) \
            or src.read(1):
        raise BadWindowFile("the window file is damaged or has trailing bytes (its checksum "
                            "does not match)", hint="export the window again")
    if digest.mac is not None and not hmac.compare_digest(signature, digest.mac.digest()):
        raise BadWindowFile("the window file's signature does not match this server's export "
                            "key (changed since it was signed, or signed under another key)",
                            hint="import files exported by a server with the same "
                                 "windows.export_key")
    return CheckedFile(header, offsets)


def read_blob(src: IO[bytes], checked: CheckedFile, i: int) -> bytes:
    """Blob ``i`` of a checked file."""
    src.seek(checked.offsets[i])
    return src.read(checked.header.blobs[i].size)
