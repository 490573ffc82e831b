"""What binds a stored blob to the key it is read under: checked on every read, before decoding.

Anyone who can write to the disk store or the Redis can point key A at key B's blob, put other
bytes under A's blob (swap two blob files), or write an older version of a rewritten record
back. The blob's own header names the key it was saved for, so the reader compares it with the
key it asked for:

* A blob of another key *group* (the first :data:`~cwm_plugin.store.tiers.base.GROUP_BYTES`
  bytes of a key: namespace digest and TP rank) is refused (``foreign_group``).
* A blob naming another key of the group is refused (``foreign_key``) unless it holds the
  content the reader expects. Blobs are content-addressed and shared between keys on purpose:
  a context window's keys (a window salt, a thawed session's salt: other vLLM block hashes)
  point at the blobs the session saved, with no copy
  (:meth:`~cwm_plugin.store.key_ops.KeySpace.link_many`). What every key of one KV block
  shares is not a key but the block's *content identity*: vLLM's hash chain of its tokens (and
  adapter, images) without the cache_salt (:mod:`cwm_plugin.connector.content`). The saver
  writes it into the header (``content``); the reader passes it with the key (the connector
  knows each request's tokens, a window its manifest's). So a swapped file or a key pointed at
  a block of other tokens is refused, and a window's shared blob reads back. Binding the exact
  key would forbid the sharing; binding only the group would let any block of the model stand
  for any other. A reader that passes no content (records, manifests) accepts its key's blob
  only; a block whose header names no content is accepted per group.
* With encryption at rest a blob is sealed for exactly one key and salt: the key named in its
  clear header, which the AEAD authenticates with the rest of the header, must be the key read
  (``foreign_key``; a window's re-key re-seals a copy for each new key:
  :meth:`~cwm_plugin.store.blob.crypto.BlobCipher.seal` with ``key``), its key id the request
  salt's (``foreign_salt``), and it must be sealed at all (``plaintext``: anyone could have
  written it).
* A record rewritten under its key (a context record, a window manifest, a thaw note) carries
  a ``revision`` that only grows (:class:`Revisions`: wall-clock nanoseconds, past any revision
  of the key this process saw). One older than the newest this process read or wrote for the
  key is refused (``replayed``); with encryption the revision is authenticated, so an older
  sealed version written back is refused.

A refusal raises :class:`~cwm_plugin.errors.RefusedBlob` with its reason; the store counts it
(``errors{kind="refused_<reason>"}``), logs it once and serves a miss: the block is recomputed.
A damaged header is :class:`~cwm_plugin.errors.CorruptBlob` instead (quarantined).

What this cannot catch: without encryption, someone who can write the store can forge a blob
naming any key and content (these checks stop confusion, not forgery); with it, an older
version of a record in a process that never saw the newer one (nothing outside the store
remembers it), and revisions of servers whose clocks differ by more than the time between two
rewrites of one record (keep them synchronised).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from cwm_plugin.errors import CorruptBlob, RefusedBlob
from cwm_plugin.store.blob import container, crypto
from cwm_plugin.store.tiers.base import GROUP_BYTES, group_of

HINT = ("not this key's blob: the store was written to outside cwm, or a bug; a read takes it "
        "for a miss (the block is recomputed)")
REVISIONS_KEPT = 100_000


def opened(blob: bytes, key: bytes, cipher: crypto.BlobCipher | None, *,
           content: bytes | None = None, revisions: Revisions | None = None) -> bytes:
    """The plain blob of ``blob``, read under ``key``, once it is found to be that key's.
    ``cipher``: the request salt's when the store encrypts at rest, else None (a sealed blob
    is then returned as it is: decoding calls it incompatible). ``content``: the content
    identity the reader expects of a KV block; ``revisions``: the store's newest revisions."""
    meta = container.peek(blob, verify=True)
    check(meta, key, encrypted=cipher is not None, content=content)
    plain = blob if cipher is None else crypto.unseal(blob, cipher)  # authenticates the header
    if revisions is not None and (revision := revisions.check(meta, key)):
        revisions.saw(key, revision)
    return plain


