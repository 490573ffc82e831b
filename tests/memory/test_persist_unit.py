"""The derived index on disk: saved, loaded, kept in step with hand edits, rebuilt when gone."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cwm_plugin.cli import main
from cwm_plugin.memory.index.persist import current_generation, folder_dir
from cwm_plugin.memory.metrics import MemoryMetrics

pytestmark = pytest.mark.unit

TURNS = [
    ("u1", "user", "Our flight to Lisbon leaves at seven, so we pack tonight."),
    ("a1", "assistant", "Pack the passports and the charger for the flight to Lisbon."),
    ("u2", "user", "My gym locker code is ZX-4417, please remember it."),
    ("a2", "assistant", "Noted: locker ZX-4417."),
    ("u3", "user", "Grandma's apple pie recipe needs cinnamon and cold butter."),
    ("a3", "assistant", "Cold butter makes the crust flaky."),
]
QUERIES = ["flight to Lisbon", "locker code", "apple pie butter", "Madrid"]


def fill(svc) -> None:
    for i, (tid, role, text) in enumerate(TURNS):
        svc.record_turn("acme", f"s{i // 4}", role, text, turn_id=tid)


def snapshot(svc) -> list:
    return [[(h.chunk_id, round(h.score, 6), h.turn_ids) for h in svc.search("acme", q, 4)]
            for q in QUERIES]


def test_saved_index_is_loaded_without_indexing_again(new_service) -> None:
    svc = new_service(chunk_tokens=40, chunk_overlap=10)
    fill(svc)
    before = snapshot(svc)
    svc.close()  # saves what changed
    root = svc.config.root
    assert current_generation(root, "acme") is not None
    metrics = MemoryMetrics()
    fresh = new_service(root=root, chunk_tokens=40, chunk_overlap=10, metrics=metrics)
    assert snapshot(fresh) == before
    assert metrics.chunks._value.get() == 0  # nothing chunked or embedded again
    looked_up = sum(metrics.cache.labels(r)._value.get() for r in ("hit", "miss"))
    assert looked_up == len(QUERIES)  # only the queries were embedded


def test_hand_edits_show_in_the_next_search(new_service) -> None:
    svc = new_service(chunk_tokens=40, chunk_overlap=10)
    fill(svc)
    assert svc.search("acme", "Lisbon", 1, mode="bm25")[0].turn_ids[0] in ("u1", "a1")
    path = svc.files.session_path("acme", "s0")
    data = path.read_bytes()
    path.write_bytes(data.replace(b"Lisbon", b"Madrid"))  # same length: records stay valid
    hits = svc.search("acme", "Madrid flight", 2, mode="bm25")
    assert {"u1", "a1"} & {t for h in hits for t in h.turn_ids}
    assert all("Lisbon" not in h.text for h in svc.search("acme", "Lisbon", 5, mode="bm25"))
    # truncated by hand to its first record: the later turns are gone from the index too
    first = data.replace(b"Lisbon", b"Madrid")
    first = first[:first.index(b"\n\n### ") + 2]
    path.write_bytes(first)
    ids = {t for h in svc.search("acme", "locker ZX-4417 code", 5) for t in h.turn_ids}
    assert "u2" not in ids and "a2" not in ids
    # a session file removed by hand drops its chunks
    svc.files.session_path("acme", "s1").unlink()
    assert all(h.source != "session:s1" for h in svc.search("acme", "apple pie", 5))
    # memories.md edited by hand: the memory search sees the new text
    svc.add_memory("acme", "The user's cat is called Biscuit.", "fact", 0.7)
    assert svc.search_memories("acme", "Biscuit cat", 1)[0].text.endswith("Biscuit.")
    mpath = svc.files.memories_path("acme")
    mpath.write_text(mpath.read_text().replace("Biscuit", "Pretzel"))
    hit = svc.search_memories("acme", "Pretzel cat", 1)[0]
    assert hit.source == "memory" and "Pretzel" in hit.text


def test_deleted_index_folder_is_rebuilt_identically(new_service) -> None:
    svc = new_service(chunk_tokens=40, chunk_overlap=10)
    fill(svc)
    svc.close()
    root = svc.config.root
    first = new_service(root=root, chunk_tokens=40, chunk_overlap=10)
    before = snapshot(first)
    shutil.rmtree(root / ".index")
    metrics = MemoryMetrics()
    rebuilt = new_service(root=root, chunk_tokens=40, chunk_overlap=10, metrics=metrics)
    assert snapshot(rebuilt) == before
    assert metrics.chunks._value.get() > 0  # it really was built again from the files
    assert current_generation(root, "acme") is not None  # and saved once built


def test_unusable_or_foreign_index_is_rebuilt(new_service) -> None:
    svc = new_service(chunk_tokens=40, chunk_overlap=10)
    fill(svc)
    svc.close()
    root = svc.config.root
    folder = folder_dir(root, "acme") / current_generation(root, "acme")
    (folder / "sessions.json").write_text("{not json")
    fresh = new_service(root=root, chunk_tokens=40, chunk_overlap=10)
    assert fresh.search("acme", "locker", 1)[0].turn_ids
    # an index saved with other chunk settings is not used either
    other = new_service(root=root, chunk_tokens=80, chunk_overlap=10)
    assert max(c.tokens for c in other.index("acme").chunks.values()) > 40


def test_reindex_elsewhere_is_picked_up_by_a_running_service(new_service) -> None:
    running = new_service(chunk_tokens=40, chunk_overlap=10)
    fill(running)
    running.search("acme", "x", 1)
    other = new_service(root=running.config.root, chunk_tokens=40, chunk_overlap=10)
    other.reindex("acme", progress=False)
    gen = current_generation(running.config.root, "acme")
    running.search("acme", "x", 1)
    assert running.indexes._folders["acme"].generation == gen


def test_cli_reindex_writes_the_index_and_shows_progress(new_service, capsys) -> None:
    svc = new_service(chunk_tokens=40, chunk_overlap=10)
    fill(svc)
    root = svc.config.root
    shutil.rmtree(root / ".index", ignore_errors=True)
    assert main(["memory", "reindex", "--root", str(root), "--embedder", "hashing",
                 "--chunk-tokens", "40", "--chunk-overlap", "10"]) == 0
    out = capsys.readouterr()
    assert "chunks indexed" in out.out
    assert "reindex" in out.err and "2/2" in out.err and "session" in out.err  # tqdm's bar
    gen = current_generation(root, "acme")
    manifest = json.loads((folder_dir(root, "acme") / gen / "manifest.json").read_text())
    assert set(manifest["marks"]) == {"s0", "s1"}
    size = os.path.getsize(svc.files.session_path("acme", "s0"))
    assert manifest["marks"]["s0"]["offset"] == manifest["marks"]["s0"]["size"] == size


def test_index_save_is_atomic_generation_swap(new_service) -> None:
    svc = new_service(chunk_tokens=40, chunk_overlap=10)
    fill(svc)
    svc.reindex("acme", progress=False)
    first = current_generation(svc.config.root, "acme")
    svc.record_turn("acme", "s0", "user", "One more line.", turn_id="u9")
    assert svc.save() == 1
    second = current_generation(svc.config.root, "acme")
    assert second != first
    names = sorted(p.name for p in Path(folder_dir(svc.config.root, "acme")).iterdir()
                   if not p.name.endswith(".lock"))
    assert names == sorted(["CURRENT", second])  # the old generation is gone, no leftovers


def test_concurrent_savers_leave_current_naming_a_whole_generation(new_service) -> None:
    import threading
    import time

    from cwm_plugin.memory.index import persist

    svc = new_service(chunk_tokens=40, chunk_overlap=10)
    fill(svc)
    svc.reindex("acme", progress=False)
    base = Path(folder_dir(svc.config.root, "acme"))
    crashed = base / ".g0-dead.tmp"                # a writer that died mid-save, long ago
    crashed.mkdir()
    os.utime(crashed, (time.time() - 2 * persist.STALE_TMP_S,) * 2)
    young = base / ".g1-busy.tmp"                  # one being written right now
    young.mkdir()
    t = svc.indexes._folders["acme"]
    marks = {s: m.frozen() for s, m in t.marks.items()}

    def saver() -> None:
        for _ in range(5):
            persist.save(t.index, marks, svc.config.root, "acme")

    threads = [threading.Thread(target=saver) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    gen = current_generation(svc.config.root, "acme")
    dirs = sorted(p.name for p in base.iterdir() if p.is_dir())
    assert dirs == sorted([gen, young.name]), dirs  # the stale one went, the young one stays
    metrics = MemoryMetrics()
    fresh = new_service(root=svc.config.root, chunk_tokens=40, chunk_overlap=10,
                         metrics=metrics)
    assert snapshot(fresh) == snapshot(svc)          # and it loads whole:
    assert metrics.chunks._value.get() == 0          # nothing chunked again


def test_an_index_that_cannot_be_saved_is_kept_in_memory_and_counted(new_service, tmp_path,
                                                                     monkeypatch, caplog) -> None:
    """A full disk (or a damaged ``.index``) fails the save of the derived index: requests go
    on with the index in memory (logged once, counted), the half-written generation is
    removed, and the next save that can, does. An explicit reindex still reports it."""
    import numpy as np

    from cwm_plugin.memory.index import persist

    m = MemoryMetrics()
    svc = new_service(chunk_tokens=40, chunk_overlap=10, metrics=m)
    real_save = np.save

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist.np, "save", full_disk)
    fill(svc)  # the first build saves: it fails, the index stays
    assert len(svc.search("acme", "locker code", 2)) == 2
    assert svc.save() == 0 and svc.save() == 0
    degraded = m.degraded.labels("index_save")._value.get()
    assert degraded >= 2 and caplog.text.count("could not be saved") == 1
    assert current_generation(svc.config.root, "acme") is None
    assert not [p for p in folder_dir(svc.config.root, "acme").iterdir()
                if p.name.endswith(".tmp")]  # nothing half-written left behind
    with pytest.raises(OSError, match="No space"):
        svc.reindex("acme", progress=False)
    monkeypatch.setattr(persist.np, "save", real_save)  # room again
    svc.record_turn("acme", "s9", "user", "The boat leaves from pier nine.")
    assert "pier nine" in svc.search("acme", "boat pier", 1)[0].text
    svc.save()
    assert current_generation(svc.config.root, "acme") is not None


def test_a_damaged_embedding_cache_is_started_again_and_failures_are_done_without(
        tmp_path, caplog) -> None:
    import sqlite3

    import numpy as np

    from cwm_plugin.memory.index.embeddings import CachedEmbedder, HashingEmbedder

    m = MemoryMetrics()
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "hashing-384.sqlite").write_bytes(b"this is no database" * 100)
    inner = HashingEmbedder()
    cache = CachedEmbedder(inner, folder, m)  # a bad restore: moved aside, a new one made
    want = inner.embed(["one", "two"])
    np.testing.assert_array_equal(cache.embed(["one", "two"]), want)
    assert [p.name.startswith("hashing-384.sqlite.damaged-") for p in folder.iterdir()
            ].count(True) == 1
    assert cache.embed(["one"]).tolist() == want[:1].tolist()
    assert m.cache.labels("hit")._value.get() == 1
    cache._db.execute("DROP TABLE emb")  # look-ups and writes fail from here on
    np.testing.assert_array_equal(cache.embed(["two", "three"])[0], want[1])
    assert m.degraded.labels("embedding_cache")._value.get() == 3  # open, look-up, write
    assert caplog.text.count("embedding cache") == 1  # logged once
    cache.close()
    with pytest.raises(sqlite3.ProgrammingError):
        cache._db.execute("SELECT 1")  # (closed)


def test_a_turn_stored_while_the_embedder_is_down_is_not_reported_failed(new_service,
                                                                        caplog) -> None:
    """The append is durable before indexing starts: an embedder outage then must not make
    ``record_turn`` raise (a client told "failed" sends the turn again: stored twice). The
    next sync with the files indexes it once the embedder is back."""
    from cwm_plugin.errors import UpstreamError
    from cwm_plugin.memory.index.embeddings import HashingEmbedder

    class Flaky(HashingEmbedder):
        down = False

        def embed(self, texts):
            if self.down:
                raise UpstreamError("embeddings server refused the connection")
            return super().embed(texts)

    m = MemoryMetrics()
    emb = Flaky()
    svc = new_service(emb, metrics=m, sync_interval_s=0)
    svc.record_turn("acme", "s1", "user", "Our flight to Lisbon leaves at seven.")
    emb.down = True
    svc.record_turn("acme", "s1", "user", "My gym locker code is ZX-4417.")  # no raise
    svc.record_turn("acme", "s1", "user", "The locker is on floor three.")
    assert [t["content"] for t in svc.transcript("acme", "s1")] == [
        "Our flight to Lisbon leaves at seven.", "My gym locker code is ZX-4417.",
        "The locker is on floor three."]
    assert m.degraded.labels("indexing")._value.get() == 2  # counted each time, logged once
    assert caplog.text.count("not indexed yet") == 1
    emb.down = False
    hits = svc.search("acme", "gym locker code", 3)
    assert any("ZX-4417" in h.text for h in hits)
    assert sum(h.text.count("ZX-4417") for h in hits[:1]) == 1  # indexed once


def test_a_namespace_that_is_only_read_costs_next_to_nothing(new_service) -> None:
    """Per-user namespaces (``u-<hash>``) are read on every request of a new user and none
    is ever let go, so an empty one must cost next to nothing: no hnswlib index (megabytes of
    label locks alone) and no full-size vector array until a line is written to it."""
    svc = new_service()
    svc.record_turn("acme", "s1", "user", "Our flight to Lisbon leaves at seven.")

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGESIZE")

    ask = [{"role": "user", "content": "When does the flight leave?"}]
    svc.select_context("u-warm", None, ask, 500)
    before = rss()
    for i in range(200):
        assert svc.select_context(f"u-{i:032x}", None, ask, 500).hits == []
    assert (rss() - before) / 200 < 1_000_000  # bytes a namespace
    assert "Lisbon" in svc.select_context("acme", None, ask, 500).memory_block
