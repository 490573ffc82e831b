"""Memory never pushes a prompt past the model's context: a block pinned on an earlier turn
of the conversation is selected again, smaller, when the client's new message leaves it no
room (vLLM would refuse a prompt the client alone could have sent)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecar_helpers import chat, make_settings, wait_idle

from cwm_plugin.memory.tokens import make_counter
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
COUNTER = make_counter("tiktoken:cl100k_base")
LIMIT = 2048


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[tuple[ServerThread, FakeUpstream]]:
    fake = FakeUpstream(model="tiny", max_model_len=LIMIT)
    with ServerThread(fake.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp_path, "tiktoken:cl100k_base",
            memory={"budget_tokens": 1024},
            rate_limits={"rate_limit": "none"}))) as s:  # 40 turns in a burst: not the point
        for i in range(40):  # an earlier session: plenty of memory about hello and greetings
            assert chat(s, "acme", f"Hello again, note {i}: the greeting for guests at the "
                        f"front desk of building {i} is 'hello and welcome'.",
                        session="old").status_code == 200
        wait_idle(s)
        yield s, fake


def sent_tokens(fake: FakeUpstream) -> int:
    return COUNTER.count_messages(fake.last()["messages"])


@pytest.mark.parametrize("mode", ["full", "recent"])
def test_a_pinned_memory_block_is_shrunk_when_the_new_message_leaves_no_room(srv, mode):
    s, fake = srv
    hdr = {"X-CWM-History": mode}
    first = [{"role": "user", "content": "hello"}]
    r = chat(s, "acme", first, session=f"new-{mode}", headers=hdr, max_tokens=8)
    assert r.status_code == 200
    pinned = int(r.headers["X-CWM-Memory-Tokens"])
    assert pinned > 300  # the first turn's block fills the budget (2048 x 0.25)
    long = " ".join(["word"] * 1600)
    assert COUNTER.count_messages([*first, {"role": "assistant", "content": "hi"},
                                   {"role": "user", "content": long}]) + 8 + pinned > LIMIT
    second = [*first, {"role": "assistant", "content": "hi"},
              {"role": "user", "content": long}]
    r = chat(s, "acme", second, session=f"new-{mode}", headers=hdr, max_tokens=8)
    assert r.status_code == 200
    assert sent_tokens(fake) + 8 <= LIMIT  # it fits, with a smaller block
    assert 0 < int(r.headers["X-CWM-Memory-Tokens"]) < pinned
    assert fake.last()["messages"][-1]["content"] == long  # the client's message is whole
