"""What the two halves of the connector tell each other, as plain dataclasses.

vLLM ships them between processes: :class:`CWMConnectorMetadata` from the scheduler to every
worker once a step, :class:`CWMWorkerMetadata` back (aggregated over the TP ranks), and
:class:`CWMHandshake` once at start, from each worker to the scheduler (the KV layout the
attention backend gave it, which the scheduler needs for the key namespace).

Blocks travel as vLLM block *hashes*, never as store keys: a key carries the TP rank, so each
worker derives its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class BlockTransfer:
    """Blocks of one request to move: ``block_ids[i]`` <-> ``block_hashes[i]``."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    num_tokens: int = 0  # tokens covered (block-aligned), for the blob's metadata
    salt: str | None = None   # the request's cache_salt (opens blobs sealed at rest)
    extra: bytes = b""        # per-request namespace scope (a LoRA adapter's content)
    # each block's content identity (:mod:`~cwm_plugin.connector.content`); empty: the hashes
    contents: list[bytes] = field(default_factory=list)
    sync: bool = False   # a load the worker runs before the step's forward (CPU memory tier)


@dataclass
class CWMConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    reset: bool = False     # vLLM's reset_cache: drop the workers' memory tiers
    # this step's number, and the newest step whose worker report the scheduler had taken in
    # when it planned it: a worker frees the memory it reported evicted up to ``seen``
    step: int = 0
    seen: int = 0
    # the step schedules no tokens (its requests wait for loads): the workers wait a moment
    # for a load to end instead of letting vLLM's loop spin, which takes the GIL from them
    idle: bool = False


@dataclass
class CWMWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers' stores did since the last step, for the scheduler's cache of stored
    blocks. ``stored`` holds (block hash, worker index): a block counts as stored once every
    worker (TP rank x pipeline stage) reported it."""

    stored: set[tuple[bytes, int]] = field(default_factory=set)
    # Hashes whose save failed, or whose load found no usable blob, on any worker: the
    # scheduler forgets them (a failure on one worker wins over success on another).
    failed: set[bytes] = field(default_factory=set)
    # Hashes whose blocks a worker's store dropped (evicted, expired, found dangling, ...).
    dropped: set[bytes] = field(default_factory=set)
    # A worker dropped more than it could list: forget every block believed stored.
    overflow: bool = False
    # Requests whose synchronous load (device workers) this step's forward pass waited for:
    # settled by this output, whichever step the scheduler is building meanwhile.
    loaded: set[str] = field(default_factory=set)
    step: int = 0        # the step (CWMConnectorMetadata.step) this report was made in

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, CWMWorkerMetadata)
        return CWMWorkerMetadata(self.stored | other.stored, self.failed | other.failed,
                                 self.dropped | other.dropped, self.overflow or other.overflow,
                                 self.loaded | other.loaded, max(self.step, other.step))


@dataclass
class CWMHandshake(KVConnectorHandshakeMetadata):
    """A worker's KV layout (``KVLayout.describe()``), TP rank and whether it loads in the
    background, sent once after ``register_kv_caches``."""

    layout: str
    tp_rank: int = 0
    async_loads: bool = False
