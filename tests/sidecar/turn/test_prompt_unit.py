"""Prompt assembly (cache-aware order) and the SSE relay, without a server."""

from __future__ import annotations

import asyncio
import json

import pytest

from cwm_plugin.sidecar.turn import prompt as P
from cwm_plugin.sidecar.upstream.stream import Collected, relay_sse

pytestmark = pytest.mark.unit

SYS = {"role": "system", "content": "You are helpful."}


USER = {"role": "user", "content": "u2"}


def test_the_split_keeps_the_current_exchange_whole():
    msgs = [SYS, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    parts = P.split(msgs)
    assert parts.prefix == [SYS] and [m["content"] for m in parts.history] == ["u1", "a1"]
    assert parts.current == msgs[3:]  # the question and the tool round answering it
    assert P.query_text(parts) == "weather?"  # the user's request, not the tool's output
    assert parts.prefix + parts.history + parts.current == msgs  # nothing lost or doubled


def test_memory_is_merged_never_added_as_a_second_system_message():
    msgs = [SYS, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}, USER]
    out = P.merge(msgs, "MEM", "system")
    assert out[0] == {"role": "system", "content": "You are helpful.\n\nMEM"}
    assert out[1:] == msgs[1:] and msgs[0] == SYS  # the client's message is not changed
    no_sys = msgs[1:]
    assert P.merge(no_sys, "MEM", "system")[0] == {"role": "system", "content": "MEM"}
    assert P.merge(no_sys, "MEM", "system")[1:] == no_sys
    # a template without a system role (Gemma-style): into the first user message
    gemma = P.merge(no_sys, "MEM", "system", system_role=False)
    assert gemma[0] == {"role": "user", "content": "MEM\n\nu1"} and gemma[1:] == no_sys[1:]
    last = P.merge(msgs, "MEM", "last_user")
    assert last[:-1] == msgs[:-1] and last[-1] == {"role": "user", "content": "MEM\n\nu2"}
    parts = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]
    merged = P.merge([{"role": "user", "content": parts}], "MEM", "last_user")
    assert merged[0]["content"] == [{"type": "text", "text": "MEM"}, *parts]
    assert P.merge(msgs, "", "system") == msgs


def test_compaction_cuts_at_exchanges_and_keeps_instructions():
    history = [{"role": r, "content": f"{r}{i}"} for i in range(4) for r in ("user", "assistant")]
    cut = P.last_exchanges(history, 2)
    assert [m["content"] for m in P.drop_front(history, cut)] == \
        ["user2", "assistant2", "user3", "assistant3"]
    assert P.last_exchanges(history, 0) == len(history) and P.last_exchanges(history, 9) == 0
    pinned = {"role": "system", "content": "Answer in German."}
    tool = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "assistant", "content": "It rains."}]
    recent = [pinned, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"},
              *tool]
    assert P.drop_front(recent, P.last_exchanges(recent, 1)) == [pinned, *tool]


def test_fit_cut_drops_the_oldest_groups_only_as_far_as_needed():
    history = [{"role": "user", "content": "x" * 10},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
               {"role": "tool", "content": "y" * 10}, {"role": "assistant", "content": "z"}]

    def cost(ms):
        return sum(len(str(m.get("content") or "")) for m in ms)

    assert P.fit_cut(history, cost, 100) == 0  # it fits: nothing is dropped
    assert P.fit_cut(history, cost, 11) == 1  # the tool call leaves with its result ...
    assert P.fit_cut(history, cost, 1) == 3  # ... never one without the other


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
    from cwm_plugin.sidecar.turn.memory_port import Selected
    from cwm_plugin.sidecar.turn.plan import debug_header as _debug_header

    sel = Selected(memory_block="## Memory\nuser said my hive is Honeycomb Hall é\n" * 20,
                   tokens=120, reasons=["keep chunk é" * 20] * 50,
                   hits=[{"chunk_id": f"{i:012d}", "source": "session:s", "score": 0.5}
                         for i in range(40)])
    full = _debug_header(sel, False, "cache_aware", 100_000, 2)
    whole = json.loads(full)
    assert whole["reasons"] and full.isascii() and ": " not in full
    assert whole["block"] == sel.memory_block  # the injected text, as injected
    no_block = json.loads(_debug_header(sel, False, "cache_aware", len(full) - 10, 2))
    assert no_block["block"] is None and no_block["reasons"] and len(no_block["hits"]) == 40
    capped = _debug_header(sel, False, "cache_aware", 600, 2)
    info = json.loads(capped)
    assert len(capped) <= 600 and info["truncated"] and info["reasons"] is None
    assert info["block"] is None
    assert 0 < len(info["hits"]) < 40 and info["tokens"] == 120


def test_debug_hits_carry_a_short_one_line_preview():
    from cwm_plugin.memory.models import Hit
    from cwm_plugin.sidecar.turn.memory_port import PREVIEW_CHARS, _hit_dict

    hit = Hit(text="user: my hive\n  is called   Honeycomb Hall" + " x" * 200, score=0.81234,
              source="session:monday", chunk_id="c" * 64, turn_ids=["t1"])
    out = _hit_dict(hit)
    assert out["preview"].startswith("user: my hive is called Honeycomb Hall")
    assert len(out["preview"]) == PREVIEW_CHARS and "\n" not in out["preview"]
    assert out["chunk_id"] == "c" * 12 and out["score"] == 0.8123


def test_developer_messages_are_the_prefix_like_system_ones():
    dev = {"role": "developer", "content": "Be terse."}
    sp = P.split([SYS, dev, {"role": "user", "content": "u1"}])
    assert sp.prefix == [SYS, dev] and sp.history == [] and sp.current[0]["content"] == "u1"
    only = P.split([dev])  # the last message is never the prefix
    assert only.prefix == [] and only.current == [dev]
