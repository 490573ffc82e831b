"""Property tests of the window file parser and the manifest validator (hypothesis): arbitrary
bytes are a ``bad_window_file`` or a checked file, never another error; a file whose manifest
fields are arbitrary JSON is imported whole -- and then lists, shows, thaws and exports like
any window -- or refused with a client error, pinning and writing nothing. Over a real disk
store with a served model; the same through the sidecar's HTTP route is in
tests/sidecar/windows/test_window_imports_unit.py."""

from __future__ import annotations

import contextlib
import io
import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from window_helpers import BS, NS, converse, rewritten, serve

from cwm_plugin.errors import CWMError
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.windows.engine import WindowEngine
from cwm_plugin.windows.model import Manifest
from cwm_plugin.windows.portable import export_window, import_window
from cwm_plugin.windows.window_file import MAGIC, BadWindowFile, check_file

pytestmark = pytest.mark.unit
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
    | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = sorted({*Manifest.__dataclass_fields__, "signature", "x"})
GONE = object()
SETTINGS = settings(deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def header_file(header: object) -> bytes:
    raw = json.dumps(header).encode()
    return MAGIC + struct.pack(">Q", len(raw)) + raw


def mutate(changes: list[tuple[str, object]], blobs: list[tuple[str, object]]):
    """A header change: each manifest field set (or removed), each blob field set."""
    def change(h: dict) -> None:
        for k, v in changes:
            if v is GONE:
                h["manifest"].pop(k, None)
            else:
                h["manifest"][k] = v
        for k, v in blobs:
            h["blobs"][0][k] = v
    return change


CHANGES = st.lists(st.tuples(st.sampled_from(FIELDS), JSON | st.just(GONE)), min_size=1,
                   max_size=3)
BLOB_CHANGES = st.just([]) | st.just([]) | st.just([]) | st.lists(st.tuples(
    st.sampled_from(["worker", "block", "size", "sha256", "x"]), JSON), max_size=1)


@SETTINGS
@given(data=st.binary(max_size=2048) | st.binary(max_size=300).map(lambda b: MAGIC + b)
       | JSON.map(header_file) | JSON.map(lambda h: header_file(h) + bytes(32)))
def test_the_parser_answers_any_bytes_with_bad_window_file(data):
    with contextlib.suppress(BadWindowFile):
        check_file(io.BytesIO(data))
    with contextlib.suppress(BadWindowFile):
        check_file(io.BytesIO(data), b"k" * 32)


@pytest.fixture
def served(tmp_path):
    store = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0),
                    registry=CollectorRegistry())
    converse(store, "s", 3 * BS + 5)
    serve(store, NS)
    eng = WindowEngine(store, wait_s=0)
    eng.freeze("acme", "w", session="x", salt="s", tags=["t"], turn=None,
               messages=[{"role": "user", "content": "hi"}])
    buf = io.BytesIO()
    export_window(eng, "acme", "w", buf)
    yield eng, buf.getvalue()
    store.close()


def keys_in(store: KVStore) -> int:
    return sum(len(v) for v in store.list_keys(limit=100_000).values())


def test_any_manifest_is_imported_whole_or_refused_pinning_nothing(served):
    eng, good = served
    store = eng.store

    @settings(SETTINGS, max_examples=150)
    @given(changes=CHANGES, blobs=BLOB_CHANGES, rename=st.booleans())
    def run(changes, blobs, rename) -> None:
        data = rewritten(good, mutate(changes, blobs))
        before = keys_in(store)
        try:
            m = import_window(eng, "mallory", io.BytesIO(data), "copy" if rename else None)
        except CWMError as exc:
            assert exc.http_status < 500, repr(exc)
            assert keys_in(store) == before
            assert eng.list("mallory") == ([], 0)
            return
        # taken whole: it is a window like any other
        assert m.stored_bytes > 0 and eng.tenant_bytes("mallory") == m.stored_bytes
        assert [w.public()["name"] for w in eng.list("mallory")[0]] == [m.name]
        assert eng.status("mallory", m.name)["restorable_blocks"] == m.num_blocks
        assert eng.thaw("mallory", m.name, session="y", salt="t").blocks == m.num_blocks
        export_window(eng, "mallory", m.name, io.BytesIO())
        eng.delete("mallory", m.name)

    run()


def test_the_manifest_validator_checks_every_field() -> None:
    """A field added to the manifest without a rule would be imported unchecked."""
    import dataclasses

    from cwm_plugin.windows.model import _fields

    m = Manifest(name="w", tenant="t", session="s", frozen_salt="", window_salt="x",
                 tokens=[], block_size=16, hash_block_size=16, hash_algo="sha256",
                 workers=[("0" * 64, 0)])
    assert set(_fields(m, keyed=True)) == {f.name for f in dataclasses.fields(Manifest)}
