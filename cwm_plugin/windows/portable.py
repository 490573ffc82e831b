"""Portable windows: export a window to one file (:mod:`.window_file`), import it on another
server with the same model.

Export reads each block checked as a read checks it, one at a time, and signs the file when
the engine has an export key. Import checks, before it writes anything, that the file is whole
(every checksum; with an export key, its signature), of a format this version reads, that its
manifest passes the validator every stored manifest passes
(:func:`~cwm_plugin.windows.model.check_manifest`: a field of the wrong type or range is a
``bad_window_file``, never an error later), that each blob is a KV block of the key group it
lands in and, in an unsigned file (no export key), bound to the content the manifest's tokens
give it (its header's ``content``, :mod:`cwm_plugin.store.binding`: a block naming none could
hold any KV of the model), and that it is for what the importing store's vLLM serves: the
namespace must match field for field, and the file's workers (the key scopes its blocks go
under) must be exactly the served workers -- a file never chooses where in the store its keys
land (another tenant's window listing, a served-model record). A damaged, truncated, forged or
foreign file is refused with what is wrong and the store is unchanged. Then the blocks go in
one by one under a fresh window salt (sealed for it with encryption at rest) and the engine's
commit measures the bytes they take (never the file's figure), checks the tenant's quota, pins
them and claims the name (:mod:`.tenancy`); a failure on the way takes back what was written.
Windows of a LoRA adapter are not portable (their key scope is the adapter's content, which
no served record names).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict
from typing import IO, Any

from cwm_plugin.connector import records
from cwm_plugin.errors import AlreadyExists, CWMError, InvalidInput
from cwm_plugin.store import binding
from cwm_plugin.store.blob import container, crypto
from cwm_plugin.windows.engine import WindowEngine
from cwm_plugin.windows.model import Manifest, check_manifest
from cwm_plugin.windows.rekey import WindowIncomplete
from cwm_plugin.windows.window_file import (
    BadWindowFile,
    CheckedFile,
    check_file,
    read_blob,
    write_file,
)

SECRET_FIELDS = ("frozen_salt", "window_salt", "window_hashes", "tenant", "last_thaw")
# what the importing server decides, never the file
LOCAL_FIELDS = ("stored_bytes", "created", "updated", "expires", "parent", "auto")
__all__ = ["BadWindowFile", "export_window", "import_window"]


def export_window(engine: WindowEngine, owner: str, name: str, out: IO[bytes]) -> dict[str, Any]:
    """Write window ``name`` of ``owner`` to ``out``; returns the file's summary."""
    m: Manifest = engine.get(owner, name)
    if m.lora:
        raise InvalidInput(f"window {name!r} is of a LoRA adapter: not portable",
                           hint="thaw it on a server sharing the store instead")
    keys = engine.blocks.of_window(m)
    contents = engine.blocks.chain(m, m.tokens, None, m.num_blocks)   # what each block holds

    def blobs():
        for w, ks in enumerate(keys):
            for i, key in enumerate(ks):
                plain = engine.store.get_plain(key, salt=m.window_salt, content=contents[i])
                if plain is None:
                    raise WindowIncomplete(f"block {i} of window {name!r} is no longer stored",
                                           hint="export a complete window (see its status)")
                yield w, i, plain

    manifest = {k: v for k, v in asdict(m).items() if k not in SECRET_FIELDS}
    size = write_file(out, manifest, blobs(), key=engine.export_key)
    return {"name": name, "bytes": size, "blocks": m.num_blocks, "tokens": len(m.tokens),
            "model": m.model}


def _served(engine: WindowEngine, model: str) -> list[dict[str, Any]]:
    """The served-model records (namespace, workers) of the vLLMs using this store that serve
    ``model`` (by their served name or the namespace's model name: a window names the
    latter); a record that cannot be read is skipped."""
    keys: set[bytes] = {records.served_key(model)}
    for infos in engine.store.list_keys(records.SERVED_PREFIX, limit=10_000).values():
        keys |= {i.key for i in infos}
    out = []
    for key in sorted(keys):
        try:
            t = engine.store.get(key, primary=True)
            rec = records.tensor_json(t) if t is not None else None
        except (CWMError, ValueError, TypeError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("namespace"), dict) and (
                rec["namespace"].get("model") == model or key == records.served_key(model)):
            out.append(rec)
    return out


