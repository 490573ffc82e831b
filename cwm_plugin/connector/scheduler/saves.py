"""The scheduler side's saves: which blocks each step saves, and the record a request leaves.

Saving policy: a block is saved in the step whose forward pass completes it (prompt blocks during
prefill, chunk by chunk; generated blocks as decoding fills them). The worker copies the block
out of the paged cache at the end of that step, before the scheduler can free or reuse it, and
encodes and writes it in the background, so ``request_finished`` never has to hold blocks back.
Saves are planned from what is known in memory: a block some tier holds already is skipped by
the worker's store, in the background.

When a salted request whose blocks were saved finishes, a context record is written for the
window engine (:mod:`~cwm_plugin.connector.records`; only where the store has a disk or Redis
tier), also under its client turn's slot when the request names one, never replacing the
record of a turn that arrived later; ``record: false`` in a request's ``kv_transfer_params``
(a warm-up) leaves the session's records alone (:mod:`~cwm_plugin.connector.params`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import KW_ONLY, asdict, dataclass, field
from typing import Any

from cwm_plugin.connector import records
from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.content import ContentChains
from cwm_plugin.connector.keys import KeyNamespace, kv_block_hashes
from cwm_plugin.connector.metadata import BlockTransfer, CWMConnectorMetadata
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.params import RequestParams, params_of
from cwm_plugin.connector.scheduler.events import TierEvents
from cwm_plugin.connector.scheduler.known import KnownBlocks
from cwm_plugin.connector.scheduler.requests import RequestState, eligible
from cwm_plugin.connector.warn_once import WarnOnce
from cwm_plugin.store.kv_store import KVStore

log = logging.getLogger(__name__)


@dataclass
class Saves:
    """Plans saves into each step's metadata and writes context records; the scheduler side
    owns one (``workers``: its (namespace, TP rank) pairs; ``max_blocks``: the most blocks of
    one request stored)."""

    cfg: ConnectorConfig
    store: KVStore
    stats: StatsCollector
    _: KW_ONLY
    ns: KeyNamespace
    workers: list[tuple[KeyNamespace, int]]
    hash_ratio: int
    max_blocks: int
    known: KnownBlocks
    contents: ContentChains
    events: TierEvents | None = None  # our tiers' KV events (vLLM's events on)
    keeps_records: bool = field(init=False)

    def __post_init__(self) -> None:
        self.block_size = self.ns.block_size
        self.keeps_records = self.cfg.context_records and records.readable(self.store)
        if self.cfg.context_records and not self.keeps_records:
            log.warning("cwm connector: the store has no disk or Redis tier, so no context "
                        "records are kept (context windows freeze sessions from them, reading "
                        "the durable tiers); add a disk_path or redis_url to use windows")
        self._warn = WarnOnce(log)

    def _hashes(self, request: Any, num_blocks: int) -> list[bytes]:
        return kv_block_hashes(request.block_hashes, num_blocks, self.hash_ratio)

    def plan(self, state: RequestState, req_id: str, tokens_done: int,
             meta: CWMConnectorMetadata) -> None:
        """Plan the blocks completed by ``tokens_done`` that are neither planned nor known
        stored (a block held somewhere unknown to us is skipped by the worker's store)."""
        if not self.cfg.save_enabled or not eligible(self.cfg, state.request):
            return
        limit = tokens_done if self.cfg.save_decode_blocks else min(
            tokens_done, state.request.num_prompt_tokens)
        n_full = min(limit // self.block_size, len(state.block_ids), self.max_blocks)
        if n_full <= state.handled_blocks:
            return
        hashes = self._hashes(state.request, n_full)
        n_full = len(hashes)
        start = state.handled_blocks
        lo, hi = state.loaded        # loaded from the store just now: stored
        todo = [i for i in range(start, n_full) if not lo <= i < hi and (state.extra or (
            not self.known.planned(hashes[i]) and self.known.get(hashes[i]) is None))]
        state.handled_blocks = n_full
        state.saved_blocks = max(state.saved_blocks, n_full)
        if todo:
            contents = self.contents.of(state.request, hashes)
            meta.saves.append(BlockTransfer(req_id, [state.block_ids[i] for i in todo],
                                            [hashes[i] for i in todo],
                                            num_tokens=n_full * self.block_size,
                                            salt=getattr(state.request, "cache_salt", None),
                                            extra=state.extra,
                                            contents=[contents[i] for i in todo]
                                            if contents else []))
            if not state.extra:
                self.known.plan(hashes[i] for i in todo)
                if self.events is not None:
                    self.events.planned(hashes, todo, state.request.all_token_ids,
                                        getattr(state.request, "cache_salt", None))

    def finished(self, state: RequestState | None, request: Any, model: str) -> None:
        """A request finished: write its context record when it is due (``model``: the name
        vLLM serves the model under)."""
        salt = getattr(request, "cache_salt", None)
        if state is not None and salt and state.saved_blocks and self.keeps_records:
            params = params_of(request)
            if params.record and params.store:
                self._write_record(state, salt, params, model)

    def _write_record(self, state: RequestState, salt: str, params: RequestParams,
                      model: str) -> None:
        req = state.request
        lora = getattr(req, "lora_request", None)
        rec = records.ContextRecord(
            tokens=list(req.all_token_ids),
            block_hashes=[h.hex() for h in self._hashes(req, state.saved_blocks)],
            workers=[(ns.scoped(state.extra).hex(), rank) for ns, rank in self.workers],
            block_size=self.block_size, hash_block_size=self.block_size // self.hash_ratio,
            hash_algo=self.ns.hash_algo, namespace=asdict(self.ns),
            lora=[lora.lora_name, str(lora.lora_path)] if lora else None, created=time.time(),
            turn=params.turn, num_prompt_tokens=int(req.num_prompt_tokens), arrived=params.at,
            model=model or self.ns.model)
        body = asdict(rec)
        for key in [records.context_record_key(salt)] + \
                ([records.turn_record_key(salt, params.slot)] if params.slot is not None else []):
            if not records.write_record(self.store, key, body, records.RECORD_LAYOUT,
                                        what="a context record", salt=salt, wait=0,
                                        order=rec.order):
                self.stats.add("save_errors", reason="backpressure")
                self._warn("records", "the store's save queue is full: context records are "
                           "dropped until it drains (counted as cwm:connector_save_errors"
                           "{reason=backpressure})")
