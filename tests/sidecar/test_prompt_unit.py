"""Prompt assembly (cache-aware order) and the SSE relay, without a server."""

from __future__ import annotations

import asyncio
import json

import pytest

from cwm_plugin.sidecar import prompt as P
from cwm_plugin.sidecar.stream import Collected, relay_sse

pytestmark = pytest.mark.unit

SYS = {"role": "system", "content": "You are helpful."}


def test_cache_aware_order_keeps_the_stable_prefix_first():
    msgs = [SYS, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}]
    sp = P.split(msgs)
    assert sp.prefix == [SYS] and sp.new["content"] == "u2" and len(sp.history) == 2
    out = P.assemble(sp, sp.history, "- likes tea", mode="cache_aware").messages
    assert out[0] == SYS
    assert out[1]["role"] == "system" and "likes tea" in out[1]["content"]
    assert [m["content"] for m in out[2:]] == ["u1", "a1", "u2"]
    first = P.assemble(sp, sp.history, "- likes tea", mode="memory_first").messages
    assert first[0]["role"] == "system" and "likes tea" in first[0]["content"]
    assert first[1] == SYS
    # No memory: nothing injected, the request is forwarded as it came.
    assert P.assemble(sp, sp.history, "", mode="cache_aware").messages == msgs


def test_compaction_keeps_summary_and_the_last_exchanges():
    msgs = [SYS] + [{"role": r, "content": f"{r}{i}"} for i in range(4)
                    for r in ("user", "assistant")] + [{"role": "user", "content": "new"}]
    sp = P.split(msgs)
    out = P.assemble(sp, sp.history, "", summary="They talked.", keep=2).messages
    assert out[0] == SYS and P.SUMMARY_HEADER in out[1]["content"]
    # keep_turns=2: two user/assistant exchanges, not two messages
    assert [m["content"] for m in out[2:]] == ["user2", "assistant2", "user3", "assistant3",
                                               "new"]
    assert [m["content"] for m in P.assemble(sp, sp.history, "", keep=0).messages] == \
        ["You are helpful.", "new"]
    # an exchange holds a tool call and its results; a pinned instruction before it stays
    tool = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "assistant", "content": "It rains."}]
    pinned = {"role": "system", "content": "Answer in German."}
    recent = [pinned, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"},
              *tool]
    kept = P.last_exchanges(recent, 1)
    assert kept == [pinned, *tool]


def test_developer_messages_are_the_prefix_like_system_ones():
    dev = {"role": "developer", "content": "Be terse."}
    sp = P.split([SYS, dev, {"role": "user", "content": "u1"}])
    assert sp.prefix == [SYS, dev] and sp.history == []
    only = P.split([dev])  # the last message is always the new one
    assert only.prefix == [] and only.new == dev


def test_bad_messages_are_refused():
    from cwm_plugin.errors import InvalidInput

    for bad in (None, [], "hi", [{"content": "no role"}], [1]):
        with pytest.raises(InvalidInput):
            P.validate_messages(bad)


def _sse(objs):
    return [f"data: {json.dumps(o)}\n\n".encode() for o in objs] + [b"data: [DONE]\n\n"]


def test_relay_is_byte_exact_and_withholds_only_the_injected_usage_event():
    chunks = [{"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
              {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}]
    events = _sse(chunks)
    raw = b"".join(events)
    # Split the upstream bytes at awkward places.
    pieces = [raw[i:i + 7] for i in range(0, len(raw), 7)]

    async def source():
        for p in pieces:
            yield p

    async def run(strip):
        done = []
        col = Collected()

        async def on_done():
            done.append(col.text)

        out = [e async for e in relay_sse(source(), col, chat=True, strip_usage=strip,
                                          on_done=on_done)]
        return out, col, done

    out, col, done = asyncio.run(run(False))
    assert b"".join(out) == raw
    assert col.text == "Hello" and col.usage["prompt_tokens"] == 5 and done == ["Hello"]
    out, col, _ = asyncio.run(run(True))
    assert b"".join(out) == events[0] + events[1] + events[3]
    assert col.usage["completion_tokens"] == 2


def test_relay_puts_the_fingerprint_back_where_vllm_puts_it_without_usage():
    terminal = {"id": "x", "choices": [{"index": 0, "delta": {"content": "!"},
                                        "finish_reason": "length"}]}
    with_usage = _sse([{"id": "x", "choices": [{"index": 0, "delta": {"content": "a"}}]},
                       terminal, {"id": "x", "choices": [], "usage": {"prompt_tokens": 3},
                                  "system_fingerprint": "fp-1"}])

    async def source():
        for e in with_usage:
            yield e

    async def run():
        return [e async for e in relay_sse(source(), Collected(), chat=True, strip_usage=True)]

    out = asyncio.run(run())
    assert out[0] == with_usage[0] and out[-1] == b"data: [DONE]\n\n" and len(out) == 3
    assert json.loads(out[1][6:]) == {**terminal, "system_fingerprint": "fp-1"}


def test_debug_header_is_compact_ascii_and_capped():
    from cwm_plugin.sidecar.memory_port import Selected
    from cwm_plugin.sidecar.turn import _debug_header

    sel = Selected(memory_block="x", tokens=120, reasons=["keep chunk é" * 20] * 50,
                   hits=[{"chunk_id": f"{i:012d}", "source": "session:s", "score": 0.5}
                         for i in range(40)])
    full = _debug_header(sel, False, "cache_aware", 100_000, 2)
    assert json.loads(full)["reasons"] and full.isascii() and ": " not in full
    capped = _debug_header(sel, False, "cache_aware", 600, 2)
    info = json.loads(capped)
    assert len(capped) <= 600 and info["truncated"] and info["reasons"] is None
    assert 0 < len(info["hits"]) < 40 and info["tokens"] == 120


def test_debug_hits_carry_a_short_one_line_preview():
    from cwm_plugin.memory.models import Hit
    from cwm_plugin.sidecar.memory_port import PREVIEW_CHARS, _hit_dict

    hit = Hit(text="user: my hive\n  is called   Honeycomb Hall" + " x" * 200, score=0.81234,
              source="session:monday", chunk_id="c" * 64, turn_ids=["t1"])
    out = _hit_dict(hit)
    assert out["preview"].startswith("user: my hive is called Honeycomb Hall")
    assert len(out["preview"]) == PREVIEW_CHARS and "\n" not in out["preview"]
    assert out["chunk_id"] == "c" * 12 and out["score"] == 0.8123
