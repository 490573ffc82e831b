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


@dataclass
class CWMConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class CWMWorkerMetadata(KVConnectorWorkerMetadata):
    """Block hashes the worker has stored, so the scheduler can answer lookups for blocks that
    live only in the worker's memory tier (the durable tiers answer through their own index)."""

    stored: set[bytes] = field(default_factory=set)
    # Hashes whose save failed, or whose load found no usable blob, on any rank: the scheduler
    # forgets them (a failure on one rank wins over success on another).
    failed: set[bytes] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, CWMWorkerMetadata)
        return CWMWorkerMetadata(self.stored | other.stored, self.failed | other.failed)


@dataclass
class CWMHandshake(KVConnectorHandshakeMetadata):
    """A worker's KV layout (``KVLayout.describe()``), sent once after ``register_kv_caches``."""

    layout: str
