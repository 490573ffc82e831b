"""Relaying a server-sent-event stream from vLLM to the client, byte for byte.

Events are forwarded exactly as vLLM wrote them (events end with a blank line; lines may end
with CRLF, LF or CR, as the SSE format allows). On the side, each ``data:`` payload is parsed
to collect the answer text and the final ``usage``. When the sidecar itself asked for usage
(``stream_options.include_usage``) and the client did not, the usage-only event is withheld,
and the one field vLLM moves onto it in that mode (``system_fingerprint``, which it otherwise
puts on the terminal chunk) is put back at the end of the terminal chunk, so the client sees
exactly the stream vLLM sends a client that did not ask for usage. ``on_done`` runs before the
``[DONE]`` event is passed on (the turn is in memory before the client learns it has ended). An
upstream failure in mid-stream becomes one OpenAI-shaped error event; the stream never hangs
beyond the upstream read timeout. A stream that ends before its end (the client went away, or
the upstream failed) is billed for what was relayed (``Collected.chunks``: vLLM streams a token
a chunk; ``usage.py``'s ``Meter``) unless its usage had already come. After a resume on another
upstream (``resume.py``) the events carrying ``usage`` are rewritten to count the whole answer
(:func:`_resumed`); every other byte is still vLLM's.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cwm_plugin.errors import CWMError
from cwm_plugin.sidecar.http.errors import sse_error

log = logging.getLogger(__name__)


@dataclass
class Collected:
    """What a relayed stream carried, for memory and metrics."""

    parts: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, str]] = field(default_factory=dict)  # streamed tool calls
    usage: dict[str, Any] | None = None
    chunks: int = 0  # chunks that carried text or a tool call's fragment (a token each)
    # (or, of the Responses API, a text delta)
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None
    carried: int = 0  # tokens relayed before the stream was resumed on another upstream
    prompt_tokens: int | None = None  # the prompt's, as the first upstream's usage said

    def _whole(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A resumed answer's ``usage`` as the client's whole answer counts: the tokens relayed
        before the resume added to the continuation's, and the prompt's as the first upstream
        counted them (else the continuation's less the relayed answer in it)."""
        usage = dict(usage)
        done = usage.get("completion_tokens")
        if isinstance(done, int):
            usage["completion_tokens"] = done + self.carried
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int):
            usage["prompt_tokens"] = self.prompt_tokens if self.prompt_tokens is not None \
                else max(0, prompt - self.carried)
            if isinstance(usage.get("completion_tokens"), int):
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return usage

    @property
    def relayed(self) -> int:
        """Tokens relayed so far: the chunks that carried text, or the upstream's own count
        when its usage came along and says more (vLLM sends no chunk for a token whose text it
        holds back, such as part of a UTF-8 character, but counts it)."""
        done = (self.usage or {}).get("completion_tokens")
        return max(self.chunks, done) if isinstance(done, int) else self.chunks

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The streamed tool calls, in the shape of a non-streamed message's ``tool_calls``."""
        return [{"type": "function", "function": dict(c)} for _, c in sorted(self.calls.items())]

    def feed(self, obj: dict[str, Any], *, chat: bool) -> None:
        if obj.get("usage") and isinstance(obj["usage"], dict):
            self.usage = obj["usage"] if not self.carried else self._whole(obj["usage"])
            if not self.carried and isinstance(self.usage.get("prompt_tokens"), int):
                self.prompt_tokens = self.usage["prompt_tokens"]
        elif obj.get("type") == "response.completed":  # the Responses API's final event
            done = obj.get("response")
            if isinstance(done, dict) and isinstance(done.get("usage"), dict):
                self.usage = done["usage"]
        elif obj.get("type") == "response.output_text.delta" and obj.get("delta"):
            self.chunks += 1
        for choice in obj.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            piece = delta.get("content") if chat else choice.get("text")
            if piece:
                self.parts.append(piece)
                self.chunks += 1
            for call in delta.get("tool_calls") or [] if chat else []:
                self.chunks += 1
                fn = call.get("function") or {}
                got = self.calls.setdefault(int(call.get("index", 0)),
                                            {"name": "", "arguments": ""})
                got["name"] += fn.get("name") or ""
                got["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if "error" in obj:
            self.error = str(obj["error"])[:300]


CUT_MARK = "[cut off: the stream ended before the answer did]"


EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")  # SSE allows CRLF, LF or CR line ends


def _payload(event: bytes) -> bytes | None:
    for line in event.splitlines():
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


def _splice_fingerprint(event: bytes, fingerprint: str) -> bytes:
    """``event`` with ``"system_fingerprint": ...`` added as the last field of its object."""
    end = event.rfind(b"}")
    extra = b',"system_fingerprint":' + json.dumps(fingerprint).encode()
    return event[:end] + extra + event[end:]


def ask_usage(forward: dict[str, Any]) -> bool:
    """Make a streamed chat or completions request report its usage (it is accounted);
    returns whether the client asked for it itself (else the usage event is withheld)."""
    opts = forward.get("stream_options") or {}
    wanted = bool(isinstance(opts, dict) and opts.get("include_usage"))
    if not wanted:
        forward["stream_options"] = {**(opts if isinstance(opts, dict) else {}),
                                     "include_usage": True}
    return wanted


def _resumed(event: bytes, obj: dict[str, Any], collected: Collected) -> bytes:
    """``event`` of a resumed answer with the usage :meth:`Collected.feed` just counted for
    the whole answer, so a client summing ``continuous_usage_stats`` never sees the count go
    back."""
    ends = list(EVENT_END.finditer(event))
    end = event[ends[-1].start():] if ends else b"\n\n"
    return b"data: " + json.dumps({**obj, "usage": collected.usage},
                                  separators=(",", ":")).encode() + end


def _terminal(obj: dict[str, Any]) -> bool:
    return any(c.get("finish_reason") for c in obj.get("choices") or [])


async def relay_sse(source: AsyncIterator[bytes], collected: Collected, *, chat: bool,
                    strip_usage: bool,
                    on_done: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[bytes]:
    """Yield the upstream SSE bytes (see the module docstring)."""
    buf = b""
    held: tuple[bytes, dict[str, Any]] | None = None  # a terminal chunk awaiting the usage
    try:
        async for chunk in source:
            buf += chunk
            while True:
                end = EVENT_END.search(buf)
                if end is None:
                    break
                event, buf = buf[: end.end()], buf[end.end():]
                data = _payload(event)
                obj = None
                if data and data != b"[DONE]":
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        obj = None
                if isinstance(obj, dict):
                    collected.feed(obj, chat=chat)
                    if collected.carried and obj.get("usage") and isinstance(obj["usage"],
                                                                             dict):
                        event = _resumed(event, obj, collected)
                    if strip_usage and obj.get("choices") == [] and obj.get("usage"):
                        fp = obj.get("system_fingerprint")
                        if held is not None:
                            ev, hobj = held
                            if fp and "system_fingerprint" not in hobj:
                                ev = _splice_fingerprint(ev, fp)
                            held = None
                            yield ev
                        continue
                if held is not None:
                    yield held[0]
                    held = None
                if isinstance(obj, dict) and strip_usage and _terminal(obj):
                    held = (event, obj)
                    continue
                if data == b"[DONE]":
                    collected.done = True
                    if on_done is not None:
                        await on_done()
                yield event
        if held is not None:
            yield held[0]
        if buf:
            yield buf
    except CWMError as exc:
        if held is not None:
            yield held[0]
        collected.error = exc.message
        log.warning("upstream stream failed: %s", exc.message)
        yield sse_error(exc.http_status, str(exc), exc.code)
