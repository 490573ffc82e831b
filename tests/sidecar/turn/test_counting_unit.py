"""Which counter counts a model's tokens: built once per resolved setting, so a ``vllm``
counter follows the upstream the route puts first (one that is up), over real HTTP."""

from __future__ import annotations

import asyncio

import pytest

from cwm_plugin.memory.settings import MemorySettings
from cwm_plugin.sidecar.turn.counting import ModelCounters
from cwm_plugin.sidecar.upstream.client import ModelInfo
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit


def test_a_vllm_counter_asks_the_upstream_that_serves_the_model_now(tmp_path) -> None:
    a, b = FakeUpstream(model="m"), FakeUpstream(model="m")
    with ServerThread(a.app) as up_a, ServerThread(b.app) as up_b:
        counters = ModelCounters(MemorySettings(root=tmp_path, tokenizer="vllm"))

        def count(url: str, text: str) -> int:
            counter = asyncio.run(counters.get("m", ModelInfo("m", 2048, None, url)))
            return counter.count(text)

        assert count(up_a.url, "one two three") == 3
        assert asyncio.run(counters.get("m", ModelInfo("m", 2048, None, up_a.url))) is \
            asyncio.run(counters.get("m", ModelInfo("m", 2048, None, up_a.url)))  # kept
        asked_a = len(a.bodies("/tokenize"))
        up_a.stop()  # A is down: the route puts B first, and B is asked
        assert count(up_b.url, "four five") == 2
        assert len(b.bodies("/tokenize")) == 1 and len(a.bodies("/tokenize")) == asked_a
        counters.close()
