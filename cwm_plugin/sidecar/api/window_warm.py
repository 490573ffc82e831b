"""After a thaw through the sidecar: the thawed session's prompt state, and the warm-up.

The thawed session takes over the window's prompt state at once in this process (the engine wrote it
to the store for every other one), so its next turn is assembled to begin with the window's tokens.
A warm-up (``warm: true``) sends one ``max_tokens=1`` completion of the window's tokens under the
session's salt through vLLM, on the window's model, and reports the tokens vLLM restored (its
``external_prefix_cache_hits``); its tokens are the caller's usage, spent from its quota like any
request's. A warm-up that fails after a good thaw is reported in the answer (``warm.error``, a
warning), never as a failed thaw.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cwm_plugin.errors import CWMError, UpstreamError

log = logging.getLogger(__name__)
NOT_RECORDED = {"cwm": {"record": False}}  # the session's records stay the window's


def hits_of(metrics_text: str | None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(metrics_text or ""):
        for sample in fam.samples:
            if sample.name in ("vllm:external_prefix_cache_hits_total",
                               "vllm:external_prefix_cache_hits"):
                total += float(sample.value)
    return total


async def warm_up(sidecar: Any, token_ids: list[int], salt: str, model: str | None
                  ) -> dict[str, Any]:
    """One ``max_tokens=1`` completion of the window's tokens under ``salt`` on ``model``'s
    upstream: vLLM loads the restored blocks now. Never raises: a failure is ``error``."""
    router = sidecar.router
    try:
        route = await router.any_model(model, key=salt)  # where the session's turns go
        before = {e.name: hits_of(await e.client.metrics_text())
                  for e in route.candidates if e.up}
        t0 = time.perf_counter()
        ep, resp = await router.post(route, "/v1/completions", {
            "model": route.model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0,
            "cache_salt": salt, "kv_transfer_params": NOT_RECORDED})
        seconds = time.perf_counter() - t0
        if resp.status_code != 200:
            raise UpstreamError(f"the warm-up request answered HTTP {resp.status_code}")
        hits = hits_of(await ep.client.metrics_text()) - before.get(ep.name, 0.0)
    except CWMError as exc:
        log.warning("a warm-up after a thaw failed: %s", exc)
        return {"model": model, "error": str(exc),
                "hint": "the window is thawed; the session's next request restores it"}
    usage = resp.json().get("usage") or {}
    return {"model": route.model, "upstream": ep.name, "hits": int(hits),
            "seconds": round(seconds, 3), "prompt_tokens": usage.get("prompt_tokens"),
            "usage": usage}
