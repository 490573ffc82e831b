"""Failover between two real ``vllm serve`` processes of one model sharing a Redis KV tier.

A conversation runs on server A through the sidecar; A is stopped (the connector flushes its
saves to Redis on the way down); the next turn goes to server B, which restores the earlier
prefix from Redis (``vllm:external_prefix_cache_hits``) instead of recomputing it, and answers
exactly what a cold recompute on B answers. Then A is back and the server streaming the next
answer is SIGKILLed mid-answer: the sidecar resumes the stream on the other one from the text
already relayed.
"""

from __future__ import annotations

import os
import signal

import openai
import pytest
from sidecar_helpers import KEYS, make_settings, metric_value

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.procs import wait_until
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.testing.vllm_server import cwm_connector_args, start_all

pytestmark = [pytest.mark.e2e, pytest.mark.redis]
HITS = "vllm:external_prefix_cache_hits"
BLOCK = 128  # vLLM's block size on CPU: hits come in whole blocks
WORDS = ["river", "mountain", "coffee", "letter", "garden", "window", "token", "memory",
         "station", "glacier", "tunnel", "valley"]


def text(n: int) -> str:
    return " ".join(WORDS[(i * 7 + i // 5) % len(WORDS)] for i in range(n))


def test_a_session_that_fails_over_restores_its_kv_on_the_other_server(
        tiny_model, vllm_factory, redis_server, tmp_path):
    def server(name: str):
        store = {"disk_path": str(tmp_path / name), "redis_url": redis_server.url}
        return vllm_factory(tiny_model, extra_args=cwm_connector_args(store))

    a, b = start_all(server("a"), server("b"))
    settings = make_settings(a.base_url, tmp_path / "memory", tiny_model, memory_enabled=False,
                             upstreams=[{"name": "a", "url": a.base_url},
                                        {"name": "b", "url": b.base_url}],
                             routing={"health": {"interval_s": 0}})
    with ServerThread(create_app(settings)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEYS["acme"], max_retries=0,
                               default_headers={"X-Session-Id": "failover"}, timeout=600)

        def turn(messages: list[dict]):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, max_tokens=16, temperature=0.0,
                extra_body={"return_token_ids": True})
            return raw.headers["x-cwm-upstream"], raw.parse()

        history = [{"role": "system", "content": "You are a careful assistant."},
                   {"role": "user", "content": text(250)}]
        home, first = turn(history)  # the session's upstream (routing.affinity: session)
        gone, left = (a, b) if home == "a" else (b, a)
        prefix = first.usage.prompt_tokens
        assert prefix >= 4 * BLOCK
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And what comes next? " + text(10)}]
        gone.stop()  # SIGTERM: the connector flushes what it saved to Redis before exiting
        assert left.metric(HITS) == 0

        where, second = turn(history)
        assert where != home
        restored = left.metric(HITS)
        assert restored >= prefix // BLOCK * BLOCK, (restored, prefix)
        assert restored < second.usage.prompt_tokens

        # The same prompt recomputed cold on the survivor (a salt nobody used: no hit anywhere).
        cold = left.chat(history, max_tokens=16, cache_salt="cold-reference",
                         return_token_ids=True)
        assert left.metric(HITS) == restored, "the reference was not a cold recompute"
        assert cold["usage"]["prompt_tokens"] == second.usage.prompt_tokens
        assert second.choices[0].token_ids == cold["choices"][0]["token_ids"]
        assert second.choices[0].message.content == cold["choices"][0]["message"]["content"]
        print(f"failover: earlier prefix {prefix} tokens, restored on {where} {restored:.0f} of "
              f"{second.usage.prompt_tokens}; answer identical to a cold recompute")

        # The first is back; the server streaming the next answer is SIGKILLed mid-answer: the stream
        # goes on, on the other, from the text already relayed (one unbroken answer).
        gone.start()
        history += [{"role": "assistant", "content": second.choices[0].message.content},
                    {"role": "user", "content": "Go on at length. " + text(12)}]
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=history, max_tokens=240, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True})
        where = raw.headers["x-cwm-upstream"]
        victim, other = (b, "a") if where == "b" else (a, "b")
        pieces, finish, counts = [], None, []
        for chunk in raw.parse():
            if chunk.usage is not None:  # as bench/serving.py counts tokens
                counts.append(chunk.usage.completion_tokens)
            for c in chunk.choices:
                if c.delta.content:
                    pieces.append(c.delta.content)
                finish = c.finish_reason or finish
            if len(pieces) == 2 and victim.alive():  # early: most of the answer is to come
                os.killpg(victim.pid, signal.SIGKILL)
        wait_until(lambda: not victim.alive(), timeout=30, what=f"{where} gone")
        assert finish == "length" and len(pieces) > 120, (finish, len(pieces))
        # the usage the client sees counts the whole answer across the resume, never back
        assert counts == sorted(counts) and counts[-1] == 240, counts
        assert metric_value(srv, "cwm_sidecar_streams_resumed_total", upstream=where,
                            to=other) == 1
