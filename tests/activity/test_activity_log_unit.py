"""The activity log's hash chain: appends verify, and every kind of tampering is named.

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

from cwm_plugin.activity.log import GENESIS, MAX_TEXT, ActivityLog, Entry
from cwm_plugin.errors import InvalidInput

pytestmark = pytest.mark.unit


def filled(root: Path, n: int = 5) -> ActivityLog:
    log = ActivityLog(root)
    for i in range(n):
        log.append(Entry(principal=f"p{i % 2}", what=f"step {i}", session="s1",
                         project="demo", output=f"result {i}", used_tokens=100 * i,
                         limit_tokens=1000, model="tiny"))
    return log


def lines(log: ActivityLog) -> list[str]:
    return log.jsonl.read_text().splitlines()


def test_appends_chain_verify_and_read_back(tmp_path):
    log = filled(tmp_path)
    assert log.verify() == []
    entries = log.entries()
    assert [e.what for e in entries] == [f"step {i}" for i in range(5)]
    assert entries[0].prev == GENESIS
    assert all(b.prev == a.hash for a, b in zip(entries, entries[1:], strict=False))
    assert log.head() == entries[-1].hash
    # The markdown is one readable line an entry, ending in the entry's short hash.
    md = log.md.read_text().splitlines()
    assert len(md) == 5 and md[3].endswith(f"`{entries[3].hash[:12]}`")
    assert "**p1** (session s1, project demo, model tiny): step 3 -> result 3" in md[3]
    assert "[context 300/1000 = 30.0%]" in md[3]
    assert entries[3].public()["percent"] == 30.0


def test_an_edited_line_is_named(tmp_path):
    log = filled(tmp_path)
    rows = lines(log)
    obj = json.loads(rows[2])
    obj["output"] = "something else"
    rows[2] = json.dumps(obj, sort_keys=True)
    log.jsonl.write_text("\n".join(rows) + "\n")
    problems = log.verify()
    assert any("line 3 was edited" in p for p in problems), problems
    assert any("activity.md differs" in p for p in problems)


def test_an_edit_with_its_hash_recomputed_breaks_the_next_link(tmp_path):
    log = filled(tmp_path)
    rows = lines(log)
    e = Entry.from_json(rows[1])
    e.what = "rewritten"
    e.hash = e.digest()
    rows[1] = json.dumps(e.__dict__, sort_keys=True)
    log.jsonl.write_text("\n".join(rows) + "\n")
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
    log.jsonl.write_text("\n".join(rows) + "\n")
    problems = log.verify()
    assert any("does not follow the entry before" in p for p in problems), problems


def test_an_edited_markdown_line_is_named(tmp_path):
    log = filled(tmp_path)
    md = log.md.read_text().replace("step 4", "step 44")
    log.md.write_text(md)
    assert log.verify() == ["activity.md differs from the hash chain in activity.jsonl from "
                            "line 5 on (5 lines for 5 entries)"]
    log.md.write_text("".join(md.splitlines(keepends=True)[:3]))  # lines cut off the end
    assert "from line 4 on (3 lines for 5 entries)" in log.verify()[0]


def test_garbage_and_wrong_types_are_reported_not_raised(tmp_path):
    log = filled(tmp_path, 2)
    rows = lines(log)
    bad = json.loads(rows[1])
    bad["time"] = "yesterday"
    log.jsonl.write_text("\n".join([rows[0], json.dumps(bad), "{not json", "[1, 2]"]) + "\n")
    problems = log.verify()
    assert [p.split(":")[0] for p in problems[:3]] == [
        "activity.jsonl line 2 is not an entry", "activity.jsonl line 3 is not an entry",
        "activity.jsonl line 4 is not an entry"]


def test_a_line_cut_short_by_a_crash_is_reported_and_later_appends_still_chain(tmp_path):
    log = filled(tmp_path, 3)
    head = log.head()
    with open(log.jsonl, "ab") as f:
        f.write(b'{"principal": "p0", "wh')  # the process died in the middle of a write
    assert "line 4 is incomplete" in log.verify()[0]
    e = log.append(Entry(principal="p9", what="after the crash"))
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
    assert log.head() != e.hash and log.entries()[0].what == text[:MAX_TEXT]
    assert log.verify() == []
    assert "\n" not in log.md.read_text().splitlines()[0]


def test_bad_entries_are_refused_and_nothing_is_written(tmp_path):
    log = ActivityLog(tmp_path)
    for entry in (Entry(principal="", what="x"), Entry(principal="p", what="  "),
                  Entry(principal="p", what="x" * (MAX_TEXT + 1)),
                  Entry(principal="p", what="x", session="s" * 300),
                  Entry(principal="p", what="x", used_tokens=-1)):
        with pytest.raises(InvalidInput):
            log.append(entry)
    assert not log.jsonl.exists() and log.entries() == [] and log.head() == GENESIS


def test_quick_is_the_last_day_newest_ten_and_page_is_everything_in_order(tmp_path,
                                                                         monkeypatch):
    log = filled(tmp_path, 14)
    rows = [Entry.from_json(r) for r in lines(log)]
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
root, who, n, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
while not start.exists():
    time.sleep(0.001)
log = ActivityLog(root)
for i in range(n):
    log.append(Entry(principal=who, what=f"{who} {i}"))
"""


def test_concurrent_appenders_in_several_processes_keep_one_linear_chain(tmp_path):
    root, start = tmp_path / "log", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(root), f"w{k}", "40",
                               str(start)], env={**os.environ}) for k in range(4)]
    time.sleep(0.5)  # let them all reach the start line (correctness never depends on it)
    start.touch()
    for p in procs:
        assert p.wait(timeout=300) == 0
    log = ActivityLog(root)
    assert log.verify() == []
    entries = log.entries()
    assert len(entries) == 160
    for k in range(4):  # each writer's entries in its own order
        mine = [e.what for e in entries if e.principal == f"w{k}"]
        assert mine == [f"w{k} {i}" for i in range(40)]
