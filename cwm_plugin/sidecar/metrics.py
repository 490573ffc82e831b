"""The sidecar's Prometheus metrics, in a registry of their own (one per app, no globals).

Counters are labelled by tenant and model. The prefix-cache hit rate is exposed two ways:
``cwm_sidecar_cached_prompt_tokens_total`` / ``cwm_sidecar_prompt_tokens_total`` per tenant (when
vLLM reports ``usage.prompt_tokens_details.cached_tokens``, i.e. runs with
``--enable-prompt-tokens-details``), and vLLM's own ``prefix_cache_hits``/``queries`` counters
mirrored at scrape time as ``cwm_upstream_prefix_cache_{hits,queries}`` (not per tenant).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

TM = ("tenant", "model")
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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
        self.upstream_errors = Counter("cwm_sidecar_upstream_errors", "Upstream failures",
                                       ("code",), registry=r)
        self.upstream_hits = Gauge("cwm_upstream_prefix_cache_hits",
                                   "vLLM's vllm:prefix_cache_hits, mirrored at scrape", registry=r)
        self.upstream_queries = Gauge("cwm_upstream_prefix_cache_queries",
                                      "vLLM's vllm:prefix_cache_queries, mirrored at scrape",
                                      registry=r)

    def observe_usage(self, tenant: str, model: str, usage: dict | None) -> None:
        if not usage:
            return
        self.prompt_tokens.labels(tenant, model).inc(usage.get("prompt_tokens") or 0)
        self.completion_tokens.labels(tenant, model).inc(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens"):
            self.cached_tokens.labels(tenant, model).inc(details["cached_tokens"])

    def observe_background(self, tenant: str, model: str, kind: str,
                           usage: dict | None) -> None:
        for key in ("prompt_tokens", "completion_tokens"):
            n = (usage or {}).get(key) or 0
            if n:
                self.background_tokens.labels(tenant, model, kind, key.split("_")[0]).inc(n)

    def mirror_upstream(self, text: str | None) -> None:
        if not text:
            return
        sums = upstream_counters(text)
        self.upstream_hits.set(sums.get("vllm:prefix_cache_hits", 0.0))
        self.upstream_queries.set(sums.get("vllm:prefix_cache_queries", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
