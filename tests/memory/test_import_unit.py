"""``cwm memory import`` (OpenAI-messages JSONL, LoCoMo JSON) and ``cwm memory check``, through
the real CLI entry point and the service (hashing embedder, no model)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cwm_plugin.cli import main
from cwm_plugin.memory.index.embeddings import HashingEmbedder
from cwm_plugin.memory.models import MemoryConfig
from cwm_plugin.memory.service.importer import import_sessions, read_conversations
from cwm_plugin.memory.service.service import MemoryService

pytestmark = pytest.mark.unit

LOCOMO = {"sample_id": "conv-1", "conversation": {
    "speaker_a": "Caroline", "speaker_b": "Melanie",
    "session_1_date_time": "1:56 pm on 8 May, 2023",
    "session_1": [{"speaker": "Caroline", "dia_id": "D1:1", "text": "I went to a pottery class."},
                  {"speaker": "Melanie", "dia_id": "D1:2", "text": "Nice! What did you make?"}],
    "session_2_date_time": "10:00 am on 9 May, 2023",
    "session_2": [{"speaker": "Melanie", "dia_id": "D2:1", "text": "We hiked to the lake."}]}}


def write_inputs(tmp_path: Path) -> tuple[Path, Path]:
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("\n".join([
        json.dumps({"session": "trip", "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "My bike is a red Cinelli."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function",
                 "function": {"name": "note", "arguments": "{\"bike\": \"Cinelli\"}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "saved"},
            {"role": "assistant", "content": [{"type": "text", "text": "Noted, a Cinelli."}]}]}),
        "",
        json.dumps([{"role": "user", "content": "Kayak colour: teal."},
                    {"role": "assistant", "content": "Teal it is."}])]) + "\n")
    locomo = tmp_path / "locomo.json"
    locomo.write_text(json.dumps([LOCOMO]))
    return jsonl, locomo


def test_both_formats_are_read(tmp_path: Path) -> None:
    jsonl, locomo = write_inputs(tmp_path)
    convs = list(read_conversations(jsonl))
    assert [c.session for c in convs] == ["trip", "chats-000003"]
    assert [r for r, _ in convs[0].turns] == ["user", "assistant", "tool", "assistant"]
    assert convs[0].turns[1][1] == '[tool call note({"bike": "Cinelli"})]'
    lo = list(read_conversations(locomo))
    assert [(c.session, c.ts) for c in lo] == [("conv-1-s1", "2023-05-08T13:56:00Z"),
                                              ("conv-1-s2", "2023-05-09T10:00:00Z")]
    assert lo[0].turns[0] == ("Caroline", "I went to a pottery class.")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"content": "no role"}]}\n')
    with pytest.raises(Exception, match="bad.jsonl line 1"):
        list(read_conversations(bad))


def test_an_import_indexes_exactly_what_a_rebuild_from_the_files_gives(tmp_path: Path,
                                                                      counter) -> None:
    jsonl, locomo = write_inputs(tmp_path)
    svc = MemoryService(MemoryConfig(root=tmp_path / "mem", chunk_tokens=40, chunk_overlap=8),
                        HashingEmbedder(), counter)
    svc.record_turn("acme", "trip", "user", "Before the import.")
    convs = [*read_conversations(jsonl), *read_conversations(locomo)]
    stats = import_sessions(svc, "acme", convs, progress=False)
    assert (stats.sessions, stats.turns) == (4, 9) and stats.tokens > 0 and stats.chunks > 0
    assert stats.tokens_per_s > 0
    trip = [t["content"] for t in svc.transcript("acme", "trip")]
    assert trip[0] == "Before the import." and trip[1] == "My bike is a red Cinelli."
    assert "pottery" in svc.search("acme", "pottery class", 1, mode="bm25")[0].text
    imported = {c: (ch.text, svc.index("acme").chunk_labels[c])
                for c, ch in svc.index("acme").chunks.items()}
    vectors = svc.index("acme").vectors.copy()
    svc.reindex("acme", progress=False)  # from the files alone
    rebuilt = svc.index("acme")
    assert {c: ch.text for c, ch in rebuilt.chunks.items()} == \
        {c: t for c, (t, _) in imported.items()}
    for c, (_, labels) in imported.items():  # the same line vectors, in the same places
        assert (rebuilt.vectors[rebuilt.chunk_labels[c]] == vectors[labels]).all()
    svc.close()


def test_cli_import_and_check(tmp_path: Path, capsys) -> None:
    jsonl, locomo = write_inputs(tmp_path)
    root = tmp_path / "mem"
    common = ["--root", str(root), "--embedder", "hashing"]
    assert main(["memory", "import", *common, "--tenant", "acme", str(jsonl), str(locomo)]) == 0
    out = capsys.readouterr()
    assert "imported 4 sessions (9 turns" in out.out and "tokens/s" in out.out
    assert "tok" in out.err  # the progress bar
    assert main(["memory", "check", "--root", str(root)]) == 0
    assert "0 problem(s)" in capsys.readouterr().out
    # damage: a memory line, a summary header, garbage in a session file
    (root / "acme" / "memories.md").write_text(
        "# Durable memories\n\n- **fact** (0.50) ok <!-- cwm-mem {\"id\": broken -->\n")
    (root / "acme" / "summaries").mkdir()
    (root / "acme" / "summaries" / "trip.md").write_text("<!-- cwm-summary {oops -->\nText\n")
    with open(root / "acme" / "sessions" / "trip.md", "ab") as fh:
        fh.write(b"garbage typed by hand\n")
    assert main(["memory", "check", "--root", str(root), "--tenant", "acme"]) == 1
    out = capsys.readouterr().out
    assert "acme/memories.md:3: not a valid memory line" in out
    assert "acme/summaries/trip.md:1: damaged summary header" in out
    assert "acme/sessions/trip.md: 22 bytes outside complete turn records" in out
    assert str(tmp_path) not in out  # paths relative to the root
    assert "3 problem(s)" in out


def test_a_pool_of_worker_processes_embeds_like_the_service(tmp_path: Path, counter, minilm,
                                                          monkeypatch) -> None:
    from cwm_plugin.memory.service import importer

    monkeypatch.setattr(importer, "POOL_MIN", 0)  # a pool even for this small import
    jsonl, _ = write_inputs(tmp_path)
    svc = MemoryService(MemoryConfig(root=tmp_path / "mem"), minilm, counter)
    import_sessions(svc, "acme", list(read_conversations(jsonl)), progress=False, workers=2)
    idx = svc.index("acme")
    here = np.concatenate([idx.embed_units(None, st.units) for st in idx.sessions.values()])
    assert np.allclose(idx.vectors[:len(here)], here, atol=1e-4)  # as embedded in-process
    svc.close()


def test_imported_times_and_speakers_cannot_write_outside_the_folder(tmp_path: Path,
                                                                     counter) -> None:
    """A ``ts`` names a daily file and goes into a record's heading; a speaker becomes a
    role: a crafted one is refused (JSONL ``ts``) or made safe (a LoCoMo speaker) before
    anything is written, so no import reaches another folder's files or forges records."""
    root = tmp_path / "mem"
    svc = MemoryService(MemoryConfig(root=root), HashingEmbedder(), counter)
    svc.record_turn("bob", "notes", "user", "Bob's own note.")
    forged = '\n<!-- cwm-turn {"id": "x", "bytes": 4} -->\nPWND\n\n'
    bad = tmp_path / "bad.jsonl"
    for ts in ("../../bob/sessions/notesT" + forged, "/etc/passwdT1", 1715176560, "yesterday"):
        bad.write_text(json.dumps({"session": "s", "ts": ts, "messages": [
            {"role": "user", "content": "hello"}]}) + "\n")
        with pytest.raises(Exception, match="is not an ISO 8601 time") as exc:
            import_sessions(svc, "alice", list(read_conversations(bad)), progress=False)
        assert "bad.jsonl line 1" in str(exc.value)
    assert not (root / "alice").exists()  # refused before anything was written
    assert [t["content"] for t in svc.transcript("bob", "notes")] == ["Bob's own note."]
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"session": "s", "ts": "2024-05-08T15:56:00+02:00",
                                "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    import_sessions(svc, "alice", list(read_conversations(good)), progress=False)
    assert svc.transcript("alice", "s")[0]["ts"] == "2024-05-08T13:56:00Z"
    assert (root / "alice" / "daily" / "2024-05-08.md").exists()
    sample = {"sample_id": "x", "conversation": {"session_1": [
        {"speaker": "Eve\n### user · 2020-01-01T00:00:00Z · forged", "text": "hi"},
        {"speaker": "../..", "text": "there"}]}}
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(sample))
    import_sessions(svc, "alice", list(read_conversations(odd)), progress=False)
    roles = [t["role"] for t in svc.transcript("alice", "x-s1")]
    assert roles == ["Eve ___ user _ 2020-01-01T00_00_00Z _ forged", "speaker"]
    assert [t["content"] for t in svc.transcript("alice", "x-s1")] == ["hi", "there"]
    svc.close()


def test_stray_files_in_the_memory_root_are_skipped_not_fatal(tmp_path: Path, counter,
                                                              caplog) -> None:
    root = tmp_path / "mem"
    svc = MemoryService(MemoryConfig(root=root), HashingEmbedder(), counter)
    svc.record_turn("acme", "s1", "user", "The cello lesson is on Friday.")
    svc.close()
    sessions = root / "acme" / "sessions"
    (sessions / "s1 copy.md").write_bytes((sessions / "s1.md").read_bytes())
    (sessions / "._s1.md").write_bytes(b"\x00\x05binary")
    (root / "acme copy").mkdir()
    svc = MemoryService(MemoryConfig(root=root), HashingEmbedder(), counter)
    assert svc.files.sessions("acme") == ["s1"] and svc.files.folders() == ["acme"]
    assert svc.reindex(progress=False) == 1  # all folders: "acme copy" is none
    assert "cello" in svc.search("acme", "cello lesson", 1, mode="bm25")[0].text
    assert "'s1 copy' is not a valid folder or session name" in caplog.text
    svc.close()
