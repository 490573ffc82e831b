"""Deferred turns: records checked, batches kept in order, given back in front on failure."""

from __future__ import annotations

import threading

import pytest

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.files.pending import PendingTurns, turn_records

pytestmark = pytest.mark.unit


def test_turn_records_check_roles_ids_and_contents() -> None:
    got = turn_records([("user", "hi"), ("assistant", "hello")], ["u-1", None], None)
    assert [t.turn_id for t in got][0] == "u-1" and got[1].turn_id and got[1].content == "hello"
    for turns, ids in (([("user", "a")], ["a", "b"]), ([("user", "a")], ["../x"]),
                       ([("two\nlines", "a")], None), ([("user", 3)], None)):
        with pytest.raises(InvalidInput):
            turn_records(turns, ids, None)


def test_a_failed_indexing_gives_its_batches_back_in_front_of_newer_ones() -> None:
    p = PendingTurns()
    p.add("acme", ("s", [], 0, 1))
    p.add("acme", ("s", [], 1, 2))
    with pytest.raises(RuntimeError), p.take("acme") as todo:
        assert [b[2] for b in todo] == [0, 1] and p.waiting("acme") == 0
        p.add("acme", ("s", [], 2, 3))  # appended while the indexing runs
        raise RuntimeError("embedder down")
    assert p.folders() == ["acme"] and p.waiting("acme") == 3
    with p.take("acme") as todo:
        assert [b[2] for b in todo] == [0, 1, 2]
    assert p.waiting("acme") == 0 and p.folders() == []


def test_one_indexing_a_folder_at_a_time() -> None:
    p = PendingTurns()
    p.add("acme", ("s", [], 0, 1))
    inside, release, order = threading.Event(), threading.Event(), []

    def first() -> None:
        with p.take("acme") as todo:
            inside.set()
            release.wait(5)
            order.append(("first", len(todo)))

    t = threading.Thread(target=first)
    t.start()
    inside.wait(5)
    p.add("acme", ("s", [], 1, 2))
    second = threading.Thread(target=lambda: order.append(("second", _took(p))))
    second.start()
    second.join(0.2)
    assert second.is_alive()  # waits for the indexing under way
    release.set()
    t.join(5)
    second.join(5)
    assert order == [("first", 1), ("second", 1)]


def _took(p: PendingTurns) -> int:
    with p.take("acme") as todo:
        return len(todo)
