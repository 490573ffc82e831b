"""Portable windows: one self-describing file that another server with the same model imports.

File layout (``.cwmw``)::

    b"CWMWIN\\x00\\x01"                 magic and format version
    u64 big-endian  header length
    header          JSON: format, version, manifest (everything but its salts), the model
                    namespace, and per blob its worker, block, size and sha256
    blobs           each block's blob as stored (the codec's bytes: compressed, checksummed;
                    never sealed: an export holds the KV in the clear, like the messages)
    32 bytes        sha256 of everything before it

Export reads each block checked as a read checks it. Import checks, before it writes
anything, that the file is whole (every checksum), of a format this version reads, and for
the model and KV layout the importing store's vLLM serves (the served-model record the
connector leaves: the namespace must match field for field); a damaged, truncated or foreign
file is refused with what is wrong and the store is unchanged. Then the blocks go in under a
fresh window salt (sealed for it with encryption at rest), are pinned, and the name is claimed;
a failure on the way takes back what was written.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import struct
import time
from dataclasses import asdict
from typing import IO, Any

from cwm_plugin.connector import records
from cwm_plugin.errors import AlreadyExists, CWMError, InvalidInput
from cwm_plugin.store import codec, crypto
from cwm_plugin.windows.model import Manifest, check_name, manifest_key
from cwm_plugin.windows.rekey import WindowIncomplete

MAGIC = b"CWMWIN\x00\x01"
FORMAT = "cwm-window"
VERSION = 1
SECRET_FIELDS = ("frozen_salt", "window_salt", "window_hashes", "tenant", "last_thaw")
MAX_HEADER = 256 << 20


class BadWindowFile(CWMError):
    """An export file that is damaged, truncated, of another format or for another model."""

    code = "bad_window_file"
    http_status = 400


def export_window(engine: Any, owner: str, name: str, out: IO[bytes]) -> dict[str, Any]:
    """Write window ``name`` of ``owner`` to ``out``; returns the file's summary."""
    m: Manifest = engine.get(owner, name)
    keys = engine.window_keys(m)
    blobs: list[bytes] = []
    entries: list[dict[str, Any]] = []
    for w, ks in enumerate(keys):
        for i, key in enumerate(ks):
            plain = engine.store.get_plain(key, salt=m.window_salt)
            if plain is None:
                raise WindowIncomplete(f"block {i} of window {name!r} is no longer stored",
                                       hint="export a complete window (see its status)")
            blobs.append(plain)
            entries.append({"worker": w, "block": i, "size": len(plain),
                            "sha256": hashlib.sha256(plain).hexdigest()})
    manifest = {k: v for k, v in asdict(m).items() if k not in SECRET_FIELDS}
    header = json.dumps({"format": FORMAT, "version": VERSION, "exported": time.time(),
                         "manifest": manifest, "blobs": entries},
                        separators=(",", ":")).encode()
    digest = hashlib.sha256()
    size = 0
    for part in (MAGIC, struct.pack(">Q", len(header)), header, *blobs):
        out.write(part)
        digest.update(part)
        size += len(part)
    out.write(digest.digest())
    return {"name": name, "bytes": size + 32, "blocks": m.num_blocks, "tokens": len(m.tokens),
            "model": m.model}


