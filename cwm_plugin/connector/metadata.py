"""What the scheduler-side connector tells the worker-side one each step, and back.

Plain dataclasses: vLLM ships them from the scheduler process to the worker process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class BlockTransfer:
    """Blocks of one request to move: ``block_ids[i]`` <-> ``keys[i]``."""

    req_id: str
    block_ids: list[int]
    keys: list[bytes]
    num_tokens: int = 0  # tokens covered (block-aligned), for the blob's metadata


@dataclass
class CWMConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class CWMWorkerMetadata(KVConnectorWorkerMetadata):
    """Keys the worker has stored, so the scheduler can answer lookups for blocks that live only
    in the worker's memory tier (the durable tiers answer through their own index)."""

    stored_keys: set[bytes] = field(default_factory=set)
    # Keys whose save failed or whose load found no usable blob: the scheduler forgets them.
    failed_keys: set[bytes] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, CWMWorkerMetadata)
        return CWMWorkerMetadata(self.stored_keys | other.stored_keys,
                                 self.failed_keys | other.failed_keys)
