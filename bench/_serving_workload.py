"""bench/serving.py's workload: multi-round QA sessions in the shape of LMCache's benchmark.

N users share one system prompt; each has a context of its own (generated conversation text,
:mod:`cwm_plugin.testing.conversations.dialogues`) and asks R questions (the conversations'
questions), one a round; every answer is exactly A tokens (``ignore_eos``) at temperature 0 and goes
into the user's history, so round r+1 resends everything before it. Each user has a ``cache_salt``
of its own (as the sidecar gives every session), so users never share KV; behind the sidecar the
``X-Session-Id`` header names the session instead.

Arrivals: user i starts at ``i / qps``; its next round is sent ``users / qps`` seconds after
its previous one (so all users together offer ``qps`` requests a second), but never before
that round's answer has arrived plus ``think_s``. ``qps`` 0 is a closed loop (next round as
soon as the answer is in). Requests are streamed through the ``openai`` SDK's async client;
each request's send time, token arrival times (from vLLM's continuous usage stats, else one
token a content chunk) and failure are recorded. Built by :func:`build_sessions` (a tokenizer
and lines of text in, no server needed) and run by :class:`Runner`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cwm_plugin.testing.conversations.prompts import conversation_prompt

SYSTEM_PREAMBLE = ("You are a helpful assistant. The notes below are from a shared archive of "
                   "conversations; the user's own conversation follows in the first message. "
                   "Answer briefly.\n\n")


@dataclass(frozen=True)
class WorkloadSpec:
    users: int = 8
    rounds: int = 4
    answer_tokens: int = 32
    system_tokens: int = 150
    context_tokens: int = 700
    qps: float = 1.0          # target requests a second over all users; 0: closed loop
    think_s: float = 0.0      # at least this long between an answer and the user's next round
    seed: int = 0

    @property
    def gap_s(self) -> float:
        """Seconds between two rounds of one user (0 in a closed loop)."""
        return self.users / self.qps if self.qps > 0 else 0.0

    def prompt_tokens_after(self, rounds: int, question_tokens: int = 24) -> int:
        """About how many tokens a user's prompt holds after ``rounds`` rounds (chat template
        included): what sizes vLLM's KV cache against the users' KV."""
        per_round = question_tokens + self.answer_tokens + 12
        return self.system_tokens + len(SYSTEM_PREAMBLE) // 4 + self.context_tokens + \
            rounds * per_round


@dataclass
class Session:
    """One user's conversation so far."""

    name: str
    salt: str
    messages: list[dict[str, str]]
    questions: list[str]
    context: str
    turns: int = 0

    def next_messages(self) -> list[dict[str, str]]:
        q = self.questions[self.turns % len(self.questions)]
        content = f"{self.context}\n\n{q}" if self.turns == 0 else q
        return [*self.messages, {"role": "user", "content": content}]


