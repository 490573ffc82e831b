"""Encryption at rest: a block is readable only with the salt it was saved under; a wrong or
missing key is a miss, tampering is corruption, and the master key never shows."""

from __future__ import annotations

import logging

import pytest
import torch

from cwm_plugin.store.blob import codec, container, crypto
from cwm_plugin.store.config import StoreConfig

pytestmark = pytest.mark.unit
KEY = "11" * 32


def test_a_block_opens_only_with_its_salt(make_store, tmp_path, kv_block, caplog):
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0, encryption_key=KEY)
    x = kv_block(1)
    s.put(b"k", x, salt="alice").result()
    with caplog.at_level(logging.DEBUG):
        assert torch.equal(s.get(b"k", salt="alice"), x)
        assert s.get(b"k", salt="mallory") is None          # a miss: recomputed, no crash
        assert s.get(b"k") is None
    assert s.metrics.errors.labels("refused_foreign_salt")._value.get() == 2
    assert s.metrics.errors.labels("corrupt")._value.get() == 0
    assert torch.equal(s.get(b"k", salt="alice"), x)        # never quarantined
    assert KEY not in caplog.text and KEY not in repr(s.config)


def test_the_stored_bytes_hide_the_tensor_and_name_only_a_key_id(make_store, tmp_path,
                                                                 kv_block):
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0, encryption_key=KEY,
                   zstd_level=0)
    x = kv_block(2)
    s.put(b"k", x, salt="alice").result()
    blob = s.get_blob(b"k")
    meta = container.peek(blob)
    assert meta["sealed"] == "aes-256-gcm" and meta["key"] == b"k".hex()
    assert meta["key_id"] == crypto.BlobCipher.derive(bytes.fromhex(KEY), "alice").key_id
    raw = x.view(torch.uint8).numpy().tobytes()
    assert raw[:64] not in blob and KEY not in blob.hex()
    with pytest.raises(Exception, match="encrypted"):
        codec.decode(blob)
    plain = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)   # no key configured
    assert plain.get(b"k", salt="alice") is None


def test_tampered_ciphertext_is_corrupt_and_quarantined(make_store, tmp_path, kv_block):
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0, encryption_key=KEY)
    s.put(b"k", kv_block(3), salt="alice").result()
    path = s.disk.path(s.disk.lookup_many([b"k"])[0])
    data = bytearray(path.read_bytes())
    data[-20] ^= 1
    path.write_bytes(bytes(data))
    assert s.get(b"k", salt="alice") is None
    assert s.metrics.errors.labels("corrupt")._value.get() == 1
    assert s.contains_many([b"k"]) == [False]


def test_a_key_is_32_bytes_of_hex_or_base64():
    import base64

    assert crypto.parse_master_key(KEY) == bytes.fromhex(KEY)
    assert crypto.parse_master_key(base64.b64encode(b"x" * 32).decode()) == b"x" * 32
    StoreConfig(encryption_key=KEY)
    for bad in ("zz" * 32, "11" * 16, "not base64!"):
        with pytest.raises(Exception, match="encryption_key"):
            StoreConfig(encryption_key=bad)


def test_no_salt_and_the_empty_salt_have_keys_of_their_own_and_salts_keep_theirs():
    """HKDF gave None and "" one key (a blob of either opened for the other); a salt's key is
    the one it always had, so salted blobs (and windows' blocks) stay readable."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    master = bytes.fromhex(KEY)
    ids = {s: crypto.BlobCipher.derive(master, s).key_id for s in (None, "", "alice", "\0")}
    assert len(set(ids.values())) == 4
    v1 = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
              info=b"cwm-kv-blob-v1\0alice").derive(master)
    assert ids["alice"] == crypto.BlobCipher(v1).key_id
    cache = crypto.Ciphers(master)
    assert cache.for_salt(None).key_id == ids[None] and cache.for_salt("").key_id == ids[""]
