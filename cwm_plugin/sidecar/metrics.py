"""The sidecar's Prometheus metrics, in a registry of their own (one per app, no globals).

Counters are labelled by tenant and model; the upstream ones by upstream (its configured
name). The prefix-cache hit rate is exposed two ways:
``cwm_sidecar_cached_prompt_tokens_total`` / ``cwm_sidecar_prompt_tokens_total`` per tenant (when
vLLM reports ``usage.prompt_tokens_details.cached_tokens``, i.e. runs with
``--enable-prompt-tokens-details``), and each upstream's own ``prefix_cache_hits``/``queries``
counters mirrored at scrape time as ``cwm_upstream_prefix_cache_{hits,queries}{upstream}``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

TM = ("tenant", "model")
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
UPSTREAM_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class SidecarMetrics:
    """Every metric the sidecar writes, defined once."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("cwm_sidecar_requests", "Requests answered",
                                ("tenant", "model", "route", "status"), registry=r)
        self.prompt_tokens = Counter("cwm_sidecar_prompt_tokens", "Prompt tokens (vLLM usage)",
                                     TM, registry=r)
        self.completion_tokens = Counter("cwm_sidecar_completion_tokens",
                                         "Completion tokens (vLLM usage)", TM, registry=r)
        self.cached_tokens = Counter("cwm_sidecar_cached_prompt_tokens",
                                     "Prompt tokens served from vLLM's prefix cache", TM,
                                     registry=r)
        self.injected_tokens = Counter("cwm_sidecar_injected_tokens",
                                       "Tokens of memory injected into prompts", TM, registry=r)
        self.saved_tokens = Counter("cwm_sidecar_saved_tokens",
                                    "Prompt tokens saved against replaying the full history",
                                    TM, registry=r)
        self.retrieval_seconds = Histogram("cwm_sidecar_retrieval_seconds",
                                           "Memory selection time per turn", TM,
                                           buckets=LATENCY_BUCKETS, registry=r)
        self.rerank_seconds = Histogram("cwm_sidecar_rerank_seconds",
                                        "Memory re-ranking (memory.rerank) per turn: the model "
                                        "server's answer", TM, buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.rerank_tokens = Counter("cwm_sidecar_rerank_tokens",
                                     "Prompt tokens the model server read to re-rank memory",
                                     TM, registry=r)
        self.overhead_seconds = Histogram("cwm_sidecar_overhead_seconds",
                                          "Time spent in the sidecar before forwarding", TM,
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.context_warnings = Counter("cwm_sidecar_context_warnings",
                                        "Turns over a context threshold", ("tenant", "model",
                                                                           "level"), registry=r)
        self.context_fraction = Histogram("cwm_sidecar_context_fraction",
                                          "Prompt tokens / max_model_len per turn", TM,
                                          buckets=(.1, .25, .5, .7, .85, .95, 1.0), registry=r)
        self.checkpoints = Counter("cwm_sidecar_checkpoints", "Automatic session checkpoints",
                                   TM, registry=r)
        self.background = Counter("cwm_sidecar_background_tasks", "Summaries and fact extractions",
                                  ("tenant", "kind", "outcome"), registry=r)
        self.background_jobs = Counter("cwm_sidecar_background_jobs",
                                       "Background jobs (summaries, facts, checkpoints) by "
                                       "outcome: queued, merged, dropped (queue full), done, "
                                       "failed", ("outcome",), registry=r)
        self.background_queue = Gauge("cwm_sidecar_background_queue_depth",
                                      "Background jobs waiting or running", registry=r)
        self.background_tokens = Counter("cwm_sidecar_background_tokens",
                                         "Tokens of the model's own work for a tenant (vLLM "
                                         "usage of summaries and fact extraction): a tenant's "
                                         "usage is these plus its prompt and completion tokens",
                                         ("tenant", "model", "kind", "type"), registry=r)
        self.facts = Counter("cwm_sidecar_facts", "Extracted facts by outcome: added, "
                             "duplicate, updated", ("tenant", "outcome"), registry=r)
        self.facts_refused = Counter("cwm_sidecar_facts_refused",
                                     "Fact extractions refused after a retry (invalid JSON)",
                                     TM, registry=r)
        self.memory_failures = Counter("cwm_sidecar_memory_failures",
                                       "Requests answered without memory (or not recorded) "
                                       "after a memory, index or embedder failure",
                                       ("tenant", "stage"), registry=r)
        self.stage_seconds = Histogram("cwm_sidecar_stage_seconds",
                                       "Sidecar time per request by stage (upstream excluded)",
                                       ("stage",), buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_errors = Counter("cwm_sidecar_upstream_errors",
                                       "Upstream failures (connect errors, timeouts, HTTP 5xx)",
                                       ("upstream", "code"), registry=r)
        self.upstream_requests = Counter("cwm_sidecar_upstream_requests",
                                         "Requests sent to an upstream, by outcome",
                                         ("upstream", "model", "status"), registry=r)
        self.upstream_latency = Histogram("cwm_sidecar_upstream_latency_seconds",
                                          "Time until an upstream's response headers",
                                          ("upstream",), buckets=UPSTREAM_BUCKETS, registry=r)
        self.upstream_up = Gauge("cwm_sidecar_upstream_up", "1 while an upstream is healthy",
                                 ("upstream",), registry=r)
        self.upstream_failovers = Counter("cwm_sidecar_upstream_failovers",
                                          "Requests moved to the next upstream after a failure",
                                          ("upstream", "to"), registry=r)
        self.routed = Counter("cwm_sidecar_routed_requests",
                              "Requests routed by role (model aliases such as `auto`)",
                              ("role",), registry=r)
        self.cost = Counter("cwm_sidecar_cost", "Cost of the tokens used, at the configured "
                            "prices (pricing.currency)", ("tenant", "model", "kind"), registry=r)
        self.salt_moves = Counter("cwm_sidecar_salt_moves", "Sessions' first salted request "
                                  "after a secret rotation, by outcome: moved (its KV re-keyed "
                                  "to the new salt), none (nothing stored), failed",
                                  ("tenant", "outcome"), registry=r)
        self.rate_limited = Counter("cwm_sidecar_rate_limited", "Requests refused with 429: "
                                    "over the principal's request rate (limit=requests) or "
                                    "token quota (tokens); storage_error: the limits' storage "
                                    "failed and the request passed", ("tenant", "limit"),
                                    registry=r)
        self.streams_cut = Counter("cwm_sidecar_streams_cut", "Streamed answers that ended "
                                   "before their end (the client went away, or the upstream "
                                   "failed): billed and recorded up to what was relayed",
                                   ("tenant", "model", "route"), registry=r)
        self.streams_resumed = Counter(
            "cwm_sidecar_streams_resumed", "Streamed chat answers whose upstream failed "
            "mid-answer and that went on from the relayed text on another upstream",
            ("tenant", "model", "upstream", "to"), registry=r)
        self.windows_restores = Counter(
            "cwm_sidecar_prompt_restores", "Continuing sessions this process had not seen whose "
            "stored prompt state was looked up (adopted, error)", ("outcome",), registry=r)
        self.upstream_hits = Gauge("cwm_upstream_prefix_cache_hits",
                                   "vLLM's vllm:prefix_cache_hits, mirrored at scrape",
                                   ("upstream",), registry=r)
        self.upstream_queries = Gauge("cwm_upstream_prefix_cache_queries",
                                      "vLLM's vllm:prefix_cache_queries, mirrored at scrape",
                                      ("upstream",), registry=r)

    def observe_usage(self, tenant: str, model: str, usage: dict | None) -> None:
        if not usage:
            return
        prompt, completion, cached = tokens_of(usage)
        self.prompt_tokens.labels(tenant, model).inc(prompt)
        self.completion_tokens.labels(tenant, model).inc(completion)
        if cached:
            self.cached_tokens.labels(tenant, model).inc(cached)

    def observe_background(self, tenant: str, model: str, kind: str,
                           usage: dict | None) -> None:
        for key in ("prompt_tokens", "completion_tokens"):
            n = (usage or {}).get(key) or 0
            if n:
                self.background_tokens.labels(tenant, model, kind, key.split("_")[0]).inc(n)

    def mirror_upstream(self, texts: dict[str, str]) -> None:
        """Each upstream's ``/metrics`` text (by name) into the mirrored gauges."""
        for name, text in texts.items():
            sums = upstream_counters(text)
            self.upstream_hits.labels(name).set(sums.get("vllm:prefix_cache_hits", 0.0))
            self.upstream_queries.labels(name).set(sums.get("vllm:prefix_cache_queries", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def tokens_of(usage: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens from a chat/completions ``usage`` or a
    responses one (``input_tokens``, ``output_tokens``); anything not a count is 0."""
    def whole(v: Any) -> int:
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0

    prompt = whole(usage.get("prompt_tokens", usage.get("input_tokens")))
    completion = whole(usage.get("completion_tokens", usage.get("output_tokens")))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = whole(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return prompt, completion, min(cached, prompt)


def upstream_counters(text: str) -> dict[str, float]:
    """vLLM's /metrics text as {family name without ``_total``: value summed over labels}."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            name = s.name[:-6] if s.name.endswith("_total") else s.name
            out[name] = out.get(name, 0.0) + float(s.value)
    return out
