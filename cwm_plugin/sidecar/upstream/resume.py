"""Resuming a streamed chat answer on another upstream when its upstream dies mid-answer.

A ``vllm serve`` killed while it streams an answer cuts the client's stream: the tokens relayed so
far cannot be taken back, so failing over to another upstream means going on from them, not starting
again. :func:`resumable_events` relays the upstream's stream in whole SSE events; when the upstream
fails (a broken connection, not a timeout: a slow upstream may still be generating) and the answer
so far is plain text from one choice, it asks the next upstream serving the route (healthy ones
first) -- or, where the upstream is a balancer over several servers (``balancer: true``:
vllm-router), the balancer again, which sends it to a live server -- for the rest: the same
request with the relayed text as a final assistant message that vLLM continues
(``continue_final_message``, no new generation prompt),
``max_tokens``/``max_completion_tokens``/``min_tokens`` less the tokens already relayed (vLLM
streams a token a chunk), and relays that stream after the events already sent. The cache salt
travels with the request, so the other server restores the session's KV from the shared tier and
only prefills the answer so far. A partial event of the dead stream is dropped; the continuation's
first chunk (its role) is harmless to OpenAI clients. A server that dies after its response began
but before its first token (it had sent the headers, or only the role chunk: a request sent just
before a kill) is asked nothing special: the same request goes whole to the next upstream (one that
dies before answering at all is retried whole by the router). Tool calls and several choices are not
resumed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from cwm_plugin.errors import UpstreamError, UpstreamTimeout
from cwm_plugin.sidecar.upstream.endpoints import Route, StreamHandle
from cwm_plugin.sidecar.upstream.stream import EVENT_END, Collected

log = logging.getLogger(__name__)
LIMITS = ("max_tokens", "max_completion_tokens")


def continuation(forward: dict[str, Any], collected: Collected) -> dict[str, Any] | None:
    """The request that goes on from what ``collected`` relayed: the same request when no
    token was relayed yet, else the continuation; ``None`` where the answer cannot be
    continued (tool calls, several choices, or done)."""
    if collected.done or collected.calls or int(forward.get("n") or 1) != 1:
        return None
    if not collected.chunks:
        return dict(forward)
    if not collected.text or not isinstance(forward.get("messages"), list):
        return None
    body = {**forward, "messages": [*forward["messages"],
                                    {"role": "assistant", "content": collected.text}],
            "continue_final_message": True, "add_generation_prompt": False}
    done = collected.relayed
    for key in LIMITS:
        if isinstance(body.get(key), int):
            if body[key] - done < 1:
                return None
            body[key] -= done
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = max(0, body["min_tokens"] - done)
    return body


async def resumable_events(
        router: Any, route: Route, path: str, forward: dict[str, Any], first: StreamHandle,
        collected: Collected, *, headers: dict[str, str] | None = None,
        on_resume: Callable[[StreamHandle, UpstreamError], None] | None = None,
        max_resumes: int = 2, priority: int | None = None) -> AsyncIterator[bytes]:
    """The stream of ``first`` in whole events, resumed on another upstream of ``route``
    when it fails mid-answer (see the module docstring; ``priority``: the turn's, as
    ``Router.open_stream`` takes it); closes the handles it opened."""
    handle, resumes, tried = first, 0, {first.ep.name}
    try:
        while True:
            buf = b""
            try:
                async for chunk in handle.chunks():
                    buf += chunk
                    ends = [m.end() for m in EVENT_END.finditer(buf)]
                    if ends:
                        out, buf = buf[:ends[-1]], buf[ends[-1]:]
                        yield out
                if buf:
                    yield buf
                return
            except UpstreamTimeout:
                raise
            except UpstreamError as exc:
                body = continuation(forward, collected)
                # the healthy ones first; one marked down by an old failure may be back (a
                # connect error there fails over to the next, as for a new request)
                others = sorted((ep for ep in route.candidates if ep.name not in tried),
                                key=lambda ep: not ep.up)
                if not others and handle.ep.cfg.balancer:
                    others = [handle.ep]    # it sends the continuation to a live server
                if body is None or not others or resumes >= max_resumes:
                    raise
                if not handle.ep.cfg.balancer:   # one of its servers failed, not it
                    router.health.failed(handle.ep, exc.code)
                log.warning("upstream `%s` failed mid-answer (%s): resuming after %d tokens "
                            "on `%s`", handle.ep.name, exc.code, collected.relayed,
                            others[0].name)
                nxt = await router.open_stream(dataclasses.replace(route, candidates=others),
                                               path, body, headers=headers,
                                               priority=priority)
                if nxt.resp is None or nxt.resp.status_code != 200:
                    await nxt.close()
                    raise
                if handle is not first:
                    await handle.close()
                handle, resumes = nxt, resumes + 1
                tried.add(handle.ep.name)
                if on_resume is not None:
                    on_resume(handle, exc)
    finally:
        if handle is not first:
            await handle.close()
