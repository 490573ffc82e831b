"""Portable windows over real disk stores: export on one, import into a fresh one, thaw; a
damaged, truncated or foreign file is refused before anything is written."""

from __future__ import annotations

import io
from dataclasses import asdict

import pytest
import torch
from prometheus_client import CollectorRegistry
from window_helpers import BS, NS, block, converse, rewritten, serve, session_blocks

from cwm_plugin.errors import AlreadyExists
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.windows.engine import WindowEngine
from cwm_plugin.windows.portable import BadWindowFile, export_window, import_window

pytestmark = pytest.mark.unit
KEY = "11" * 32


def open_store(path, **kw) -> KVStore:
    return KVStore(StoreConfig(disk_path=str(path), memory_bytes=0, **kw),
                   registry=CollectorRegistry())


def keys_in(store: KVStore) -> int:
    return sum(len(v) for v in store.list_keys(limit=100_000).values())


@pytest.mark.parametrize("encrypted", [False, True])
def test_export_import_thaw_restores_the_same_blocks(tmp_path, encrypted):
    enc = {"encryption_key": KEY} if encrypted else {}
    a, b = open_store(tmp_path / "a", **enc), open_store(tmp_path / "b", **enc)
    tokens = converse(a, "s", 4 * BS + 3)
    WindowEngine(a).freeze("acme", "trip", session="x", salt="s", tags=["t"],
                           messages=[{"role": "user", "content": "hi"}])
    buf = io.BytesIO()
    summary = export_window(WindowEngine(a), "acme", "trip", buf)
    assert summary["bytes"] == len(buf.getvalue()) and summary["blocks"] == 4
    assert b"cwm-window:" not in buf.getvalue() and b'"s"' not in buf.getvalue()  # no salts
    serve(b, NS)
    eng = WindowEngine(b)
    m = import_window(eng, "beta", io.BytesIO(buf.getvalue()), "trip-copy")
    assert m.name == "trip-copy" and m.tags == ["t"] and m.messages[0]["content"] == "hi"
    with pytest.raises(AlreadyExists):
        import_window(eng, "beta", io.BytesIO(buf.getvalue()), "trip-copy")
    r = eng.thaw("beta", "trip-copy", session="y", salt="salt-y")
    assert r.restorable_tokens == 4 * BS
    for rank, got in enumerate(session_blocks(b, tokens, "salt-y", 4, sealed=encrypted)):
        assert all(torch.equal(t, block(i, rank)) for i, t in enumerate(got))
    a.close()
    b.close()


def exported(store: KVStore, blocks: int) -> bytes:
    """The export file of acme's window "trip" of ``blocks`` blocks frozen on ``store``."""
    converse(store, "s", blocks * BS)
    WindowEngine(store).freeze("acme", "trip", session="x", salt="s")
    buf = io.BytesIO()
    export_window(WindowEngine(store), "acme", "trip", buf)
    return buf.getvalue()


def test_damaged_truncated_and_foreign_files_are_refused_and_nothing_is_written(tmp_path):
    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    good = exported(a, 3)
    eng = WindowEngine(b)
    before = keys_in(b)
    with pytest.raises(BadWindowFile, match="no vLLM using this store serves model 'tiny'"):
        import_window(eng, "acme", io.BytesIO(good))
    serve(b, {**NS, "dtype": "bfloat16"})          # the same model name, another KV dtype
    with pytest.raises(BadWindowFile, match="another model or KV layout.*dtype"):
        import_window(eng, "acme", io.BytesIO(good))
    serve(b, NS)
    before = keys_in(b)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    cases = {"damaged": bytes(flipped), "truncated": good[:-100], "trailing": good + b"x",
             "not ours": b"PK\x03\x04" + good[4:], "empty": b""}
    for what, data in cases.items():
        with pytest.raises(BadWindowFile) as err:
            import_window(eng, "acme", io.BytesIO(data))
        assert err.value.hint or "damaged" in str(err.value) or "truncated" in str(err.value), \
            what
    assert keys_in(b) == before and eng.list("acme")[1] == 0
    assert import_window(eng, "acme", io.BytesIO(good)).num_blocks == 3   # the good one does
    a.close()
    b.close()


