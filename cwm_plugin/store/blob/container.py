"""The blob container: a safetensors file whose ``__metadata__`` names the cwm format and
carries a CRC-32 of itself (:mod:`.codec` says what the fields and the ``uint8`` streams
are). Reading and writing the header needs no torch, so maintenance (``cwm store gc|usage``,
the disk tier's index rebuild, sealing) runs without importing it: torch's import takes CPU
from the decoding requests of a server beside it.
"""

from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING, Any

from cwm_plugin.errors import CorruptBlob

try:     # ISA-L's CRC-32: the same values as zlib's, several times faster
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same checksums
    from zlib import crc32

if TYPE_CHECKING:
    import numpy as np

FORMAT = "cwm-kv"
MAX_HEADER = 1 << 20


def meta_crc(meta: dict[str, str]) -> str:
    """CRC-32 of every metadata field but itself, so damage to the header is caught too."""
    body = json.dumps({k: v for k, v in meta.items() if k != "meta_crc"}, sort_keys=True)
    return f"{crc32(body.encode()):08x}"


def check_meta(meta: dict[str, str]) -> None:
    if "meta_crc" in meta and meta["meta_crc"] != meta_crc(meta):
        raise CorruptBlob("blob metadata checksum mismatch",
                          hint="the blob header is damaged; the block will be recomputed")


def pack_blob(meta: dict[str, str], payloads: list[bytes | np.ndarray]) -> bytes:
    """A container of ``meta`` (as given) and ``payloads`` as ``uint8`` streams s00, s01..."""
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for i, p in enumerate(payloads):
        n = len(p) if isinstance(p, bytes) else int(p.size)
        header[f"s{i:02d}"] = {"dtype": "U8", "shape": [n], "data_offsets": [offset, offset + n]}
        offset += n
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    parts = [struct.pack("<Q", len(hj)), hj]
    parts += [p if isinstance(p, bytes) else _byte_view(p) for p in payloads]
    return b"".join(parts)                  # one copy of the payload


def _byte_view(a: np.ndarray) -> memoryview:
    import numpy as np  # here: maintenance packs no arrays, and goes without the import

    return memoryview(np.ascontiguousarray(a)).cast("B")


def pack_raw(meta: dict[str, str], payload: bytes) -> bytes:
    """A container of ``meta`` (its CRC added) and one opaque payload (sealed blobs)."""
    meta = {**meta, "meta_crc": ""}
    meta["meta_crc"] = meta_crc(meta)
    return pack_blob(meta, [payload])


def read_header(data: bytes | bytearray | memoryview) -> tuple[dict[str, str], dict[str, Any], int]:
    """Parse and check the container header: (metadata, tensor entries, data start)."""
    mv = memoryview(data)
    if len(mv) < 8:
        raise CorruptBlob(f"blob of {len(mv)} bytes is too short to be a cwm blob",
                          hint="it was truncated; the block will be recomputed")
    (n,) = struct.unpack("<Q", mv[:8])
    if n < 2 or n > MAX_HEADER or 8 + n > len(mv):
        raise CorruptBlob(f"blob header length {n} does not fit a {len(mv)}-byte blob",
                          hint="truncated or not a cwm blob")
    try:
        header = json.loads(bytes(mv[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptBlob(f"blob header is not valid JSON: {exc}",
                          hint="damaged or not a cwm blob") from exc
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise CorruptBlob("blob header has no metadata", hint="not a cwm blob")
    meta = header.pop("__metadata__")
    if meta.get("format") != FORMAT:
        raise CorruptBlob(f"blob format is {meta.get('format')!r}, not {FORMAT!r}",
                          hint="this is not a cwm KV blob")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptBlob("blob metadata values must be strings", hint="damaged blob")
    return meta, header, 8 + n


def peek(data: bytes | bytearray | memoryview, *, verify: bool = False) -> dict[str, str]:
    """The blob's metadata without decoding the payload (raises CorruptBlob if unreadable, or
    with ``verify`` if the metadata fails its CRC)."""
    meta = read_header(data)[0]
    if verify:
        check_meta(meta)
    return meta
