"""Priority for returning sessions on a real ``vllm serve --scheduling-policy priority`` with our
connector, memory on as it ships: through the sidecar (``upstreams[].priority_scheduling``), a conversation's first
turn goes at 0 and its next at ``routing.returning_priority`` (-1), which vLLM takes; the
returning turn restores its earlier prefix (our connector, or vLLM's own cache) and answers
exactly what the same prompt answers sent straight to vLLM at priority 0 under the same salt.
A client without the ``priority`` grant asking for -100 is sent at 0."""

from __future__ import annotations

import openai
import pytest
from sidecar_helpers import KEYS, make_settings

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.background.maintainer import NOT_STORED
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.testing.vllm_server import cwm_connector_args

pytestmark = [pytest.mark.e2e]
WORDS = ["harbour", "lantern", "meadow", "cobalt", "orchard", "quartz", "willow", "ember"]


def text(n: int) -> str:
    return " ".join(WORDS[(i * 5 + i // 3) % len(WORDS)] for i in range(n))


def test_a_returning_turn_goes_first_on_a_priority_scheduling_vllm(tiny_model, vllm_factory,
                                                                   tmp_path):
    vllm = vllm_factory(tiny_model, extra_args=[
        *cwm_connector_args({"disk_path": str(tmp_path / "kv")}),
        "--scheduling-policy", "priority"])
    vllm.start()
    settings = make_settings(vllm.base_url, tmp_path / "memory", tiny_model,
                             upstreams=[{"name": "v", "url": vllm.base_url,
                                         "priority_scheduling": True}],
                             routing={"health": {"interval_s": 0}})
    with ServerThread(create_app(settings)) as srv:
        sent: list[dict] = []
        real = srv.app.state.sidecar.router._on

        def watched(ep, body, priority):
            out = real(ep, body, priority)
            if out.get("kv_transfer_params") != NOT_STORED:  # turns, not memory's background
                sent.append({"priority": out.get("priority"), "salt": out.get("cache_salt"),
                             "messages": out.get("messages")})
            return out
        srv.app.state.sidecar.router._on = watched
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEYS["beta"], max_retries=0,
                               default_headers={"X-Session-Id": "returning"}, timeout=600)
        history = [{"role": "user", "content": text(300)}]
        first = client.chat.completions.create(model="tiny", messages=history, max_tokens=8,
                                               temperature=0.0)
        assert sent[-1]["priority"] is None
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "and then? " + text(20)}]
        second = client.chat.completions.create(model="tiny", messages=history, max_tokens=16,
                                                temperature=0.0,
                                                extra_body={"return_token_ids": True})
        assert sent[-1]["priority"] == -1
        straight = vllm.chat(sent[-1]["messages"], max_tokens=16, cache_salt=sent[-1]["salt"],
                             return_token_ids=True)
        assert second.choices[0].token_ids == straight["choices"][0]["token_ids"]
        hits = vllm.metric("vllm:prefix_cache_hits") + \
            vllm.metric("vllm:external_prefix_cache_hits")
        assert hits > 0, "the returning turn found nothing of its earlier prefix"
        # without the grant, a client's -100 goes at 0 (vLLM takes it)
        r = client.chat.completions.create(model="tiny", messages=history[:1], max_tokens=4,
                                           extra_body={"priority": -100},
                                           extra_headers={"X-Session-Id": "other"})
        assert r.choices[0].message is not None and sent[-1]["priority"] == 0
