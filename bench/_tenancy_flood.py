"""The requests of ``bench/tenancy.py``: what the measured tenants send, and the flood.

A measured tenant's client sends, in turn, a chat turn, a memory search and a window listing
(one route of each family the others' latency is reported for). The flooding tenant's clients
cycle through every route family at once, each request as a careless or hostile client would
send it: chat, completions and responses in many sessions, unknown model names, memory
searches, writes and views, freezes of sessions that saved nothing and of turns that are not
kept, window listings and statuses, window imports of junk, activity and usage; beside them
raw connections that never finish their headers (slow clients) and requests with oversize
headers. Everything the flooder sends is bounded by the sidecar's shipped defaults, not by the
benchmark.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx

FAMILIES = ("chat", "memory", "windows")


def key(name: str) -> str:
    return f"key-{name}"


def chat_body(i: int, model: str = "tiny") -> dict[str, Any]:
    return {"model": model, "max_tokens": 8, "messages": [
        {"role": "user", "content": f"Question {i}: where did the train to town {i} go?"}]}


async def measured_request(http: httpx.AsyncClient, url: str, tenant: str, i: int
                           ) -> tuple[str, int]:
    """One request of a measured tenant: family ``i % 3`` (its name, the status)."""
    headers = {"Authorization": f"Bearer {key(tenant)}", "X-Session-Id": f"s-{tenant}"}
    family = FAMILIES[i % len(FAMILIES)]
    if family == "chat":
        r = await http.post(f"{url}/v1/chat/completions", json=chat_body(i), headers=headers)
    elif family == "memory":
        r = await http.get(f"{url}/v1/memory/search", params={"q": f"train to town {i}"},
                           headers=headers)
    else:
        r = await http.get(f"{url}/v1/windows", headers=headers)
    return family, r.status_code


def _flood_requests(url: str) -> list[Callable[[httpx.AsyncClient, int], Any]]:
    """One coroutine factory a route family of the flood (``i``: the request's number)."""
    auth = {"Authorization": f"Bearer {key('flood')}"}

    def session(i: int) -> dict[str, str]:
        return {**auth, "X-Session-Id": f"f{i % 64}"}

    junk = os.urandom(256 * 1024)
    return [
        lambda h, i: h.post(f"{url}/v1/chat/completions", json=chat_body(i), headers=session(i)),
        lambda h, i: h.post(f"{url}/v1/completions", headers=session(i), json={
            "model": "tiny", "prompt": f"story {i}", "max_tokens": 8}),
        lambda h, i: h.post(f"{url}/v1/responses", headers=session(i), json={
            "model": "tiny", "input": f"story {i}", "max_output_tokens": 8}),
        lambda h, i: h.post(f"{url}/v1/chat/completions", headers=session(i),
                            json=chat_body(i, model=f"no-such-model-{i}")),
        lambda h, i: h.get(f"{url}/v1/memory/search", params={"q": f"town {i}"}, headers=auth),
        lambda h, i: h.post(f"{url}/v1/memory/facts", headers=auth,
                            json={"text": f"the flooder likes number {i}"}),
        lambda h, i: h.get(f"{url}/v1/memory/view", params={"view": "full"}, headers=auth),
        lambda h, i: h.post(f"{url}/v1/windows", headers=auth,
                            json={"name": f"w{i}", "session": f"never-{i}"}),
        lambda h, i: h.post(f"{url}/v1/windows", headers=auth,
                            json={"name": f"t{i}", "session": f"f{i % 64}", "turn": 99}),
        lambda h, i: h.get(f"{url}/v1/windows", headers=auth),
        lambda h, i: h.get(f"{url}/v1/windows/no-such-{i}", headers=auth),
        lambda h, i: h.post(f"{url}/v1/windows/import", headers=auth, content=junk),
        lambda h, i: h.post(f"{url}/v1/activity", headers=auth, json={"what": f"flood {i}"}),
        lambda h, i: h.get(f"{url}/v1/activity", headers=auth),
        lambda h, i: h.get(f"{url}/v1/usage", headers=auth),
        lambda h, i: h.get(f"{url}/v1/models", headers={**auth, "X-Pad": "x" * 40_000}),
    ]


def _slow_clients(url: str, until: float, count: int, seen: dict[str, int]) -> None:
    """``count`` connections at a time that send their headers a byte a second, opened again
    as the sidecar closes them (its header deadline)."""
    host, port = url.removeprefix("http://").split(":")
    socks: list[socket.socket] = []
    while time.monotonic() < until:
        while len(socks) < count:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        time.sleep(1.0)
        alive = []
        for s in socks:
            try:
                s.sendall(b"X")
                alive.append(s)
            except OSError:
                seen["slow_closed"] = seen.get("slow_closed", 0) + 1
                s.close()
        socks = alive
    for s in socks:
        s.close()


def flood(url: str, clients: int, seconds: float, slow: int, result: Any) -> None:
    """The flooding tenant, in a process of its own, niced: its load generator stands for
    clients on other machines, whose CPU is not the sidecar's (statuses into ``result``)."""
    import threading

    os.nice(19)
    kinds = _flood_requests(url)
    seen: dict[str, int] = {}
    until = time.monotonic() + seconds
    slow_thread = threading.Thread(target=_slow_clients, args=(url, until, slow, seen),
                                   daemon=True)
    slow_thread.start()

    async def one(http: httpx.AsyncClient, start: int) -> None:
        i = start
        while time.monotonic() < until:
            try:
                r = await kinds[i % len(kinds)](http, i)
                seen[str(r.status_code)] = seen.get(str(r.status_code), 0) + 1
            except httpx.HTTPError as exc:
                seen[type(exc).__name__] = seen.get(type(exc).__name__, 0) + 1
            i += 1

    async def main() -> None:
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(timeout=30, limits=limits) as http:
            await asyncio.gather(*(one(http, n) for n in range(clients)))

    asyncio.run(main())
    slow_thread.join(timeout=10)
    result.update(seen)