def read_window_file(src: IO[bytes]) -> tuple[dict[str, Any], list[bytes]]:
    """The header and the blobs of an export file, every checksum verified (else
    :class:`BadWindowFile`, nothing else done)."""
    digest = hashlib.sha256()

    def take(n: int, what: str) -> bytes:
        data = src.read(n)
        if len(data) != n:
            raise BadWindowFile(f"the window file is truncated (in its {what})",
                                hint="export the window again and copy the whole file")
        digest.update(data)
        return data

    if take(len(MAGIC), "start") != MAGIC:
        raise BadWindowFile("this is not a cwm window export (or of another format version)",
                            hint="export it with `cwm window export` of this version")
    (length,) = struct.unpack(">Q", take(8, "header length"))
    if length > MAX_HEADER:
        raise BadWindowFile("the window file's header is implausibly large (damaged?)")
    try:
        header = json.loads(take(length, "header"))
        entries = header["blobs"]
        manifest = header["manifest"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BadWindowFile(f"the window file's header is damaged ({exc})") from None
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise BadWindowFile(f"unsupported window file {header.get('format')!r} version "
                            f"{header.get('version')!r}", hint=f"this server reads {FORMAT} "
                                                               f"version {VERSION}")
    blobs = []
    for e in entries:
        blob = take(int(e["size"]), f"block {e.get('block')}")
        if hashlib.sha256(blob).hexdigest() != e.get("sha256"):
            raise BadWindowFile(f"block {e.get('block')} of the window file is damaged "
                                "(checksum mismatch)", hint="export the window again")
        blobs.append(blob)
    trailer = src.read(32)
    if trailer != digest.digest() or src.read(1):
        raise BadWindowFile("the window file is damaged or has trailing bytes (its checksum "
                            "does not match)", hint="export the window again")
    return {"manifest": manifest, "blobs": entries}, blobs


def _served(engine: Any, model: str) -> list[dict[str, Any]]:
    """The namespaces the vLLMs using this store serve ``model`` under (by their served
    name or by the namespace's model name: a window names the latter)."""
    keys: set[bytes] = {records.served_key(model)}
    for infos in engine.store.list_keys(records.SERVED_PREFIX, limit=10_000).values():
        keys |= {i.key for i in infos}
    out = []
    for key in sorted(keys):
        t = engine.store.get(key, primary=True)
        if t is None:
            continue
        ns = records.tensor_json(t).get("namespace", {})
        if ns.get("model") == model or key == records.served_key(model):
            out.append(ns)
    return out


def _check_compatible(engine: Any, m: Manifest, blobs: list[bytes]) -> None:
    """The importing store's vLLM must serve the window's model with the same namespace."""
    served = _served(engine, m.model)
    if not served:
        raise BadWindowFile(f"no vLLM using this store serves model {m.model!r}",
                            hint="start vLLM with the cwm connector and this store first, "
                                 "then import the window")
    if not any(ns == m.namespace for ns in served):
        ns = served[0]
        diff = sorted(k for k in set(ns) | set(m.namespace) if ns.get(k) != m.namespace.get(k))
        what = "; ".join(f"{k}: {m.namespace.get(k)!r} in the file vs {ns.get(k)!r} here"
                         for k in diff[:6])
        raise BadWindowFile(f"the window was exported for another model or KV layout ({what})",
                            hint="import it on a server with the settings it was frozen on")
    for i, blob in enumerate(blobs):
        try:
            codec.peek(blob, verify=True)
        except CWMError as exc:
            raise BadWindowFile(f"block {i} of the window file is not a KV block ({exc})") \
                from None


def import_window(engine: Any, owner: str, src: IO[bytes], name: str | None = None
                  ) -> Manifest:
    """Import an export file as a window of ``owner`` (named ``name`` or as exported)."""
    header, blobs = read_window_file(src)
    try:
        d = dict(header["manifest"])
        d["workers"] = [tuple(w) for w in d["workers"]]
        m = Manifest(**{k: v for k, v in d.items() if k in Manifest.__dataclass_fields__},
                     tenant=owner, frozen_salt="", window_salt="")
    except (TypeError, ValueError, KeyError) as exc:
        raise BadWindowFile(f"the window file's manifest is incomplete ({exc})") from None
    m.name = check_name(name or m.name)
    entries = header["blobs"]
    if len(entries) != m.num_blocks * len(m.workers) or any(
            not (0 <= e["worker"] < len(m.workers) and 0 <= e["block"] < m.num_blocks)
            for e in entries):
        raise BadWindowFile("the window file's blocks do not match its manifest")
    _check_compatible(engine, m, blobs)
    if engine._read(manifest_key(owner, m.name), owner) is not None:
        raise AlreadyExists(f"a window named {m.name!r} already exists",
                            hint="import it under another name (--name)")
    engine._check_tenant_quota(owner, sum(len(b) for b in blobs))
    m.window_salt = "cwm-window:" + secrets.token_hex(16)
    m.frozen_salt = m.window_salt
    hashes = engine._chain(m, m.tokens, m.window_salt, m.num_blocks)
    m.window_hashes = [h.hex() for h in hashes]
    m.created = m.updated = time.time()
    m.expires = None
    keys = engine._keys(m.workers, hashes)
    flat = [keys[e["worker"]][e["block"]] for e in entries]
    try:
        _put_plain(engine.store, flat, blobs, m.window_salt)
        engine._complete(keys, f"window {m.name!r}", time.monotonic() + engine.wait_s,
                         block_size=m.block_size, tokens=len(m.tokens))
        pinned = engine.store.pin_many(flat)
        if any(len(set(pinned.get(t.name, []))) != len(set(flat))
               for t in engine.store.pin_tiers()):
            raise InvalidInput("the imported blocks could not be pinned on every tier")
        engine._claim(m)
    except BaseException:
        engine.store.delete_many(flat)
        raise
    return m


def _put_plain(store: Any, keys: list[bytes], blobs: list[bytes], salt: str) -> None:
    """Store plain blobs under ``keys``, sealed for ``salt`` when the store encrypts."""
    cipher = None
    if store.config.encryption_key:
        cipher = crypto.BlobCipher.derive(crypto.parse_master_key(store.config.encryption_key),
                                          salt)
    futures = [store.put_blob(k, cipher.seal(b, key=k) if cipher else b, replace=True)
               for k, b in zip(keys, blobs, strict=True)]
    for f in futures:
        f.result()
