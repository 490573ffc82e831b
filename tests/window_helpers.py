"""What the connector leaves in the KV store after a salted request, built without vLLM: blocks
per worker under vLLM's own hashing and the context record (importable: tests/ is on sys.path).
Shared by the window engine's tests and the sidecar's (a session's KV after a rotation), with
what a served model leaves (:func:`serve`), a window file as a hostile client rewrites it
(:func:`rewritten`) and a user's window in the former layout (:func:`to_former_layout`)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict

import torch

from cwm_plugin.connector import records
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.windows import hashing
from cwm_plugin.windows.model import manifest_key, thaw_key

BS = 16
WORKERS = [("ab" * 16, 0), ("ab" * 16, 1)]       # one namespace, TP=2
NS = {"model": "tiny", "model_fingerprint": "f", "num_layers": 2, "num_kv_heads": 1,
      "head_size": 8, "dtype": "float32", "block_size": BS}


def block(i: int, rank: int) -> torch.Tensor:
    return torch.full((2, 1, BS, 16), float(i * 10 + rank))


def block_keys(tokens: list[int], salt: str, n: int) -> list[list[bytes]]:
    """Per worker, the store keys of the first ``n`` blocks of ``tokens`` under ``salt``."""
    hs = hashing.chain(tokens, salt=salt, block_size=BS, hash_block_size=BS,
                       hash_algo="sha256", lora=None, num_blocks=n)
    return [[bytes.fromhex(d) + r.to_bytes(2, "big") + h for h in hs] for d, r in WORKERS]


def contents(tokens: list[int], n: int) -> list[bytes]:
    """The content identities of the first ``n`` blocks of ``tokens`` (what every key of a
    block shares, whatever its salt: the connector writes them into each blob)."""
    return hashing.chain(tokens, salt=None, block_size=BS, hash_block_size=BS,
                         hash_algo="sha256", lora=None, num_blocks=n)


def converse(store: KVStore, salt: str, n_tokens: int, *, save: int | None = None,
             turn: int | None = None, keep: int = 8, seed: int = 0,
             at: float | None = None, served: str = "tiny",
             namespace: dict | None = None) -> list[int]:
    """What the connector leaves after a salted request: blocks per worker and a record (also
    under its turn's slot when the request named its client ``turn``), written as the
    connector writes it (``at``: when the turn arrived; a record never replaces a later
    one's; ``served``: the name vLLM serves the model under, ``namespace``: its KV namespace,
    whose model is the model path's basename)."""
    tokens = [(7 * i + seed) % 4000 + 5 for i in range(n_tokens)]
    n = n_tokens // BS if save is None else save
    hs = hashing.chain(tokens, salt=salt, block_size=BS, hash_block_size=BS,
                       hash_algo="sha256", lora=None, num_blocks=n)
    rec = records.ContextRecord(tokens=tokens, block_hashes=[h.hex() for h in hs],
                                workers=WORKERS, block_size=BS, hash_block_size=BS,
                                hash_algo="sha256", namespace=namespace or NS, turn=turn,
                                arrived=at, created=time.time(), model=served)
    ids = contents(tokens, n)
    for (_, rank), keys in zip(WORKERS, block_keys(tokens, salt, n), strict=True):
        for i, key in enumerate(keys):
            store.put(key, block(i, rank), salt=salt, content=ids[i]).result()
    keys = [records.context_record_key(salt)] + \
        ([records.turn_record_key(salt, turn % keep)] if turn is not None else [])
    for key in keys:
        assert records.write_record(store, key, asdict(rec), records.RECORD_LAYOUT,
                                    what="a context record", salt=salt, order=rec.order)
    store.wait_keys(keys, timeout=30)
    return tokens


def session_blocks(store: KVStore, tokens: list[int], salt: str, n: int, *,
                   sealed: bool = False) -> list[list]:
    """The session's blocks per worker, read as its requests read them (``sealed``: the store
    encrypts at rest, so only the session's salt opens them; the connector knows each block's
    content identity)."""
    return [store.get_many(keys, salt=salt if sealed else None, contents=contents(tokens, n))
            for keys in block_keys(tokens, salt, n)]


def serve(store: KVStore, namespace: dict, workers=WORKERS) -> None:
    """What a vLLM with the connector leaves in its store: the namespace it serves."""
    records.write_record(store, records.served_key(namespace["model"]),
                         {"model": namespace["model"], "namespace": namespace,
                          "workers": [list(w) for w in workers]},
                         records.SERVED_LAYOUT, what="served")
    store.flush()


def rewritten(good: bytes, change) -> bytes:
    """``good`` with its header changed by ``change(header)`` and its checksums made right
    again: what a hostile tenant can post."""
    import hashlib
    import json
    import struct

    from cwm_plugin.windows.window_file import MAGIC
    n = struct.unpack(">Q", good[len(MAGIC):len(MAGIC) + 8])[0]
    start = len(MAGIC) + 8
    header = json.loads(good[start:start + n])
    trailer = 64 if header.get("signature") else 32   # a signed file's sha256 and HMAC
    change(header)
    raw = json.dumps(header).encode()
    body = MAGIC + struct.pack(">Q", len(raw)) + raw + good[start + n:-trailer]
    return body + hashlib.sha256(body).digest()


def to_former_layout(store: KVStore, owner: str, name: str) -> tuple[bytes, bytes]:
    """Store user ``owner``'s window ``name`` as the former layout did -- its manifest and thaw
    note in a group of the user's own, sealed under the user's own salt (the keys built here
    by hand) -- and nothing of it in the tenant's group; its blocks stay. Returns the former
    (manifest key, thaw note key)."""
    group = b"cwm-win\0" + hashlib.sha256(b"cwm-win-tenant\0" + owner.encode()).digest()[:10]
    key = group + hashlib.sha256(name.encode()).digest()[:16]
    note = b"cwm-wth\0" + key[len(b"cwm-win\0"):]
    salt, now = "cwm-window-manifest\0" + owner, "cwm-window-manifest\0" + owner.split("/")[0]
    store.put(key, store.get(manifest_key(owner, name), salt=now, primary=True),
              layout="cwm-window-manifest", salt=salt, replace=True).result()
    store.pin_many([key])
    thawed = store.get(thaw_key(owner, name), salt=now, primary=True)
    if thawed is not None:
        store.put(note, thawed, layout="cwm-window-thaw", salt=salt, replace=True).result()
    store.unpin_many([manifest_key(owner, name)])
    store.delete_many([manifest_key(owner, name), thaw_key(owner, name)])
    store.flush()
    return key, note


def listings(store: KVStore, monkeypatch, prefix: bytes) -> list[bytes]:
    """Every listing of the store's keys under ``prefix`` from now on (a scan of that group),
    as the store is asked for it."""
    seen: list[bytes] = []
    real = store.list_keys

    def spy(asked: bytes = b"", **kw):
        if asked == prefix:
            seen.append(asked)
        return real(asked, **kw)

    monkeypatch.setattr(store, "list_keys", spy)
    return seen
