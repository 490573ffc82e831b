"""The activity log's hash chains: one per principal, appends verify, every kind of tampering
is named, and a log kept as one chain for everybody is moved into per-principal chains.

Real files in a temporary folder; concurrent appenders are real processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cwm_plugin.activity.chain import Chain
from cwm_plugin.activity.log import GENESIS, MAX_TEXT, ActivityLog, Entry
from cwm_plugin.errors import InvalidInput, StorageFull

pytestmark = pytest.mark.unit


def filled(root: Path, n: int = 5, principals: int = 1) -> ActivityLog:
    log = ActivityLog(root)
    for i in range(n):
        log.append(Entry(principal=f"p{i % principals}", what=f"step {i}", session="s1",
                         project="demo", output=f"result {i}", used_tokens=100 * i,
                         limit_tokens=1000, model="tiny"))
    return log


def lines(log: ActivityLog, principal: str = "p0") -> list[str]:
    return log.chain(principal).jsonl.read_text().splitlines()


def test_appends_chain_verify_and_read_back(tmp_path):
    log = filled(tmp_path)
    assert log.verify() == []
    entries = log.entries()
    assert [e.what for e in entries] == [f"step {i}" for i in range(5)]
    assert entries[0].prev == GENESIS
    assert all(b.prev == a.hash for a, b in zip(entries, entries[1:], strict=False))
    assert log.head("p0") == entries[-1].hash and log.heads() == {"p0": entries[-1].hash}
    # The markdown is one readable line an entry, ending in the entry's short hash.
    md = log.chain("p0").md.read_text().splitlines()
    assert len(md) == 5 and md[3].endswith(f"`{entries[3].hash[:12]}`")
    assert "**p0** (session s1, project demo, model tiny): step 3 -> result 3" in md[3]
    assert "[context 300/1000 = 30.0%]" in md[3]
    assert entries[3].public()["percent"] == 30.0


def test_each_principal_chains_only_its_own_entries(tmp_path):
    """Interleaved appends of three principals (a tenant's user among them): each chain links
    only its own entries, so nothing one principal reads holds another's hashes."""
    log = ActivityLog(tmp_path)
    who = ["acme", "beta", "acme/u-" + "a" * 32, "beta", "acme", "acme/u-" + "a" * 32] * 3
    for i, p in enumerate(who):
        log.append(Entry(principal=p, what=f"step {i}"))
    assert log.verify() == []
    assert log.principals() == sorted(set(who))
    assert [e.what for e in log.entries()] == [f"step {i}" for i in range(len(who))]
    for p in set(who):
        mine = log.entries(p)
        assert [e.principal for e in mine] == [p] * who.count(p)
        assert mine[0].prev == GENESIS and log.head(p) == mine[-1].hash
        assert all(b.prev == a.hash for a, b in zip(mine, mine[1:], strict=False))
        others = {e.hash for e in log.entries() if e.principal != p}
        assert not others & ({e.prev for e in mine} | {log.head(p)})
    # a user's chain is a folder of its own inside its tenant's, beside the tenant's own
    assert (tmp_path / "chains" / "acme" / ("u-" + "a" * 32) / "activity.jsonl").is_file()
    assert (tmp_path / "chains" / "acme" / "_self" / "activity.jsonl").is_file()
    assert log.heads({"acme": None}).keys() == {"acme", "acme/u-" + "a" * 32}
    assert log.heads({"acme": frozenset(), "beta": None}).keys() == {"acme", "beta"}
    assert [e.what for e in log.quick(limit=2, principal="beta")] == ["step 13", "step 15"]


def test_the_locks_held_do_not_grow_with_the_chains(tmp_path):
    """Every principal's chain is locked with one of a fixed set of locks (striped by its
    folder), so a tenant naming ever new users grows no lock table."""
    log = ActivityLog(tmp_path)
    for i in range(150):
        log.append(Entry(principal=f"t{i % 3}/user-{i}", what="x"))
    assert len(log.principals()) == 150 and log.verify() == []
    assert len(log._locks) <= 64


def test_a_tenant_holds_at_most_max_user_chains_and_is_told_past_them(tmp_path):
    """Past ``max_user_chains`` a new user's entry is refused (507), nothing written; the
    tenant's users already there, the tenant itself and another tenant's users go on; every
    chain is verified, a user's included."""
    log = ActivityLog(tmp_path, max_user_chains=3)
    for user in ("u1", "u2", "u3"):
        log.append(Entry(principal=f"acme/{user}", what="hello"))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(StorageFull) as refused:
        log.append(Entry(principal="acme/u4", what="one too many"))
    assert refused.value.http_status == 507 and refused.value.code == "activity_users_full"
    assert "activity.max_user_chains" in str(refused.value)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    for principal in ("acme/u1", "acme", "beta/u4", "beta/u5"):
        log.append(Entry(principal=principal, what="still fine"))
    assert log.principals({"acme": None}) == ["acme", "acme/u1", "acme/u2", "acme/u3"]
    assert log.verify() == []
    chain = log.chain("acme/u2").jsonl
    chain.write_text(chain.read_text().replace('"hello"', '"bye"'))
    assert log.verify()[0].startswith("chains/acme/u2/activity.jsonl line 1 was edited")


def test_an_entry_moved_into_another_principals_chain_is_named(tmp_path):
    log = ActivityLog(tmp_path)
    log.append(Entry(principal="acme", what="mine"))
    theirs = log.append(Entry(principal="beta", what="theirs"))
    # beta's entry, re-chained after acme's with every hash recomputed
    theirs.prev = log.head("acme")
    theirs.hash = theirs.digest()
    with open(log.chain("acme").jsonl, "a") as f:
        f.write(json.dumps(theirs.__dict__, sort_keys=True) + "\n")
    with open(log.chain("acme").md, "a") as f:
        f.write(theirs.markdown() + "\n")
    assert log.verify() == ["chains/acme/_self/activity.jsonl line 2 is an entry of another "
                            "principal (moved in from another chain)"]


def test_an_edited_line_is_named(tmp_path):
    log = filled(tmp_path)
    rows = lines(log)
    obj = json.loads(rows[2])
    obj["output"] = "something else"
    rows[2] = json.dumps(obj, sort_keys=True)
    log.chain("p0").jsonl.write_text("\n".join(rows) + "\n")
    problems = log.verify()
    assert any("chains/p0/_self/activity.jsonl line 3 was edited" in p for p in problems), problems
    assert any("chains/p0/_self/activity.md differs" in p for p in problems)


def test_an_edit_with_its_hash_recomputed_breaks_the_next_link(tmp_path):
    log = filled(tmp_path)
    rows = lines(log)
    e = Entry.from_json(rows[1])
    e.what = "rewritten"
    e.hash = e.digest()
    rows[1] = json.dumps(e.__dict__, sort_keys=True)
    log.chain("p0").jsonl.write_text("\n".join(rows) + "\n")
    problems = log.verify()
    assert any("line 3 does not follow" in p for p in problems), problems


@pytest.mark.parametrize("how", ["removed", "reordered", "inserted"])
def test_a_removed_reordered_or_inserted_line_is_named(tmp_path, how):
    log = filled(tmp_path)
    rows = lines(log)
    if how == "removed":
        del rows[2]
    elif how == "reordered":
        rows[1], rows[2] = rows[2], rows[1]
    else:
        rows.insert(2, rows[0])
    log.chain("p0").jsonl.write_text("\n".join(rows) + "\n")
    problems = log.verify()
    assert any("does not follow the entry before" in p for p in problems), problems


def test_an_edited_markdown_line_is_named(tmp_path):
    log = filled(tmp_path)
    md = log.chain("p0").md.read_text().replace("step 4", "step 44")
    log.chain("p0").md.write_text(md)
    assert log.verify() == ["chains/p0/_self/activity.md differs from the hash chain in "
                            "chains/p0/_self/activity.jsonl from "
                            "line 5 on (5 lines for 5 entries)"]
    log.chain("p0").md.write_text("".join(md.splitlines(keepends=True)[:3]))  # lines cut off the end
    assert "from line 4 on (3 lines for 5 entries)" in log.verify()[0]


def test_garbage_and_wrong_types_are_reported_not_raised(tmp_path):
    log = filled(tmp_path, 2)
    rows = lines(log)
    bad = json.loads(rows[1])
    bad["time"] = "yesterday"
    log.chain("p0").jsonl.write_text("\n".join([rows[0], json.dumps(bad), "{not json", "[1, 2]"]) + "\n")
    problems = log.verify()
    assert [p.split(":")[0] for p in problems[:3]] == [
        "chains/p0/_self/activity.jsonl line 2 is not an entry",
        "chains/p0/_self/activity.jsonl line 3 is not an entry",
        "chains/p0/_self/activity.jsonl line 4 is not an entry"]


def test_a_line_cut_short_by_a_crash_is_reported_and_later_appends_still_chain(tmp_path):
    log = filled(tmp_path, 3)
    head = log.head("p0")
    with open(log.chain("p0").jsonl, "ab") as f:
        f.write(b'{"principal": "p0", "wh')  # the process died in the middle of a write
    assert "line 4 is incomplete" in log.verify()[0]
    e = log.append(Entry(principal="p0", what="after the crash"))
    assert e.prev == head  # chained to the last complete entry, on a line of its own
    assert lines(log)[-1] == json.dumps(e.__dict__, sort_keys=True)
    problems = log.verify()
    assert len([p for p in problems if "line 4 is not an entry" in p]) == 1, problems
    assert not any("line 5" in p for p in problems), problems


def test_long_lines_and_unicode_round_trip(tmp_path):
    log = ActivityLog(tmp_path)
    text = "é€😀\n" * (MAX_TEXT // 4)  # JSON-escaped, a line is far longer than a read chunk
    e = log.append(Entry(principal="p", what=text[:MAX_TEXT], output=text[:MAX_TEXT]))
    log.append(Entry(principal="p", what="next"))
    assert log.head("p") != e.hash and log.entries()[0].what == text[:MAX_TEXT]
    assert log.verify() == []
    assert "\n" not in log.chain("p").md.read_text().splitlines()[0]


def test_bad_entries_are_refused_and_nothing_is_written(tmp_path):
    log = ActivityLog(tmp_path)
    for entry in (Entry(principal="", what="x"), Entry(principal="p", what="  "),
                  Entry(principal="p", what="x" * (MAX_TEXT + 1)),
                  Entry(principal="p", what="x", session="s" * 300),
                  Entry(principal="p", what="x", used_tokens=-1),
                  Entry(principal="é" * 50, what="x")):  # its folder: 300 bytes encoded
        with pytest.raises(InvalidInput):
            log.append(entry)
    assert not (tmp_path / "chains").exists() and log.entries() == []
    assert log.head("p") == GENESIS


def test_quick_is_the_last_day_newest_ten_and_page_is_everything_in_order(tmp_path,
                                                                         monkeypatch):
    log = filled(tmp_path, 14, principals=2)
    rows = log.entries()
    assert [e.what for e in log.quick()] == [f"step {i}" for i in range(4, 14)]
    assert [e.what for e in log.quick(limit=3, principal="p0")] == \
        ["step 8", "step 10", "step 12"]
    page, total = log.page(offset=12, limit=5)
    assert total == 14 and [e.what for e in page] == ["step 12", "step 13"]
    assert log.page(principal="p1")[1] == 7
    # "the last 24 hours": entries older than that are out of the quick view (the clock is
    # stopped, or a slow machine moves "now" past the cutoff between the two reads)
    assert rows[9].time < rows[10].time
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now)
    cutoff = (now - (rows[9].time + rows[10].time) / 2) / 3600
    assert [e.what for e in log.quick(hours=cutoff)] == ["step 10", "step 11", "step 12",
                                                         "step 13"]


APPENDER = """
import sys, time
from pathlib import Path
from cwm_plugin.activity.log import ActivityLog, Entry
root, who, tag, n, start = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), \\
    Path(sys.argv[5])
while not start.exists():
    time.sleep(0.001)
log = ActivityLog(root)
for i in range(n):
    log.append(Entry(principal=who, what=f"{tag} {i}"))
"""


def test_concurrent_appenders_in_several_processes_keep_each_chain_linear(tmp_path):
    """Four processes, two to a principal: each principal's chain stays linear."""
    root, start = tmp_path / "log", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(root), f"p{k % 2}",
                               f"w{k}", "40", str(start)], env={**os.environ})
             for k in range(4)]
    time.sleep(0.5)  # let them all reach the start line (correctness never depends on it)
    start.touch()
    for p in procs:
        assert p.wait(timeout=300) == 0
    log = ActivityLog(root)
    assert log.verify() == [] and log.principals() == ["p0", "p1"]
    entries = log.entries()
    assert len(entries) == 160 and len(log.entries("p0")) == 80
    for k in range(4):  # each writer's entries in its own order
        mine = [e.what for e in entries if e.what.startswith(f"w{k} ")]
        assert mine == [f"w{k} {i}" for i in range(40)]


