"""What binds a stored blob to the key it is read under: checked on every read, before decoding.

Anyone who can write to the disk store or the Redis can point key A at key B's blob, or put
other bytes under A's blob. The blob's own header names the key it was saved for, so the reader
compares it with the key it asked for:

* Blobs are content-addressed and shared between keys on purpose: a context window's keys (a
  window salt, a thawed session's salt: other vLLM block hashes) point at the blobs the session
  saved, with no copy (:meth:`~cwm_plugin.store.key_ops.KeySpace.link_many`). So a plain
  blob's key may differ from the key read in its block-hash part, but never in its *group* (the
  first :data:`~cwm_plugin.store.tiers.base.GROUP_BYTES` bytes: namespace digest and TP rank):
  a blob of another model scope or rank is refused (``foreign_group``).
* With encryption at rest a blob is sealed for exactly one key and salt: the key named in its
  clear header, which the AEAD authenticates with the rest of the header, must be the key read
  (``foreign_key``), its key id the request salt's (``foreign_salt``), and it must be sealed at
  all (``plaintext``: anyone could have written it). A window's re-key re-seals a copy for each
  new key (:meth:`~cwm_plugin.store.blob.crypto.BlobCipher.seal` with ``key``).

A refusal raises :class:`~cwm_plugin.errors.RefusedBlob` with its reason; the store counts it
(``errors{kind="refused_<reason>"}``), logs it once and serves a miss: the block is recomputed.
A damaged header is :class:`~cwm_plugin.errors.CorruptBlob` instead (quarantined).

What this cannot catch: without encryption, someone who can write the store can also forge a
blob naming the right key (these checks stop confusion across namespaces and ranks, not
forgery); with it, bytes the same key held before under the same salt and master key (a block's
KV is determined by its key, but an older version of a rewritten record, a context record or a
window manifest, reads as valid).
"""

from __future__ import annotations

from cwm_plugin.errors import CorruptBlob, RefusedBlob
from cwm_plugin.store.blob import container, crypto
from cwm_plugin.store.tiers.base import GROUP_BYTES, group_of

HINT = ("not this key's blob: the store was written to outside cwm, or a bug; a read takes it "
        "for a miss (the block is recomputed)")


def opened(blob: bytes, key: bytes, cipher: crypto.BlobCipher | None) -> bytes:
    """The plain blob of ``blob``, read under ``key``, once it is found to be that key's.
    ``cipher``: the request salt's when the store encrypts at rest, else None (a sealed blob
    is then returned as it is: decoding calls it incompatible)."""
    meta = container.peek(blob, verify=True)
    check(meta, key, encrypted=cipher is not None)
    return blob if cipher is None else crypto.unseal(blob, cipher)


def check(meta: dict[str, str], key: bytes, *, encrypted: bool) -> None:
    """Raise :class:`RefusedBlob` unless a blob with header ``meta`` may stand under ``key``
    (read, or stored as it is: ``put_blob``) in a store that does or does not ``encrypt``."""
    if encrypted and not crypto.is_sealed(meta):
        raise RefusedBlob(f"the blob for key {key.hex()[:16]} is not sealed, and the store "
                          "encrypts at rest", reason="plaintext", hint=HINT)
    own = _key_of(meta)
    if group_of(own) != group_of(key):
        raise RefusedBlob(f"a blob of key group {group_of(own).hex()} is not key group "
                          f"{group_of(key).hex()}'s (another namespace or rank)",
                          reason="foreign_group", hint=HINT)
    if encrypted and own != key:
        raise RefusedBlob(f"a blob sealed for block {own[GROUP_BYTES:].hex()[:16]} is not "
                          f"block {key[GROUP_BYTES:].hex()[:16]}'s (key group "
                          f"{group_of(key).hex()})", reason="foreign_key",
                          hint=HINT + "; a copy for a new key is sealed for it (seal(..., key=))")


def _key_of(meta: dict[str, str]) -> bytes:
    try:
        return bytes.fromhex(meta["key"])
    except (KeyError, ValueError) as exc:
        raise CorruptBlob("blob header names no readable key",
                          hint="damaged blob; the block will be recomputed") from exc
