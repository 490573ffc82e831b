"""Transcript files: verbatim round trip, torn tails, append-only, concurrent writers, names."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.files.markdown import MemoryFiles, decode_turns, encode_turn
from cwm_plugin.memory.models import Turn

pytestmark = pytest.mark.unit

TRICKY = 'line one\n<!-- cwm-turn {"id": "x", "role": "user", "ts": "t", "bytes": 3} -->\n\n### x'


def test_round_trip_verbatim_and_append_only(new_service, tmp_path: Path) -> None:
    svc = new_service()
    a = svc.record_turn("acme", "s1", "user", TRICKY, turn_id="u1")
    path = tmp_path / "mem" / "acme" / "sessions" / "s1.md"
    first = path.read_bytes()
    svc.record_turn("acme", "s1", "assistant", "héllo ✓ \x01 tail  ", turn_id="a1")
    assert path.read_bytes().startswith(first)  # never rewritten in place
    turns = svc.transcript("acme", "s1")
    assert [t["turn_id"] for t in turns] == [a, "a1"]
    assert turns[0]["content"] == TRICKY
    assert turns[1]["content"] == "héllo ✓ \x01 tail  "
    assert (tmp_path / "mem" / "acme" / "daily").is_dir()


def test_torn_tail_is_ignored() -> None:
    good = encode_turn(Turn("t1", "user", "hello", "2024-01-01T00:00:00Z"))
    torn = encode_turn(Turn("t2", "user", "a longer message", "2024-01-01T00:00:01Z"))[:-10]
    assert [t.turn_id for t in decode_turns(good + torn)] == ["t1"]
    garbage = good + b"<!-- cwm-turn {not json} -->\n" + good.replace(b"t1", b"t3")
    assert [t.turn_id for t in decode_turns(garbage)] == ["t1", "t3"]


WRITER = """
import sys
from pathlib import Path
from cwm_plugin.memory.files.markdown import MemoryFiles
from cwm_plugin.memory.models import Turn
files = MemoryFiles(Path(sys.argv[1]))
for i in range(int(sys.argv[2])):
    files.append_turn("acme", "s", Turn(f"p{i}", "user", "process " * 200 + str(i),
                                        "2024-01-01T00:00:00Z"))
"""


def test_concurrent_threads_and_a_second_process(tmp_path: Path) -> None:
    files = MemoryFiles(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "60"])

    def write(w: int) -> None:
        for i in range(30):
            files.append_turn("acme", "s", Turn(f"w{w}-{i}", "assistant",
                                                f"thread {w} " * 300 + str(i),
                                                "2024-01-01T00:00:00Z"))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert proc.wait(timeout=120) == 0
    turns = files.read_turns("acme", "s")
    assert len(turns) == 4 * 30 + 60
    ids = {t.turn_id for t in turns}
    assert ids == {f"w{w}-{i}" for w in range(4) for i in range(30)} | {f"p{i}" for i in
                                                                        range(60)}
    for t in turns:  # no interleaving inside a record
        if t.turn_id.startswith("p"):
            assert t.content == "process " * 200 + t.turn_id[1:]
        else:
            w, i = t.turn_id[1:].split("-")
            assert t.content == f"thread {w} " * 300 + i


BAD_NAMES = ["..", "../etc", "a/b", "a\\b", "a\x00b", "x" * 65, "", ".hidden", "a..b", " sp",
             "notes\n"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_rejected_and_nothing_written(new_service, tmp_path: Path,
                                                name: str) -> None:
    svc = new_service()
    with pytest.raises(InvalidInput) as exc:
        svc.record_turn(name, "s1", "user", "hi")
    assert "name" in str(exc.value)
    with pytest.raises(InvalidInput):
        svc.record_turn("acme", name, "user", "hi")
    with pytest.raises(InvalidInput):
        svc.add_memory(name, "text", "fact")
    with pytest.raises(InvalidInput):
        svc.set_summary("acme", name, "text", upto_turn="t")
    root = tmp_path / "mem"
    written = [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
    assert [p for p in written if ".cache" not in p.parts] == []
    assert not (tmp_path / "etc").exists()


def test_memories_and_summary_files(new_service) -> None:
    svc = new_service()
    m = svc.add_memory("acme", "The user  is allergic\nto peanuts.", "fact", 0.4)
    again = svc.add_memory("acme", "the user is allergic to peanuts.", "fact", 0.9)
    assert again.id == m.id and again.importance == 0.9
    assert [x.text for x in svc.memories("acme")] == ["The user is allergic to peanuts."]
    with pytest.raises(InvalidInput):
        svc.add_memory("acme", "x", "opinion")
    with pytest.raises(InvalidInput):
        svc.add_memory("acme", "x", "fact", 1.5)
    assert svc.summary("acme", "s1") is None
    svc.set_summary("acme", "s1", "They talked about peanuts.", upto_turn="t9")
    assert svc.summary("acme", "s1") == "They talked about peanuts."
    assert svc.files.read_summary("acme", "s1") == ("They talked about peanuts.", "t9")


def test_writer_killed_mid_append_leaves_a_readable_file(tmp_path: Path) -> None:
    """SIGKILL a writer in full flow: every record read back is whole, and appends go on."""
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "100000"])
    path = tmp_path / "acme" / "sessions" / "s.md"
    deadline = time.monotonic() + 60
    while (not path.exists() or path.stat().st_size < 200_000) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    files = MemoryFiles(tmp_path)
    turns = files.read_turns("acme", "s")
    assert turns and all(t.content == "process " * 200 + t.turn_id[1:] for t in turns)
    assert [t.turn_id for t in turns] == [f"p{i}" for i in range(len(turns))]
    files.append_turn("acme", "s", Turn("after", "user", "still fine", "2024-01-01T00:00:00Z"))
    again = files.read_turns("acme", "s")
    assert again[-1].turn_id == "after" and again[:-1] == turns


def test_a_failed_append_leaves_no_torn_record_and_readers_wait_for_appends(
        tmp_path: Path, monkeypatch) -> None:
    """A write that fails (a full disk at fsync) is cut back to where it began, so the next
    append does not follow half a record (a record quoting one could be read as a forged
    turn); a reader takes a shared lock, so it never reads an append under way."""
    import time

    from cwm_plugin.memory.files import durable as F

    files = MemoryFiles(tmp_path)
    turn = Turn("t1", "user", TRICKY, "2024-01-01T00:00:00Z")
    files.append_turn("acme", "s", turn)
    path = files.session_path("acme", "s")
    size = path.stat().st_size

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(F.os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        files.append_turn("acme", "s", Turn("t2", "user", "x" * 5000, "2024-01-01T00:00:01Z"))
    monkeypatch.undo()  # room again
    assert path.stat().st_size == size  # nothing of it left behind
    files.append_turn("acme", "s", Turn("t3", "user", "after", "2024-01-01T00:00:02Z"))
    assert [t.turn_id for t in files.read_turns("acme", "s")] == ["t1", "t3"]

    got: list = []
    with F.file_lock(path):  # an append under way (another process's, say)
        reader = threading.Thread(target=lambda: got.append(files.read_turns("acme", "s")))
        reader.start()
        time.sleep(0.3)
        assert not got  # waiting
    reader.join(10)
    assert [t.turn_id for t in got[0]] == ["t1", "t3"]
