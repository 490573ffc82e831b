"""Where the sidecar's window and store calls run: on the window threads, within the caller's
tenant's share (``identity/tenant_bounds.py``), never on asyncio's default executor that every
tenant's chat planning shares -- the prompt-state read of a continuing session (its own pool),
the freeze at an auto-checkpoint, and a tenant's waiters past its bound are refused at once
while another tenant's calls run. Over real HTTP in front of a fake upstream, on a real disk
store; the calls are the real ones, watched (or held) by a wrapper."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from sidecar_helpers import KEYS, chat, metric_value, over_fake_upstream, runtime

from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.windows.auto import AutoFreeze

pytestmark = pytest.mark.unit


@pytest.fixture
def srv(tmp_path: Path):
    with over_fake_upstream(tmp_path, windows={
            "store": {"disk_path": str(tmp_path / "kv")}, "wait_s": 0, "settle_s": 0,
            "tenant_threads": 1, "tenant_waiting": 1}) as s:
        yield s


def on_loop(srv: ServerThread, coro) -> object:
    return asyncio.run_coroutine_threadsafe(coro, srv.loop).result(30)


def test_a_continuing_sessions_prompt_state_is_read_on_the_restore_threads(srv, monkeypatch):
    records = runtime(srv).windows.conversations
    real, threads = records.read, []

    def read(*a):
        threads.append(threading.current_thread().name)
        return real(*a)
    monkeypatch.setattr(records, "read", read)
    r = chat(srv, "acme", [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "and now?"}], session="cont")
    assert r.status_code == 200, r.text
    assert threads and all(t.startswith("cwm-restores") for t in threads), threads


def test_the_freeze_at_a_checkpoint_runs_on_the_window_threads(srv, monkeypatch):
    threads: list[str] = []
    monkeypatch.setattr(AutoFreeze, "__call__", lambda self, *a: threads.append(
        threading.current_thread().name))
    on_loop(srv, runtime(srv).snapshot_hook("acme", "s1", "salt", "c1"))
    on_loop(srv, runtime(srv).snapshot_hook("acme/u-alice", "s1", "salt", "c2"))
    assert len(threads) == 2 and all(t.startswith("cwm-windows") for t in threads), threads


def test_a_tenants_window_waiters_are_bounded_and_never_hold_up_another_tenant(srv):
    pool, gate = runtime(srv).window_pool, threading.Event()
    try:
        held = [asyncio.run_coroutine_threadsafe(pool.run("acme", gate.wait), srv.loop)
                for _ in range(2)]  # one running, one waiting: acme's share and its queue
        r = httpx.get(f"{srv.url}/v1/windows", timeout=30,
                      headers={"Authorization": f"Bearer {KEYS['acme']}"})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        r = httpx.get(f"{srv.url}/v1/windows", timeout=30,
                      headers={"Authorization": f"Bearer {KEYS['beta']}"})
        assert r.status_code == 200, r.text
        assert metric_value(srv, "cwm_sidecar_rate_limited_total", tenant="acme",
                            limit="window_ops") == 1
    finally:
        gate.set()
    assert [h.result(30) for h in held] == [True, True]


def test_a_pools_slot_is_the_threads_until_its_call_returns_even_if_the_waiter_goes():
    """Given back at once when the call returns; when the request that waited goes away first,
    held until the call on its thread returns (a hung store holds at most the share)."""
    from prometheus_client import CollectorRegistry, Counter

    from cwm_plugin.sidecar.identity.tenant_bounds import TenantBound, TenantPool

    counter = Counter("refused", "x", ["tenant", "limit"], registry=CollectorRegistry())
    pool = TenantPool("t", TenantBound("t", "test calls", 1, 0, counter), 1)
    gate = threading.Event()

    async def go() -> None:
        assert await pool.run("a", lambda: 7) == 7
        assert pool.bound.held("a") == 0  # given back with the answer
        task = asyncio.ensure_future(pool.run("a", gate.wait))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert pool.bound.held("a") == 1  # still the thread's
        gate.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if pool.bound.held("a") == 0:
                break
        assert pool.bound.held("a") == 0
    try:
        asyncio.run(go())
    finally:
        pool.close()
