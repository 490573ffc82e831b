"""Where the sidecar's memory work runs: on the memory's own threads, each principal's calls
within its share (``turn/memory_port.py``), never on asyncio's default executor, which every
tenant's memory work shared (a tenant's searches filling its few threads held every other
tenant's turn planning and searches). Over real HTTP in front of a fake upstream, on a real
memory (files and index in a temp folder); held by a gate on the real pool."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from sidecar_helpers import KEYS, chat, metric_value, over_fake_upstream, runtime, wait_idle

from cwm_plugin.sidecar.turn import memory_port
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit


@pytest.fixture
def srv(tmp_path: Path):
    with over_fake_upstream(tmp_path) as s:
        yield s


def search(srv: ServerThread, tenant: str) -> httpx.Response:
    return httpx.get(f"{srv.url}/v1/memory/search", params={"q": "train"}, timeout=30,
                     headers={"Authorization": f"Bearer {KEYS[tenant]}"})


def test_a_turns_planning_search_and_recording_run_on_the_memory_threads(srv, monkeypatch):
    service, threads = runtime(srv).memory.now, []
    for name in ("select_context", "record_turns", "search"):
        real = getattr(service, name)

        def watched(*a, _real=real, **kw):
            threads.append(threading.current_thread().name)
            return _real(*a, **kw)
        monkeypatch.setattr(service, name, watched)
    assert chat(srv, "acme", "where did the train go?").status_code == 200
    wait_idle(srv)
    assert search(srv, "acme").status_code == 200
    assert len(threads) == 3 and all(t.startswith("cwm-memory") for t in threads), threads


def test_one_tenants_memory_work_never_holds_up_anothers(srv, monkeypatch):
    """acme's memory threads all held and more of its calls waiting than the executor every
    tenant used to share has threads: beta's search and chat turn are answered, with memory;
    acme's next calls past its queue are refused at once, and its chat goes on without memory."""
    pool, gate = runtime(srv).memory.pool, threading.Event()
    held = [asyncio.run_coroutine_threadsafe(pool.run("acme", gate.wait), srv.loop)
            for _ in range(memory_port.THREADS + 8)]
    try:
        r = search(srv, "beta")
        assert r.status_code == 200, r.text
        r = chat(srv, "beta", "where did the train go?", debug=True)
        assert r.status_code == 200 and "X-CWM-Memory-Status" not in r.headers, r.headers
        monkeypatch.setattr(pool.bound, "waiting", 8)  # acme's queue is full now
        r = search(srv, "acme")
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert "memory calls" in r.json()["error"]["message"]
        r = chat(srv, "acme", "and the bus?")
        assert r.status_code == 200, r.text  # fail open: answered without its memory
        assert "select" in r.headers.get("X-CWM-Memory-Status", ""), r.headers
        assert metric_value(srv, "cwm_sidecar_rate_limited_total", tenant="acme",
                            limit="memory_calls") == 3  # the search, the turn's plan, its record
    finally:
        gate.set()
    assert all(h.result(30) for h in held)
    assert search(srv, "acme").status_code == 200
