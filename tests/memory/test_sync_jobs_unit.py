"""The look for other writers off a selection's path: background jobs, and a scan taken
before the folder's lock that never drops a session written after it."""

from __future__ import annotations

import threading
import time

import pytest

from cwm_plugin.memory.service.background import FolderJobs

pytestmark = pytest.mark.unit

ASK = [{"role": "user", "content": "walrus"}]


def test_one_job_a_folder_at_a_time_and_a_failing_job_does_not_stop_the_rest(caplog) -> None:
    jobs = FolderJobs()
    gate, ran = threading.Event(), []

    def slow(folder: str) -> None:
        gate.wait(10)
        ran.append((folder, threading.current_thread().name))

    assert jobs.soon("acme", slow)
    assert not jobs.soon("acme", slow)  # queued already: not twice
    assert jobs.soon("globex", lambda t: 1 / 0)  # another folder queues beside it
    gate.set()
    deadline = time.monotonic() + 10
    while jobs.soon("acme", lambda t: ran.append((t, "again"))) is False:
        assert time.monotonic() < deadline  # queued again once the first one finished
        time.sleep(0.01)
    assert jobs.idle(10)
    jobs.close()  # waits for what is queued
    assert ran[0][0] == "acme" and ran[0][1].startswith("cwm-memory-sync")
    assert ran[-1] == ("acme", "again")
    assert "background job for folder globex failed" in caplog.text
    assert not jobs.soon("acme", slow)  # closed


def test_a_selection_leaves_a_due_look_for_other_writers_to_the_background(new_service,
                                                                           monkeypatch) -> None:
    svc = new_service(sync_interval_s=0.05)
    svc.record_turn("acme", "s", "user", "warm up the index")
    svc.select_context("acme", None, ASK, 200, bump=False, mode="bm25")
    assert svc.syncs.idle(10)  # a look the warm-up found due is over before Olga is written
    other = new_service(root=svc.config.root)  # another process writing the same folder
    other.record_turn("acme", "t", "user", "a walrus named Olga")
    scans: list[str] = []
    real, gate = svc.files.session_stats, threading.Event()

    def scan(folder: str):
        scans.append(threading.current_thread().name)
        gate.wait(10)  # the look holds until the request's selection is done (no race)
        return real(folder)

    monkeypatch.setattr(svc.files, "session_stats", scan)
    time.sleep(0.06)  # the look is due
    first = svc.select_context("acme", None, ASK, 200, bump=False, mode="bm25")
    gate.set()
    assert "Olga" not in first.memory_block  # not looked for on the request's path ...
    svc.syncs.close()  # ... but in the background: wait for it
    assert scans and all(name.startswith("cwm-memory-sync") for name in scans)
    assert "Olga" in svc.select_context("acme", None, ASK, 200, bump=False,
                                        mode="bm25").memory_block


def test_every_selection_looks_first_with_no_interval(new_service) -> None:
    svc = new_service(sync_interval_s=0.0)  # the CLI's setting
    svc.record_turn("acme", "s", "user", "warm up the index")
    svc.select_context("acme", None, ASK, 200, bump=False, mode="bm25")
    new_service(root=svc.config.root).record_turn("acme", "t", "user", "a walrus named Olga")
    assert "Olga" in svc.select_context("acme", None, ASK, 200, bump=False,
                                        mode="bm25").memory_block


def test_a_scan_taken_before_the_lock_never_drops_a_session_written_after_it(
        new_service) -> None:
    svc = new_service(sync_interval_s=0.0)
    svc.record_turn("acme", "old", "user", "the mauve canoe")
    svc.index("acme")
    (svc.files.folder_dir("acme") / "sessions" / "old.md").unlink()  # a session goes
    stats = svc.files.session_stats("acme")  # taken without the lock ...
    svc.record_turn("acme", "new", "user", "the teal kayak")  # ... then one appears
    with svc.lock("acme"):
        idx = svc.indexes.refresh("acme", stats)
    assert set(idx.sessions) == {"new"}  # the new one kept, the removed one dropped


def test_warm_centroids_computes_every_chunk_centroid_once(new_service) -> None:
    import numpy as np

    svc = new_service(chunk_tokens=40, chunk_overlap=8)
    for i in range(30):
        svc.record_turn("acme", "s", "user", f"note {i} about the canoe number {i}")
    idx = svc.index("acme")
    idx._centroids.clear()
    assert idx.warm_centroids() == len(idx.chunks) > 3
    assert idx.warm_centroids() == 0
    cid = next(iter(idx.chunks))
    mean = idx.vectors[idx.chunk_labels[cid]].mean(0)
    np.testing.assert_allclose(idx.doc_vector(cid), mean / np.linalg.norm(mean), rtol=1e-6)
