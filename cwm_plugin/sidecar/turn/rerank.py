"""The sidecar's memory re-ranker (``memory.rerank``): a model server scores the best memory
lines of a turn against its question (the memory side: ``memory/selection/rerank.py``).

``completions``: one ``/v1/completions`` request carrying a prompt a line, each the same
instruction and question followed by the line, ``max_tokens`` 1 and the top ``logprobs`` of the
answer's first token; a line's score is log P(yes) - log P(no) (a word missing from the top
ones counts as less likely than the least likely there). The shared beginning lets vLLM's prefix
cache reuse the instruction and question across the lines once they fill a KV block (16 tokens
on a GPU; on CPU blocks are 128 and a short question does not fill one: measured, no reuse); the
request carries the session's cache_salt, so that KV is the tenant's alone, and it goes on the
turn's route (the session's upstream first, failover as for the turn). ``rerank``: vLLM's ``/v1/rerank`` (a
cross-encoder the operator serves), ``relevance_score`` by index.

The selection runs on a memory thread; :meth:`UpstreamReranker.scores` sends on the app's event
loop and waits at most ``timeout_s``. Any failure raises, and the selection keeps its first
ranking (``RerankStage``). Time and prompt tokens are counted per tenant and model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from dataclasses import dataclass
from typing import Any

from cwm_plugin.memory.selection.rerank import RerankFailed
from cwm_plugin.memory.settings import RerankSettings

INSTRUCTION = ("Below are a question and one line from an earlier conversation. Does the line "
               "help answer the question? Answer yes or no.\n\nQuestion: {query}\n\n")
LINE = "Line: {text}\nAnswer:"
TOP_LOGPROBS = 20


def yes_no_score(top: dict[str, float]) -> float:
    """log P(yes) - log P(no) from one token's top log-probabilities (either word in any case,
    with or without its leading space); a word not among them is given the least one there,
    minus one."""
    floor = min(top.values(), default=0.0) - 1.0

    def best(word: str) -> float:
        got = [lp for tok, lp in top.items() if tok.strip().lower() == word]
        return math.log(sum(math.exp(lp) for lp in got)) if got else floor

    return best("yes") - best("no")


@dataclass
class UpstreamReranker:
    router: Any  # upstream.router.Router
    route: Any  # the turn's Route; None: the re-rank model's, looked up when asked
    salt: str
    loop: asyncio.AbstractEventLoop
    cfg: RerankSettings
    metrics: Any  # SidecarMetrics
    tenant: str
    model: str

    @property
    def name(self) -> str:
        return f"{self.cfg.kind}:{self.model}"

    @property
    def top_n(self) -> int:
        return self.cfg.top_n

    @property
    def weight(self) -> float:
        return self.cfg.weight

    def scores(self, query: str, texts: list[str]) -> list[float]:
        fut = asyncio.run_coroutine_threadsafe(self._ask(query, texts), self.loop)
        try:
            return fut.result(self.cfg.timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise RerankFailed(f"no answer within memory.rerank.timeout_s "
                               f"({self.cfg.timeout_s} s)") from None

    async def _ask(self, query: str, texts: list[str]) -> list[float]:
        path, body = request(self.cfg.kind, self.model, query, texts, self.salt)
        if self.route is None:  # (a model no upstream serves fails here: counted, logged once)
            self.route = await self.router.for_model(self.model, key=self.salt)
        with self.metrics.rerank_seconds.labels(self.tenant, self.model).time():
            _, resp = await self.router.post(self.route, path, body, timeout=self.cfg.timeout_s)
        if resp.status_code != 200:
            raise RerankFailed(f"{path} answered HTTP {resp.status_code}: {resp.text[:200]}")
        data = resp.json()
        self.metrics.rerank_tokens.labels(self.tenant, self.model).inc(prompt_tokens(data))
        return scores_of(self.cfg.kind, path, data, len(texts))


def request(kind: str, model: str, query: str, texts: list[str],
            salt: str | None) -> tuple[str, dict[str, Any]]:
    """The path and body that ask ``kind`` to score ``texts`` for ``query``."""
    if kind == "rerank":
        return "/v1/rerank", {"model": model, "query": query, "documents": texts}
    head = INSTRUCTION.format(query=query)
    body: dict[str, Any] = {"model": model, "prompt": [head + LINE.format(text=t) for t in texts],
                            "max_tokens": 1, "temperature": 0.0, "logprobs": TOP_LOGPROBS}
    return "/v1/completions", {**body, "cache_salt": salt} if salt else body


def prompt_tokens(data: dict[str, Any]) -> int:
    usage = data.get("usage") or {}
    return int(usage.get("prompt_tokens") or usage.get("total_tokens") or 0)


def scores_of(kind: str, path: str, data: dict[str, Any], n: int) -> list[float]:
    """A score for each of the ``n`` texts from the answer, in order (``RerankFailed`` when
    one is missing)."""
    try:
        if kind == "rerank":
            by_index = {int(r["index"]): float(r["relevance_score"]) for r in data["results"]}
        else:
            by_index = {int(c["index"]): yes_no_score(c["logprobs"]["top_logprobs"][0] or {})
                        for c in data["choices"]}
        return [by_index[i] for i in range(n)]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise RerankFailed(f"{path} answered without a score for every line "
                           f"({type(exc).__name__}: {exc})"[:300]) from None


def reranker_for(sc: Any, tenant: str, route: Any, salt: str,
                 model: str) -> UpstreamReranker | None:
    """The turn's re-ranker, or None (``memory.rerank.kind: off``, or no memory). Called on
    the event loop."""
    cfg = sc.settings.memory.rerank if sc.memory is not None else None
    if cfg is None or cfg.kind == "off":
        return None
    if cfg.model and cfg.model != model:
        route = None
    return UpstreamReranker(sc.router, route, salt, asyncio.get_running_loop(), cfg,
                            sc.metrics, tenant, cfg.model or model)