def one_chain_log(root: Path, who: list[str]) -> Chain:
    """A log as it was kept before chains were per principal: ``activity.jsonl`` and
    ``activity.md`` at the root, every principal's entries in one chain."""
    old = Chain(root, None)
    for i, p in enumerate(who):
        old.extend([Entry(principal=p, what=f"step {i}")])
    return old


def test_a_one_chain_log_is_moved_into_per_principal_chains_when_opened(tmp_path, caplog):
    who = ["acme", "beta", "acme", "acme/u-" + "b" * 32, "beta"]
    old = one_chain_log(tmp_path, who)
    before, head = old.entries(), old.head()
    assert before[1].prev == before[0].hash  # beta's entry names acme's
    log = ActivityLog(tmp_path)
    kept = f"activity.legacy-{head[:12]}"
    assert log.migrated is not None and log.migrated in caplog.text
    assert "moved 5 entries into 3 chains" in log.migrated and f"head {head}" in log.migrated
    assert "intact" in log.migrated and f"kept as {kept}.jsonl" in log.migrated
    assert not (tmp_path / "activity.jsonl").exists() and not (tmp_path / "activity.md").exists()
    assert (tmp_path / f"{kept}.jsonl").is_file() and (tmp_path / f"{kept}.md").is_file()
    # every entry, its time kept, in its principal's chain, linked only to its own
    after = log.entries()
    assert [(e.principal, e.what, e.time) for e in after] == \
        [(e.principal, e.what, e.time) for e in before]
    assert log.verify() == []
    assert log.entries("beta")[0].prev == GENESIS
    assert not {e.prev for e in log.entries("beta")} & {e.hash for e in log.entries("acme")}
    # opened again: nothing moves twice; appends go to the chains
    again = ActivityLog(tmp_path)
    assert again.migrated is None and len(again.entries()) == 5
    again.append(Entry(principal="beta", what="later"))
    assert again.entries("beta")[-1].prev == after[4].hash and again.verify() == []


