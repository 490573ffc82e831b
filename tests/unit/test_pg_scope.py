"""The row-level security scope (``cwm_plugin.pg_scope``) without a database: what a
connection's settings say, and that the scope follows work onto the sidecar's memory threads
(and no further than the task that set it)."""

from __future__ import annotations

import asyncio
import threading

from cwm_plugin import pg_scope
from cwm_plugin.sidecar.identity.tenant_bounds import TenantBound, TenantPool


def test_settings_name_folders_and_their_index_spaces() -> None:
    scope = pg_scope.folders(["bob", None, "alice"], ["alice"])
    assert scope.settings() == ("alice,bob", "", "alice")
    assert scope.settings(["fp1/", "fp0/"]) == \
        ("alice,bob", "fp0/alice,fp0/bob,fp1/alice,fp1/bob", "alice")
    assert pg_scope.EVERYTHING.settings(["fp/"]) == ("*", "*", "*")
    assert pg_scope.NOTHING.settings(["fp/"]) == ("", "", "")  # sees and changes nothing
    # a folder written is readable; a folder name cannot smuggle another in (names hold no
    # comma: memory/files/names.py refuses them before any query)
    assert pg_scope.folders([], ["w"]).settings(["fp/"]) == ("w", "fp/w", "w")


def test_the_scope_is_the_blocks_and_then_the_one_before() -> None:
    assert pg_scope.current() is None
    with pg_scope.scoped(pg_scope.folders(["a"])):
        with pg_scope.scoped(pg_scope.EVERYTHING):
            assert pg_scope.current() is pg_scope.EVERYTHING
        assert pg_scope.current() == pg_scope.folders(["a"])
    assert pg_scope.current() is None


def test_a_thread_has_none_unless_carried() -> None:
    seen: list[object] = []
    with pg_scope.scoped(pg_scope.folders(["a"])):
        plain = threading.Thread(target=lambda: seen.append(pg_scope.current()))
        carried = threading.Thread(target=pg_scope.carried(
            lambda: seen.append(pg_scope.current())))
    for t in (plain, carried):
        t.start()
        t.join()
    assert seen == [None, pg_scope.folders(["a"])]


def test_memory_threads_run_a_call_in_its_requests_scope_and_requests_stay_apart() -> None:
    pool = TenantPool("t", TenantBound("memory_calls", "memory calls", 2, 8, None), 2)

    async def request(folder: str) -> object:
        pg_scope.enter(pg_scope.folders([folder]))  # as a route handler does
        await asyncio.sleep(0)
        return await pool.run("acme", pg_scope.current)

    async def main() -> list[object]:
        return list(await asyncio.gather(request("a"), request("b")))

    try:
        assert asyncio.run(main()) == [pg_scope.folders(["a"]), pg_scope.folders(["b"])]
        assert pg_scope.current() is None  # (nothing leaked out of the requests' tasks)
    finally:
        pool.close()
