"""Scheduler side of the connector: which blocks to load and which to save, per step.

Runs in vLLM's EngineCore process. It never touches tensors: it answers
``get_num_new_matched_tokens`` from the store's index (durable tiers) and from what the worker
reported storing (its memory tier), and turns each scheduler step into a
:class:`CWMConnectorMetadata` of loads and saves.

Saving policy: a block is saved in the step whose forward pass completes it (prompt blocks during
prefill, chunk by chunk; generated blocks as decoding fills them). The worker copies the block
out of the paged cache at the end of that step, before the scheduler can free or reuse it, and
encodes and writes it in the background, so ``request_finished`` never has to hold blocks back.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.keys import Namespace, block_keys
from cwm_plugin.connector.metadata import BlockTransfer, CWMConnectorMetadata, CWMWorkerMetadata
from cwm_plugin.connector.stats import StatsCollector
from cwm_plugin.store.tiered import KVStore

log = logging.getLogger(__name__)

KNOWN_KEYS_LIMIT = 1_000_000


@dataclass
class _RequestState:
    request: Any  # vllm.v1.request.Request, live: its block_hashes grow as it decodes
    block_ids: list[int] = field(default_factory=list)
    handled_blocks: int = 0  # blocks [0, handled) are stored, being stored, or skipped
    lookup_start: int = 0
    lookup_hits: int = 0
    load: BlockTransfer | None = None


class SchedulerSide:
    def __init__(self, ns: Namespace, cfg: ConnectorConfig, store: KVStore,
                 stats: StatsCollector) -> None:
        self.ns = ns
        self.cfg = cfg
        self.store = store
        self.stats = stats
        self.block_size = ns.block_size
        self._reqs: dict[str, _RequestState] = {}
        self._known: OrderedDict[bytes, None] = OrderedDict()

    # --- helpers ------------------------------------------------------------------------------

    def _eligible(self, request: Any) -> bool:
        return not self.cfg.salted_only or bool(getattr(request, "cache_salt", None))

    def _cap_blocks(self) -> int:
        return self.cfg.max_stored_tokens_per_request // self.block_size

    def _present(self, keys: list[bytes]) -> list[bool]:
        unknown = [k for k in keys if k not in self._known]
        found = dict(zip(unknown, self.store.contains_many(unknown), strict=True)) if unknown else {}
        return [k in self._known or found.get(k, False) for k in keys]

    def _remember(self, keys: set[bytes]) -> None:
        for k in keys:
            self._known[k] = None
            self._known.move_to_end(k)
        while len(self._known) > KNOWN_KEYS_LIMIT:
            self._known.popitem(last=False)

    # --- vLLM hooks ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._reqs.setdefault(request.request_id, _RequestState(request))
        state.request = request
        if not self.cfg.load_enabled or not self._eligible(request):
            return 0, False
        # Leave at least one token to compute: vLLM needs a forward pass to sample from.
        max_blocks = min((request.num_tokens - 1) // self.block_size, self._cap_blocks())
        start = num_computed_tokens // self.block_size
        if start >= max_blocks:
            return 0, False
        keys = block_keys(self.ns, request.block_hashes, max_blocks)[start:]
        hits = 0
        for present in self._present(keys):
            if not present:
                break
            hits += 1
        state.lookup_start, state.lookup_hits = start, hits
        self.stats.lookup(queried=len(keys) * self.block_size, hit=hits * self.block_size)
        return hits * self.block_size, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._reqs.setdefault(request.request_id, _RequestState(request))
        if num_external_tokens <= 0:
            return
        n = num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0]
        start = state.lookup_start
        keys = block_keys(self.ns, request.block_hashes, start + n)[start:]
        state.load = BlockTransfer(request.request_id, list(block_ids[start:start + n]), keys,
                                   num_tokens=(start + n) * self.block_size)

    def build_connector_meta(self, scheduler_output: Any) -> CWMConnectorMetadata:
        meta = CWMConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            # Blocks computed before this step (local prefix cache or loaded by us) are either
            # stored already or were computed by this server earlier: check, don't re-save.
            state.handled_blocks = 0
            self._plan_save(state, new.req_id, new.num_computed_tokens
                            + scheduler_output.num_scheduled_tokens.get(new.req_id, 0), meta,
                            check_existing=True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan_save(state, req_id, done, meta, check_existing=req_id in cached.resumed_req_ids)
        for state in self._reqs.values():
            if state.load is not None:
                meta.loads.append(state.load)
                self._remember(set(state.load.keys))
                state.load = None
        for req_id in scheduler_output.finished_req_ids:
            self._reqs.pop(req_id, None)
        return meta

    def _plan_save(self, state: _RequestState, req_id: str, tokens_done: int,
                   meta: CWMConnectorMetadata, *, check_existing: bool) -> None:
        if not self.cfg.save_enabled or not self._eligible(state.request):
            return
        limit = tokens_done if self.cfg.save_decode_blocks else min(
            tokens_done, state.request.num_prompt_tokens)
        n_full = min(limit // self.block_size, len(state.block_ids), self._cap_blocks())
        if n_full <= state.handled_blocks:
            return
        keys = block_keys(self.ns, state.request.block_hashes, n_full)
        n_full = len(keys)
        start = state.handled_blocks
        candidates = list(range(start, n_full))
        present = self._present([keys[i] for i in candidates]) if check_existing else (
            [keys[i] in self._known for i in candidates])
        todo = [i for i, p in zip(candidates, present, strict=True) if not p]
        state.handled_blocks = n_full
        if todo:
            meta.saves.append(BlockTransfer(req_id, [state.block_ids[i] for i in todo],
                                            [keys[i] for i in todo],
                                            num_tokens=n_full * self.block_size))
            self._remember({keys[i] for i in todo})

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        # Saves copy blocks out at the end of the step that computed them, so nothing here
        # needs the blocks any longer.
        self._reqs.pop(request.request_id, None)
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, CWMWorkerMetadata):
            self._remember(meta.stored_keys)
            for key in meta.failed_keys:
                self._known.pop(key, None)