def _manifest(d: dict[str, Any], owner: str, name: str | None) -> Manifest:
    """The file's manifest as ``owner``'s window ``name`` (or as exported), checked by the
    manifest validator (else BadWindowFile); not yet keyed (no window salt)."""
    now = time.time()
    fields = {k: v for k, v in d.items() if k in Manifest.__dataclass_fields__
              and k not in SECRET_FIELDS and k not in LOCAL_FIELDS}
    if name is not None:
        fields["name"] = name
    if isinstance(fields.get("workers"), list):
        fields["workers"] = [tuple(w) if isinstance(w, list) else w for w in fields["workers"]]
    try:
        m = check_manifest(Manifest(**fields, tenant=owner, frozen_salt="", window_salt="",
                                    created=now, updated=now), keyed=False)
    except TypeError as exc:   # a field a window needs is missing
        raise BadWindowFile(f"the window file's manifest is incomplete ({exc})") from None
    except InvalidInput as exc:
        raise BadWindowFile(f"the window file has an {exc}") from None
    if m.lora:
        raise BadWindowFile("the window file is of a LoRA adapter: not portable")
    return m


def _check_compatible(engine: WindowEngine, m: Manifest, checked: CheckedFile) -> None:
    """The store's vLLM must serve the window's model with the same namespace and workers,
    and the file must hold each (worker, block) of the window exactly once."""
    served = _served(engine, m.model)
    if not served:
        raise BadWindowFile(f"no vLLM using this store serves model {m.model!r}",
                            hint="start vLLM with the cwm connector and this store first, "
                                 "then import the window")
    same = [r for r in served if r["namespace"] == m.namespace]
    if not same:
        ns = served[0]["namespace"]
        diff = sorted(k for k in set(ns) | set(m.namespace) if ns.get(k) != m.namespace.get(k))
        what = "; ".join(f"{k}: {m.namespace.get(k)!r} in the file vs {ns.get(k)!r} here"
                         for k in diff[:6])
        raise BadWindowFile(f"the window was exported for another model or KV layout ({what})",
                            hint="import it on a server with the settings it was frozen on")
    if not any([tuple(w) for w in r.get("workers", [])] == list(m.workers) for r in same):
        raise BadWindowFile("the window file's workers (TP ranks and pipeline stages) are not "
                            "the ones this store's vLLM serves with",
                            hint="import it on a server with the same parallel layout")
    cells = {(e.worker, e.block) for e in checked.header.blobs}
    if len(cells) != len(checked.header.blobs) or cells != {
            (w, b) for w in range(len(m.workers)) for b in range(m.num_blocks)}:
        raise BadWindowFile("the window file's blocks do not match its manifest")


def import_window(engine: WindowEngine, owner: str, src: IO[bytes], name: str | None = None
                  ) -> Manifest:
    """Import an export file (seekable) as a window of ``owner`` (named ``name`` or as
    exported)."""
    checked = check_file(src, engine.export_key)
    m = _manifest(checked.header.manifest, owner, name)
    _check_compatible(engine, m, checked)
    if engine.catalog.find(owner, m.name) is not None:
        raise AlreadyExists(f"a window named {m.name!r} already exists",
                            hint="import it under another name (--name)")
    m.window_salt = m.frozen_salt = "cwm-window:" + secrets.token_hex(16)
    hashes = engine.blocks.chain(m, m.tokens, m.window_salt, m.num_blocks)
    m.window_hashes = [h.hex() for h in hashes]
    keys = engine.blocks.keys(m.workers, hashes)
    flat = [keys[e.worker][e.block] for e in checked.header.blobs]
    contents = engine.blocks.chain(m, m.tokens, None, m.num_blocks)
    for i, key in enumerate(flat):
        try:  # what put_blob would refuse, refused before anything is written
            meta = container.peek(read_blob(src, checked, i), verify=True)
            binding.check(meta, key, encrypted=False,
                          content=contents[checked.header.blobs[i].block])
        except CWMError as exc:
            raise BadWindowFile(f"block {i} of the window file is not the KV block its "
                                f"manifest names ({exc})") from None
        if crypto.is_sealed(meta):  # an export holds plain blobs
            raise BadWindowFile(f"block {i} of the window file is sealed: not an export")
        if engine.export_key is None and "content" not in meta:
            raise BadWindowFile(
                f"block {i} of the window file names no content (the tokens it holds): an "
                "unsigned window file is imported only when each block is bound to its tokens",
                hint="export the window again from a server that saves blocks with their "
                     "content, or give both servers one windows.export_key (signed files)")
    engine.tenancy.check_quota(owner, sum(e.size for e in checked.header.blobs))  # at once

    def write() -> None:
        cipher = None
        if engine.store.config.encryption_key:
            cipher = crypto.BlobCipher.derive(
                crypto.parse_master_key(engine.store.config.encryption_key), m.window_salt)
        for i, key in enumerate(flat):  # one block in memory at a time
            blob = read_blob(src, checked, i)
            engine.store.put_blob(key, cipher.seal(blob, key=key) if cipher else blob,
                                  replace=True,
                                  content=contents[checked.header.blobs[i].block]).result()
        engine.blocks.complete(keys, f"window {m.name!r}", time.monotonic() + engine.wait_s,
                               block_size=m.block_size, tokens=len(m.tokens))

    engine.tenancy.pin_new(m, keys, write)
    return m
