"""Billing over real HTTP: every relayed route that spends tokens (chat, completions,
responses) bills the same way when the client drops its stream: the prompt's estimate and the
tokens relayed, exactly once, also when the server raises on a client gone away (ASGI 2.4) instead
of watching for it (uvicorn, ASGI 2.3). The upstream is ``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from sidecar_helpers import KEYS, drop_stream, make_settings, wait_idle

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
ASKED = "Count for me, please, from one to forty, one number a line."
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": ASKED}]},
    "/v1/completions": {"prompt": ASKED},
    "/v1/responses": {"input": ASKED},
}


class Asgi24:
    """The sidecar as an ASGI 2.4 server runs it: ``send`` on a connection whose client went
    away raises an OSError (Starlette then answers no more and runs no BackgroundTask)."""

    def __init__(self, app: Any) -> None:
        self.app, self.state = app, app.state  # state: the helpers find the sidecar there

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.4"}}
        gone = asyncio.Event()
        watcher: list[asyncio.Task] = []

        async def watch() -> None:  # after the body, the next message is the disconnect
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        async def recv() -> dict:
            msg = await receive()
            if msg["type"] == "http.request" and not msg.get("more_body") and not watcher:
                watcher.append(asyncio.create_task(watch()))
            return msg

        async def snd(msg: dict) -> None:
            if gone.is_set():
                raise OSError("the client went away")
            await send(msg)

        try:
            await self.app(scope, recv, snd)
        finally:
            for t in watcher:
                t.cancel()


@pytest.mark.parametrize("asgi", ["2.3", "2.4"])
@pytest.mark.parametrize("path", list(BODIES))
def test_a_stream_the_client_drops_bills_its_prompt_once_on_every_route(tmp_path, path, asgi):
    """uvicorn (ASGI 2.3) cancels the response when its client goes away; an ASGI 2.4 server
    raises on the next send instead: either way the bill is settled, once."""
    words = " ".join(f"w{i}" for i in range(40))
    slow = FakeUpstream(model="tiny", script=lambda b: {"content": words})
    slow.stream_delay = 0.1
    with ServerThread(slow.app) as up:
        app = create_app(make_settings(up.url, tmp_path, "tiktoken:cl100k_base"))
        with ServerThread(app if asgi == "2.3" else Asgi24(app)) as srv:
            headers = {"Authorization": f"Bearer {KEYS['acme']}", "X-Session-Id": "cut"}
            body = {"model": "tiny", "stream": True, "max_tokens": 64, **BODIES[path]}
            drop_stream(srv, path, body, headers, 6)
            wait_idle(srv)
            total = httpx.get(f"{srv.url}/v1/usage", headers=headers,
                              timeout=30).json()["total"]
            assert total["requests"] == 1 and 3 <= total["completion_tokens"] < 40, total
            assert total["prompt_tokens"] >= len(ASKED) // 4, total  # its estimate, at least