def test_the_file_carries_what_a_window_needs_and_no_secret(tmp_path):
    a = open_store(tmp_path / "a")
    converse(a, "s", 2 * BS)
    m = WindowEngine(a).freeze("acme", "w", session="x", salt="s", description="d")
    buf = io.BytesIO()
    export_window(WindowEngine(a), "acme", "w", buf)
    from cwm_plugin.windows.window_file import check_file
    checked = check_file(io.BytesIO(buf.getvalue()))
    man = checked.header.manifest
    assert man["tokens"] == m.tokens and man["namespace"] == asdict(m)["namespace"]
    assert not {"frozen_salt", "window_salt", "window_hashes", "tenant"} & set(man)
    assert len(checked.offsets) == 2 * 2          # two blocks, two TP ranks
    a.close()


def test_a_hostile_file_never_chooses_where_its_keys_land(tmp_path):
    """Workers and fields come from the file: checksums prove nothing about intent."""
    from cwm_plugin.windows.model import tenant_group

    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    converse(a, "s", 3 * BS)
    converse(b, "v", 3 * BS)
    WindowEngine(b).freeze("victim", "theirs", session="x", salt="v")
    WindowEngine(a).freeze("acme", "trip", session="x", salt="s")
    buf = io.BytesIO()
    export_window(WindowEngine(a), "acme", "trip", buf)
    good = buf.getvalue()
    serve(b, NS)
    eng = WindowEngine(b)
    before = keys_in(b)
    victim = tenant_group("victim")

    def aim(h):  # the keys' scope: the victim's window listing
        h["manifest"]["workers"] = [[victim[:16].hex(), int.from_bytes(victim[16:], "big")]]

    hostile = {
        "workers aimed at another tenant's listing": aim,
        "a worker digest of another length": lambda h: h["manifest"].update(
            workers=[["ab", 0], ["ab" * 16, 1]]),
        "a string worker": lambda h: h["blobs"][0].update(worker="0"),
        "a huge size": lambda h: h["blobs"][0].update(size=1 << 40),
        "block_size 0": lambda h: h["manifest"].update(block_size=0),
        "more blocks than tokens": lambda h: h["manifest"].update(num_blocks=99),
        "a duplicated block": lambda h: h["blobs"].__setitem__(1, dict(h["blobs"][0])),
        "a LoRA adapter": lambda h: h["manifest"].update(lora=["x", "/etc"]),
        "a manifest that is a list": lambda h: h.update(manifest=[1]),
    }
    for what, change in hostile.items():
        with pytest.raises(BadWindowFile):
            import_window(eng, "mallory", io.BytesIO(rewritten(good, change)), "w")
        assert keys_in(b) == before, what
    assert [m.name for m in eng.list("victim")[0]] == ["theirs"]
    eng.status("victim", "theirs")
    a.close()
    b.close()


def test_a_sealed_blob_in_a_file_is_refused(tmp_path):
    """An export holds plain blobs: one sealed (under any salt) is no export's."""
    from cwm_plugin.store.blob import crypto
    from cwm_plugin.windows.window_file import check_file, read_blob, write_file

    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    src = io.BytesIO(exported(a, 2))
    checked = check_file(src)
    cipher = crypto.BlobCipher.derive(crypto.parse_master_key(KEY), "any")
    blobs = [(e.worker, e.block, cipher.seal(read_blob(src, checked, i)) if i == 1
              else read_blob(src, checked, i)) for i, e in enumerate(checked.header.blobs)]
    forged = io.BytesIO()
    write_file(forged, checked.header.manifest, iter(blobs))
    serve(b, NS)
    before = keys_in(b)
    with pytest.raises(BadWindowFile, match="block 1 of the window file is sealed"):
        import_window(WindowEngine(b), "acme", io.BytesIO(forged.getvalue()))
    assert keys_in(b) == before
    a.close()
    b.close()
