"""Optional encryption at rest: AES-256-GCM per blob, a key per ``cache_salt``.

The key of a blob is ``HKDF-SHA256(master key, info)``: for a salt, ``info`` is
``"cwm-kv-blob-v1\\0"`` + the salt's UTF-8; no salt (None) and the empty salt each have their
own (:func:`_info`). A stored block is unreadable without the salt of the request that saved it
(and the master key). A sealed blob stays a cwm safetensors container: its header keeps what
the store needs without the key (the store key, fingerprint, layout, shape, token count) plus
the cipher, a key id (``sha256("cwm-key-id" + key)[:8]``, never the key) and the nonce; the
inner blob's header and payload are the ciphertext's associated data and plaintext, so the
store key in the clear header is authenticated: a sealed blob belongs to that one key
(:mod:`.binding` checks it on every read), and so is a rewritten record's ``revision`` (an
older one is refused once a newer was seen). A blob sealed under another key is
:class:`RefusedBlob` (a miss, recomputed); a blob whose tag fails under its own key is
:class:`CorruptBlob`. The master key is never logged.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
import threading
from collections import OrderedDict

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from cwm_plugin.errors import ConfigError, CorruptBlob, IncompatibleBlob, RefusedBlob
from cwm_plugin.store.blob import container

CIPHER = "aes-256-gcm"
INFO = b"cwm-kv-blob-v1\0"                  # + a salt's UTF-8
NO_SALT_INFO = b"cwm-kv-blob-v2:no-salt"     # neither starts with INFO: no salt's info is theirs
EMPTY_SALT_INFO = b"cwm-kv-blob-v2:empty-salt"
_CLEAR = ("format", "format_version", "fingerprint", "layout", "key", "num_tokens", "dtype",
          "shape", "revision")


def parse_master_key(text: str) -> bytes:
    """A 32-byte key from 64 hex characters or base64 (the key itself is never echoed)."""
    t = text.strip()
    try:
        raw = bytes.fromhex(t) if len(t) == 64 else base64.b64decode(t, validate=True)
    except ValueError as exc:
        raise ConfigError("store setting encryption_key is neither hex nor base64",
                          hint="give 32 random bytes as 64 hex characters, e.g. "
                               "`openssl rand -hex 32`") from exc
    if len(raw) != 32:
        raise ConfigError(f"store setting encryption_key has {len(raw)} bytes, not 32",
                          hint="give 32 random bytes as 64 hex characters")
    return raw


class BlobCipher:
    """AES-256-GCM under one derived key."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self.key_id = hashlib.sha256(b"cwm-key-id" + key).hexdigest()[:16]

    @classmethod
    def derive(cls, master: bytes, salt: str | None) -> BlobCipher:
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_info(salt))
        return cls(hkdf.derive(master))

    def seal(self, blob: bytes, *, key: bytes | None = None) -> bytes:
        """``blob`` sealed for ``key`` (default: the key it was encoded for): the clear header
        names it and the tag covers it, so it opens for that key only. A window's block copied
        to a new key passes the new key; its inner blob is kept as it is."""
        meta, _, start = container.read_header(blob)
        inner = bytes(memoryview(blob)[8:start]).decode()
        sealed = {k: meta[k] for k in _CLEAR if k in meta}
        if key is not None:
            sealed["key"] = bytes(key).hex()
        sealed.update(sealed=CIPHER, key_id=self.key_id, nonce=os.urandom(12).hex(),
                      inner=inner)
        ct = self._aead.encrypt(bytes.fromhex(sealed["nonce"]), memoryview(blob)[start:],
                                _aad(sealed))
        return container.pack_raw(sealed, ct)

    def open(self, meta: dict[str, str], payload: memoryview) -> bytes:
        try:
            plain = self._aead.decrypt(bytes.fromhex(meta["nonce"]), payload, _aad(meta))
        except (InvalidTag, ValueError, KeyError) as exc:
            raise CorruptBlob("sealed blob failed its authentication tag",
                              hint="the stored bytes are damaged; the block will be "
                                   "recomputed") from exc
        inner = meta["inner"].encode()
        return struct.pack("<Q", len(inner)) + inner + plain


def _info(salt: str | None) -> bytes:
    """HKDF info of ``salt``: one per salt, with None and "" apart."""
    if salt is None:
        return NO_SALT_INFO
    return INFO + salt.encode() if salt else EMPTY_SALT_INFO


def _aad(meta: dict[str, str]) -> bytes:
    return json.dumps({k: v for k, v in meta.items() if k != "meta_crc"},
                      sort_keys=True).encode()


def is_sealed(meta: dict[str, str]) -> bool:
    return "sealed" in meta


def unseal(blob: bytes, cipher: BlobCipher | None) -> bytes:
    """The plain blob of ``blob`` (returned as is when it is not sealed)."""
    meta, _, start = container.read_header(blob)
    if not is_sealed(meta):
        return blob
    if meta.get("sealed") != CIPHER:
        raise IncompatibleBlob(f"blob sealed with unknown cipher {meta.get('sealed')!r}")
    if cipher is None or meta.get("key_id") != cipher.key_id:
        raise RefusedBlob("blob is encrypted under another cache_salt or master key",
                          reason="foreign_salt",
                          hint="only the request's own salt opens it; recomputed")
    return cipher.open(meta, memoryview(blob)[start:])


class Ciphers:
    """Derived ciphers per salt (a small LRU: HKDF is cheap but not free on every block)."""

    def __init__(self, master: bytes, size: int = 1024) -> None:
        self._master = master
        self._size = size
        self._cache: OrderedDict[str | None, BlobCipher] = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "Ciphers(<master key hidden>)"

    def for_salt(self, salt: str | None) -> BlobCipher:
        with self._lock:
            c = self._cache.get(salt)
            if c is not None:
                self._cache.move_to_end(salt)
                return c
        c = BlobCipher.derive(self._master, salt)
        with self._lock:
            self._cache[salt] = c
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return c