def test_a_move_cut_short_or_a_one_chain_writer_after_it_moves_each_entry_once(tmp_path):
    old = one_chain_log(tmp_path, ["acme", "beta", "acme"])
    saved = {p: p.read_bytes() for p in (old.jsonl, old.md)}
    ActivityLog(tmp_path)
    # a crash after the chains were in place, before the old files were renamed
    for path, data in saved.items():
        path.write_bytes(data)
    log = ActivityLog(tmp_path)
    assert "moved 0 entries" in str(log.migrated)
    assert [e.what for e in log.entries()] == ["step 0", "step 1", "step 2"]
    # a sidecar of the one-chain kind writes again: only its new entries move
    one_chain_log(tmp_path, ["beta"])
    log = ActivityLog(tmp_path)
    assert "moved 1 entries into 1 chains" in str(log.migrated)
    assert [e.what for e in log.entries("beta")] == ["step 1", "step 0"]
    assert log.verify() == [] and len(list(tmp_path.glob("activity.legacy-*.jsonl"))) == 2


def test_a_tampered_one_chain_log_is_moved_and_its_problems_stay_on_record(tmp_path):
    old = one_chain_log(tmp_path, ["acme", "beta", "acme"])
    rows = old.jsonl.read_text().splitlines()
    del rows[1]  # beta's entry cut out by hand
    old.jsonl.write_text("\n".join(rows) + "\n")
    log = ActivityLog(tmp_path)
    assert "2 problem(s), the first: activity.jsonl line 2 does not follow" in str(log.migrated)
    assert [e.what for e in log.entries()] == ["step 0", "step 2"]
    problems = log.verify()
    assert problems and all(p.startswith("activity.legacy-") for p in problems), problems
