"""Billing over real HTTP: every relayed route that spends tokens (chat, completions,
responses) bills the same way when the client drops its stream: the prompt's estimate and the
tokens relayed. The upstream is ``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

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


@pytest.mark.parametrize("path", list(BODIES))
def test_a_stream_the_client_drops_bills_its_prompt_on_every_route(tmp_path, path):
    words = " ".join(f"w{i}" for i in range(40))
    slow = FakeUpstream(model="tiny", script=lambda b: {"content": words})
    slow.stream_delay = 0.1
    with ServerThread(slow.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp_path, "tiktoken:cl100k_base"))) as srv:
        headers = {"Authorization": f"Bearer {KEYS['acme']}", "X-Session-Id": "cut"}
        body = {"model": "tiny", "stream": True, "max_tokens": 64, **BODIES[path]}
        drop_stream(srv, path, body, headers, 6)
        wait_idle(srv)
        total = httpx.get(f"{srv.url}/v1/usage", headers=headers, timeout=30).json()["total"]
        assert total["requests"] == 1 and 3 <= total["completion_tokens"] < 40, total
        assert total["prompt_tokens"] >= len(ASKED) // 4, total  # its estimate, at least
