"""A small real OpenAI-compatible HTTP server for tests: records what it receives, answers
like vLLM from a script.

Everything vLLM's answer depends on that the sidecar does not touch (the model's wisdom) is scripted
here; what the sidecar sends is recorded exactly (body and headers), so a test can compare it with
what the client sent. Chat answers come from ``script(body) -> reply`` where a reply is
``{"content": str}`` or ``{"tool_calls": [...]}``; the default answers "ok". Streams are written
with CRLF line ends when ``crlf`` is set (the SSE format allows it), a chunk every ``stream_delay``
seconds; ``stream_cut_after`` N drops the connection after N chunks (a server killed mid-answer);
``held_tokens`` (token indexes) are streamed as vLLM streams a token whose text it holds back (part
of a UTF-8 character): no chunk of their own, their text on the next one, counted in its usage;
``models_gate`` (a ``threading.Event``) holds every ``/v1/models`` answer until it is set (a slow or
stuck upstream); ``models_status`` other than 200 answers ``/v1/models`` with that status (a
broken one). ``judge(text) -> P(yes)`` answers a ``/v1/completions`` asking for ``logprobs``
(a prompt or a list of them: each choice's first token's top log-probabilities, " yes" and
" no") and ``/v1/rerank`` (its documents' ``relevance_score``), as a re-ranking model would.
Like vLLM, a body it cannot use is a 400, never a 500, and a chat prompt over
``max_prompt_tokens`` (as ``usage_of`` counts) a 400 naming the context.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

Reply = dict[str, Any]


def usage_of(body: dict[str, Any], completion: int) -> dict[str, int]:
    prompt = sum(len(json.dumps(m).split()) for m in body.get("messages") or []) or \
        len(str(body.get("prompt") or body.get("input") or "").split())
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class FakeUpstream:
    def __init__(self, model: str = "fake", root: str | None = None, max_model_len: int = 4096,
                 script: Callable[[dict[str, Any]], Reply] | None = None) -> None:
        self.model = model
        self.root = root
        self.max_model_len = max_model_len
        self.script = script or (lambda body: {"content": "ok"})
        self.crlf = False
        self.embeddings_down = False  # answer /v1/embeddings with 503 (an outage)
        self.chat_status = 200  # answer chats with this HTTP status (500: a broken engine)
        self.chat_delay = 0.0  # seconds before a chat is answered (a stuck engine)
        # a chat whose body this answers True waits until it answers False (one call held)
        self.hold: Callable[[dict[str, Any]], bool] | None = None
        self.stream_delay = 0.0  # seconds between two streamed chunks (a model generating)
        self.stream_cut_after: int | None = None  # die after this many chunks (a killed server)
        self.held_tokens: set[int] = set()  # tokens whose text comes with the next one's chunk
        self.max_prompt_tokens: int | None = None  # longer chat prompts: 400, as vLLM
        self.calls: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.model_lists = 0  # GET /v1/models asked (health checks, model lookups)
        self.models_gate: threading.Event | None = None  # set: /v1/models answers
        self.models_status = 200  # answer /v1/models with this HTTP status
        self.judge: Callable[[str], float] = lambda text: 0.5  # P(yes) of a re-rank prompt
        self.app = FastAPI()
        self._routes()

    # --- what was received ------------------------------------------------------------------

    def bodies(self, path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
        return [b for p, b, _ in self.calls if p == path]

    def last(self, path: str = "/v1/chat/completions") -> dict[str, Any]:
        return self.bodies(path)[-1]

    def headers(self, path: str = "/v1/chat/completions") -> dict[str, str]:
        return next(h for p, _, h in reversed(self.calls) if p == path)

    # --- answers ----------------------------------------------------------------------------

    def _message(self, body: dict[str, Any], i: int) -> dict[str, Any]:
        reply = self.script(body)
        if "tool_calls" in reply:
            return {"role": "assistant", "content": None, "tool_calls": reply["tool_calls"]}
        text = reply["content"] if body.get("n", 1) == 1 else f"{reply['content']} #{i}"
        return {"role": "assistant", "content": text}

    def _chat(self, body: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for i in range(int(body.get("n") or 1)):
            msg = self._message(body, i)
            choice: dict[str, Any] = {"index": i, "message": msg, "finish_reason":
                                      "tool_calls" if msg.get("tool_calls") else "stop"}
            if body.get("logprobs"):
                words = (msg["content"] or "").split() or [""]
                choice["logprobs"] = {"content": [
                    {"token": w, "logprob": -0.5, "bytes": list(w.encode()), "top_logprobs": [
                        {"token": w, "logprob": -0.5, "bytes": list(w.encode())}]
                     [: body.get("top_logprobs") or 0]} for w in words]}
            choices.append(choice)
        return {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
                "model": body["model"], "choices": choices, "usage": usage_of(body, 3)}

    def _stream(self, body: dict[str, Any]):
        end = "\r\n" if self.crlf else "\n"
        msg = self._message(body, 0)
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
                "model": body["model"]}

        def event(obj: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(obj)}{end}{end}".encode()

        async def gen():
            for i, piece in enumerate(pieces()):
                if self.stream_cut_after is not None and i >= self.stream_cut_after:
                    raise ConnectionAbortedError("the fake upstream died mid-answer")
                yield piece
                await asyncio.sleep(self.stream_delay)

        opts = body.get("stream_options") or {}
        running = opts.get("include_usage") and opts.get("continuous_usage_stats")

        def chunk(delta: dict[str, Any], n: int) -> bytes:  # n: tokens so far (vLLM's usage)
            obj = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            return event({**obj, "usage": usage_of(body, n)} if running else obj)

        def pieces():
            if msg.get("tool_calls"):
                for i, call in enumerate(msg["tool_calls"]):
                    yield chunk({"tool_calls": [{"index": i, **call}]}, i + 1)
            else:
                held = ""
                for i, word in enumerate((msg["content"] or "").split(" ")):
                    if i in self.held_tokens:
                        held += word + " "
                        continue
                    yield chunk({"content": held + word + " "}, i + 1)
                    held = ""
            yield event({**base, "choices": [{"index": 0, "delta": {},
                                              "finish_reason": "stop"}]})
            if opts.get("include_usage"):  # the tokens streamed (continuous: as they went)
                n = len(msg.get("tool_calls") or []) or len((msg["content"] or "").split(" "))
                yield event({**base, "choices": [], "usage": usage_of(body, n if running else 3)})
            yield f"data: [DONE]{end}{end}".encode()

        return StreamingResponse(gen(), media_type="text/event-stream")

    def _judged(self, body: dict[str, Any]) -> dict[str, Any]:
        """One token a prompt, its top log-probabilities from ``judge``."""
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = []
        for i, text in enumerate(str(p) for p in prompts):
            yes = min(max(self.judge(text), 1e-6), 1 - 1e-6)
            top = {" yes": math.log(yes), " no": math.log(1 - yes)}
            choices.append({"index": i, "text": max(top, key=top.__getitem__),
                            "finish_reason": "length", "logprobs": {
                                "tokens": [max(top, key=top.__getitem__)],
                                "token_logprobs": [max(top.values())], "top_logprobs": [top],
                                "text_offset": [0]}})
        n = sum(len(str(p).split()) for p in prompts)
        return {"id": "cmpl-fake", "object": "text_completion", "created": 0,
                "model": body["model"], "choices": choices,
                "usage": {"prompt_tokens": n, "completion_tokens": len(prompts),
                          "total_tokens": n + len(prompts)}}

    def _completion_stream(self, body: dict[str, Any]) -> StreamingResponse:
        """A streamed ``/v1/completions``: text chunks, then usage when asked, then [DONE]."""
        base = {"id": "cmpl-fake", "object": "text_completion", "created": 0,
                "model": body["model"]}
        words = str(self.script(body).get("content") or "").split(" ")
        chunks = [{**base, "choices": [{"index": 0, "text": w + " ", "finish_reason": None}]}
                  for w in words]
        chunks.append({**base, "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**base, "choices": [], "usage": usage_of(body, len(words))})

        async def gen():
            for c in chunks:
                yield f"data: {json.dumps(c)}\n\n".encode()
                await asyncio.sleep(self.stream_delay)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    def _response_stream(self, body: dict[str, Any]) -> StreamingResponse:
        """The Responses API's events (named, no ``[DONE]``): a text delta a word of the
        script's answer, usage on the last one."""
        words = str(self.script(body).get("content") or "").split(" ")
        usage = usage_of(body, len(words))
        done = {"id": "resp_fake", "object": "response", "status": "completed",
                "model": body["model"], "usage": {"input_tokens": usage["prompt_tokens"],
                                                  "output_tokens": len(words), "total_tokens":
                                                  usage["total_tokens"]}}
        events = [("response.created", {"response": {**done, "status": "in_progress",
                                                     "usage": None}}),
                  *(("response.output_text.delta", {"item_id": "msg_1", "output_index": 0,
                                                    "content_index": 0, "delta": w})
                    for w in words),
                  ("response.completed", {"response": done})]

        async def gen():
            for n, (kind, data) in enumerate(events):
                obj = {"type": kind, "sequence_number": n, **data}
                yield f"event: {kind}\ndata: {json.dumps(obj)}\n\n".encode()
                await asyncio.sleep(self.stream_delay)

        return StreamingResponse(gen(), media_type="text/event-stream")

    def _routes(self) -> None:
        app = self.app

        @app.get("/health")  # as vLLM's (balancers probe it)
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            self.model_lists += 1
            if self.models_gate is not None:
                await asyncio.to_thread(self.models_gate.wait, 60)
            if self.models_status != 200:
                return JSONResponse({"error": "down"}, status_code=self.models_status)
            return JSONResponse({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "fake",
                 "root": self.root, "max_model_len": self.max_model_len}]})

        @app.post("/{path:path}")
        async def post(path: str, request: Request) -> Response:
            body = await request.json()
            self.calls.append((f"/{path}", body, dict(request.headers)))
            try:
                return await answer(path, body, request)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
                return JSONResponse({"error": {"message": f"bad request: {exc!r}"[:200],
                                               "type": "BadRequestError", "code": 400}},
                                    status_code=400)

        async def answer(path: str, body: dict[str, Any], request: Request) -> Response:
            rid = {"x-request-id": request.headers.get("x-request-id", "fake-rid")}
            if path == "v1/chat/completions":
                await asyncio.sleep(self.chat_delay)
                while self.hold is not None and self.hold(body):  # until it says go
                    await asyncio.sleep(0.05)
                if self.max_prompt_tokens is not None and \
                        usage_of(body, 0)["prompt_tokens"] > self.max_prompt_tokens:
                    return JSONResponse({"error": {
                        "message": f"This model's maximum context length is "
                                   f"{self.max_prompt_tokens} tokens", "type":
                        "BadRequestError", "code": 400}}, status_code=400)
                if self.chat_status != 200:
                    return JSONResponse({"error": {"message": "engine dead", "type": "x",
                                                   "code": self.chat_status}},
                                        status_code=self.chat_status)
                if body.get("stream"):
                    return self._stream(body)
                return JSONResponse(self._chat(body), headers=rid)
            if path == "v1/completions" and body.get("stream"):
                return self._completion_stream(body)
            if path == "v1/completions" and body.get("logprobs"):
                return JSONResponse(self._judged(body), headers=rid)
            if path == "v1/rerank":
                docs = [str(d) for d in body["documents"]]
                return JSONResponse({"id": "rerank-fake", "model": body["model"], "results": [
                    {"index": i, "relevance_score": self.judge(d)} for i, d in enumerate(docs)],
                    "usage": {"total_tokens": sum(len(d.split()) for d in docs)}}, headers=rid)
            if path == "v1/completions":
                return JSONResponse({"id": "cmpl-fake", "object": "text_completion",
                                     "created": 0, "model": body["model"], "choices": [
                                         {"index": 0, "text": self.script(body).get("content"),
                                          "finish_reason": "stop"}],
                                     "usage": usage_of(body, 3)}, headers=rid)
            if path == "v1/embeddings" and self.embeddings_down:
                return JSONResponse({"error": {"message": "down"}}, status_code=503)
            if path == "v1/embeddings":
                inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
                return JSONResponse({"object": "list", "model": body["model"], "data": [
                    {"object": "embedding", "index": i, "embedding": [float(len(t)), 1.0, 0.0]}
                    for i, t in enumerate(inputs)], "usage": {"prompt_tokens": 1,
                                                              "total_tokens": 1}}, headers=rid)
            if path == "v1/responses" and body.get("stream"):
                return self._response_stream(body)
            if path == "v1/responses":
                return JSONResponse({"id": "resp_fake", "object": "response", "created_at": 0,
                                     "model": body["model"], "status": "completed",
                                     "output": [{"type": "message", "id": "msg_1",
                                                 "role": "assistant", "status": "completed",
                                                 "content": [{"type": "output_text",
                                                              "text": "ok", "annotations": []}]}],
                                     "parallel_tool_calls": True, "tool_choice": "auto",
                                     "tools": []}, headers=rid)
            if path == "tokenize":
                text = body.get("prompt") or json.dumps(body.get("messages"))
                return JSONResponse({"count": len(text.split()), "tokens": [],
                                     "max_model_len": self.max_model_len})
            return JSONResponse({"error": {"message": "no such route"}}, status_code=404)
