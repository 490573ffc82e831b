"""Our tiers in vLLM's KV events: what the store holds, for whoever subscribes to them.

vLLM publishes its prefix cache's blocks (medium ``GPU``) from the scheduler process, and a
connector's own events beside them (``take_events``, when ``--kv-events-config`` turns events
on). These are ours: a block the workers all reported saved is announced with the medium of the
tier it was saved to (``CPU`` for their memory tier, ``STORAGE`` for disk or Redis), its token
ids, its block size and its parent, and with the request's ``cache_salt`` in block 0's
``extra_keys`` the way vLLM's own events carry it; a block a worker reported dropped (evicted,
damaged, gone), or every block on a cache reset, is announced removed. Hashes are vLLM's
external form (the 64-bit tail of the block hash, as ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
publishes them), so a block in two media has one hash. A balancer weighs a replica's blocks by
medium (``docs/router.md`` says what vllm-router 0.1.17 does with them).

A save planned but never reported (a failure, a shutdown) is never announced; everything held
for it is bounded (LRU), so a subscriber may miss a removal of a block long stored, never see a
block that was not saved.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

LIMIT = 200_000  # blocks held: planned saves and announced blocks, each


def medium_of(source: CacheHitSource) -> str:
    """The KV-event medium of the tier the workers save to (``hit_source_of_saves``)."""
    return MEDIUM_CPU if source is CacheHitSource.HOST else MEDIUM_STORAGE


def external_hash(h: bytes) -> int:
    """vLLM's external form of a block hash (``maybe_convert_block_hash`` with int hashes)."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


@dataclass(frozen=True)
class _Planned:
    seq: int  # the order saves were planned in: a request's blocks in chain order
    parent: bytes | None
    tokens: tuple[int, ...]
    salt: str | None  # the request's, when the block is its first


class TierEvents:
    """Collects our blocks' events between two of vLLM's steps (``take``)."""

    def __init__(self, medium: str, block_size: int, *, limit: int = LIMIT) -> None:
        self.medium = medium
        self.block_size = block_size
        self.limit = limit
        self._planned: OrderedDict[bytes, _Planned] = OrderedDict()
        self._announced: OrderedDict[bytes, None] = OrderedDict()
        self._events: list[KVCacheEvent] = []
        self._seq = itertools.count()

    def planned(self, hashes: Sequence[bytes], todo: Iterable[int], tokens: Sequence[int],
                salt: str | None) -> None:
        """Blocks ``todo`` (indices into the request's chain ``hashes``; its tokens ``tokens``)
        are being saved; announced when all workers report them stored."""
        size = self.block_size
        for i in todo:
            self._put(self._planned, hashes[i], _Planned(
                next(self._seq), hashes[i - 1] if i else None,
                tuple(tokens[i * size:(i + 1) * size]), salt if i == 0 else None))

    def stored(self, hashes: Iterable[bytes]) -> None:
        """Blocks every worker holds now (reported in any order): one ``BlockStored`` a run of
        parent-linked blocks, parents announced before their children."""
        done = [(h, p) for h in set(hashes) if (p := self._planned.pop(h, None)) is not None
                and h not in self._announced]
        run: list[tuple[bytes, _Planned]] = []
        for h, p in sorted(done, key=lambda hp: hp[1].seq):
            if run and p.parent != run[-1][0]:
                self._store(run)
                run = []
            run.append((h, p))
        if run:
            self._store(run)

    def _store(self, run: list[tuple[bytes, _Planned]]) -> None:
        first = run[0][1]
        extra = [((p.salt,) if p.salt else None) for _, p in run]
        self._events.append(BlockStored(
            block_hashes=[external_hash(h) for h, _ in run],
            parent_block_hash=None if first.parent is None else external_hash(first.parent),
            token_ids=[t for _, p in run for t in p.tokens], block_size=self.block_size,
            lora_id=None, medium=self.medium, lora_name=None,
            extra_keys=extra if any(extra) else None))
        for h, _ in run:
            self._put(self._announced, h, None)

    def removed(self, hashes: Iterable[bytes]) -> None:
        """Blocks a worker dropped (or failed to load): announced removed if they were
        announced stored."""
        gone = []
        for h in hashes:
            self._planned.pop(h, None)
            if h in self._announced:
                del self._announced[h]
                gone.append(external_hash(h))
        if gone:
            self._events.append(BlockRemoved(block_hashes=gone, medium=self.medium))

    def cleared(self) -> None:
        """A cache reset: every block announced is removed."""
        self._planned.clear()
        self.removed(list(self._announced))

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def _put(self, d: OrderedDict, h: bytes, value: object) -> None:
        d[h] = value
        d.move_to_end(h)
        while len(d) > self.limit:
            d.popitem(last=False)