@dataclass
class Request:
    """One streamed request: seconds on the runner's clock."""

    phase: str
    user: str
    round: int
    sent: float
    done: float = 0.0
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    error: str | None = None
    answer: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def returning(self) -> bool:
        return self.round > 0

    @property
    def first(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def build_sessions(spec: WorkloadSpec, tokenizer: Any, lines: Sequence[str],
                   questions: Sequence[str], *, tag: str, users: int | None = None
                   ) -> list[Session]:
    """``users`` (default ``spec.users``) fresh sessions named ``<tag>-u<i>``: the shared system
    prompt from the first lines, each context from a seeded place further on (the same user
    index gets the same text and questions under every tag), salts unique to the tag."""
    shared = conversation_prompt(tokenizer, spec.system_tokens, source=lines)
    system = SYSTEM_PREAMBLE + shared
    first, length = 0, -1       # the lines the system prompt used: contexts start after them
    while length < len(shared):
        length += len(lines[first]) + 1
        first += 1
    room = len(lines) - first
    out = []
    for i in range(spec.users if users is None else users):
        rng = random.Random(f"{spec.seed}-{i}")
        for _ in range(20):     # a start with enough text after it
            start = first + rng.randrange(max(room, 1))
            try:
                context = conversation_prompt(tokenizer, spec.context_tokens, source=lines,
                                              skip_lines=start)
                break
            except RuntimeError:
                continue
        else:
            raise RuntimeError("not enough text for the users' contexts")
        qs = list(questions)
        rng.shuffle(qs)
        out.append(Session(name=f"{tag}-u{i}", salt=f"serving-{tag}-{spec.seed}-u{i}",
                           messages=[{"role": "system", "content": system}],
                           questions=qs, context=context))
    return out


class Runner:
    """Streams sessions' rounds to an OpenAI-compatible server on the workload's schedule.

    ``salted``: send each session's ``cache_salt`` (straight to vLLM); else name the session
    with ``X-Session-Id`` (the sidecar salts it). ``on_done`` is called after every request.
    ``returning_priority``: vLLM's ``priority`` of every round after a session's first (what
    the sidecar sets for a vLLM scheduling by priority); None sends none.
    """

    def __init__(self, client: Any, model: str, spec: WorkloadSpec, *, salted: bool = True,
                 on_done: Callable[[Request], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 returning_priority: int | None = None) -> None:
        self.client, self.model, self.spec = client, model, spec
        self.salted, self.on_done, self.clock = salted, on_done, clock
        self.returning_priority = returning_priority

    async def run(self, sessions: Sequence[Session], rounds: int, phase: str) -> list[Request]:
        """``rounds`` more rounds of every session; the requests in the order they were sent."""
        t0 = self.clock()
        out: list[Request] = []
        n = len(sessions)
        qps = self.spec.qps
        gap = n / qps if qps > 0 else 0.0

        async def user(i: int, s: Session) -> None:
            at = t0 + (i / qps if qps > 0 else 0.0)
            for _ in range(rounds):
                await asyncio.sleep(max(0.0, at - self.clock()))
                r = await self.one(s, phase)
                out.append(r)
                if self.on_done:
                    self.on_done(r)
                at = max(r.sent + gap, r.done + self.spec.think_s)

        await asyncio.gather(*(user(i, s) for i, s in enumerate(sessions)))
        return sorted(out, key=lambda r: r.sent)

    async def one(self, s: Session, phase: str) -> Request:
        messages = s.next_messages()
        extra: dict[str, Any] = {"ignore_eos": True, "min_tokens": self.spec.answer_tokens}
        headers: dict[str, str] = {}
        if self.returning_priority is not None and s.turns > 0:
            extra["priority"] = self.returning_priority
        if self.salted:
            extra["cache_salt"] = s.salt
        else:
            headers["X-Session-Id"] = s.name
        r = Request(phase=phase, user=s.name, round=s.turns, sent=self.clock())
        parts: list[str] = []
        try:
            stream = await self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=self.spec.answer_tokens,
                temperature=0.0, stream=True, extra_body=extra, extra_headers=headers,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
            counted = 0
            async for chunk in stream:
                now = self.clock()
                text = "".join(c.delta.content or "" for c in chunk.choices if c.delta)
                parts.append(text)
                usage = getattr(chunk, "usage", None)
                if usage is not None:
                    r.prompt_tokens = usage.prompt_tokens or r.prompt_tokens
                    new = (usage.completion_tokens or 0) - counted
                else:
                    new = 1 if text else 0
                if chunk.choices and new > 0:
                    r.token_times.extend([now] * new)
                    counted += new
            if len(r.token_times) < self.spec.answer_tokens:
                r.error = f"truncated: {len(r.token_times)} of {self.spec.answer_tokens} tokens"
        except Exception as e:  # noqa: BLE001 -- any failure is a failed request, counted
            r.error = f"{type(e).__name__}: {str(e)[:200]}"
        r.done = self.clock()
        r.answer = "".join(parts)
        if r.ok:
            s.messages = [*messages, {"role": "assistant", "content": r.answer}]
        s.turns += 1
        return r