def check(meta: dict[str, str], key: bytes, *, encrypted: bool,
          content: bytes | None = None) -> None:
    """Raise :class:`RefusedBlob` unless a blob with header ``meta`` may stand under ``key``
    (read, or stored as it is: ``put_blob``) in a store that does or does not ``encrypt``,
    for a reader that expects ``content`` (see the module docstring)."""
    if encrypted and not crypto.is_sealed(meta):
        raise RefusedBlob(f"the blob for key {key.hex()[:16]} is not sealed, and the store "
                          "encrypts at rest", reason="plaintext", hint=HINT)
    own = _key_of(meta)
    if group_of(own) != group_of(key):
        raise RefusedBlob(f"a blob of key group {group_of(own).hex()} is not key group "
                          f"{group_of(key).hex()}'s (another namespace or rank)",
                          reason="foreign_group", hint=HINT)
    if own == key:
        return
    if encrypted:
        raise RefusedBlob(f"a blob sealed for block {own[GROUP_BYTES:].hex()[:16]} is not "
                          f"block {key[GROUP_BYTES:].hex()[:16]}'s (key group "
                          f"{group_of(key).hex()})", reason="foreign_key",
                          hint=HINT + "; a copy for a new key is sealed for it (seal(..., key=))")
    if content is not None and meta.get("content", bytes(content).hex()) == bytes(content).hex():
        return       # a window's blob: the same tokens, another salt (or saved naming none)
    raise RefusedBlob(f"a blob saved for block {own[GROUP_BYTES:].hex()[:16]} (content "
                      f"{meta.get('content', 'none')[:16]}) is not block "
                      f"{key[GROUP_BYTES:].hex()[:16]}'s (content "
                      f"{bytes(content).hex()[:16] if content is not None else 'its own'})",
                      reason="foreign_key", hint=HINT)


class Binding:
    """What one store binds its blobs with: the ciphers of encryption at rest (none without
    it) and the revisions of the rewritten records it read or wrote."""

    def __init__(self, encryption_key: str | None) -> None:
        self.ciphers = (crypto.Ciphers(crypto.parse_master_key(encryption_key))
                        if encryption_key else None)
        self.revisions = Revisions()

    @property
    def encrypted(self) -> bool:
        return self.ciphers is not None

    def cipher(self, salt: str | None) -> crypto.BlobCipher | None:
        """The cipher of ``salt``'s blobs; None when the store does not encrypt."""
        return self.ciphers.for_salt(salt) if self.ciphers is not None else None


class Revisions:
    """The newest revision of each rewritten record this process read or wrote (the last
    ``size`` keys): a rewrite gets a newer one, a read of an older one is refused."""

    def __init__(self, size: int = REVISIONS_KEPT) -> None:
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def next(self, key: bytes) -> int:
        """The revision of a rewrite of ``key``: now in nanoseconds, past any seen for it (the
        writer calls :meth:`saw` once it is stored)."""
        with self._lock:
            return max(time.time_ns(), self._seen.get(bytes(key), 0) + 1)

    def check(self, meta: dict[str, str], key: bytes) -> int:
        """The blob's revision (0: none); :class:`RefusedBlob` when it is older than one seen
        for ``key``."""
        raw = meta.get("revision")
        with self._lock:
            seen = self._seen.get(bytes(key), 0)
        if raw is None and not seen:
            return 0
        try:
            revision = int(raw) if raw is not None else 0
        except ValueError as exc:
            raise CorruptBlob(f"blob revision {raw[:24]!r} is not a number",
                              hint="damaged blob; the record is read as missing") from exc
        if revision < seen:
            raise RefusedBlob(f"record {bytes(key).hex()[:16]} is revision {revision}, older "
                              f"than revision {seen} read or written before", reason="replayed",
                              hint="a stale copy (a local tier another server's rewrite did "
                                   "not reach), an older version written back outside cwm, or "
                                   "a server whose clock is behind; read as missing")
        return revision

    def saw(self, key: bytes, revision: int) -> None:
        with self._lock:
            if revision > self._seen.get(bytes(key), 0):
                self._note(bytes(key), revision)

    def _note(self, key: bytes, revision: int) -> None:
        """(locked)"""
        self._seen[key] = revision
        self._seen.move_to_end(key)
        while len(self._seen) > self._size:
            self._seen.popitem(last=False)


def _key_of(meta: dict[str, str]) -> bytes:
    try:
        return bytes.fromhex(meta["key"])
    except (KeyError, ValueError) as exc:
        raise CorruptBlob("blob header names no readable key",
                          hint="damaged blob; the block will be recomputed") from exc
