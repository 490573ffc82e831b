"""Start-up self-check: does vLLM still hash blocks the way it did when the store was filled?

Store keys are vLLM's salted block hashes, which hold across restarts only while the hash
algorithm and seed (``PYTHONHASHSEED``, or vLLM's fixed default for sha256) stay the same. On the
scheduler's first lookup -- after vLLM's own ``init_none_hash`` has run in that process, so the
probe is what vLLM's requests really use -- the connector computes a probe (vLLM's chained hashes
of two fixed token blocks) and compares it with the record kept in the store under
``cwm-ns\\0<namespace digest>`` (the disk index and/or Redis; the first start writes it):

* ``match``: blocks saved before are reachable.
* ``mismatch``: vLLM now hashes differently. Logged as an ERROR naming the cause and the fix and
  counted (``cwm:connector_selfcheck_failures``). No stale block can be served: old keys carry
  the old hashes and new lookups never produce them. The record is rewritten, so the next start
  with the same settings is quiet.
* ``written``: first start for this namespace (or the record was unreadable).
* ``skipped``: the store has no disk or Redis tier (nothing outlives the process).
* ``error``: the check itself failed (logged; serving goes on).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

from cwm_plugin.connector.keys import KeyNamespace, hash_probe
from cwm_plugin.connector.records import write_record
from cwm_plugin.store.kv_store import KVStore

log = logging.getLogger(__name__)

SELFCHECK_PREFIX = b"cwm-ns\0"
SELFCHECK_LAYOUT = "cwm-namespace-record"


@dataclass(frozen=True)
class SelfCheck:
    status: str                # "match", "mismatch", "written", "skipped", "error"
    probe: str
    stored: dict[str, Any] | None = None


def selfcheck_key(ns: KeyNamespace) -> bytes:
    return SELFCHECK_PREFIX + ns.digest


def _seed_source() -> str:
    return "PYTHONHASHSEED" if os.environ.get("PYTHONHASHSEED") is not None else "default"


def _read(store: KVStore, key: bytes) -> dict[str, Any] | None:
    tensor = store.get(key)
    if tensor is None:
        return None
    try:
        return json.loads(bytes(tensor.numpy().tobytes()).decode())
    except (ValueError, UnicodeDecodeError):
        return None


def _write(store: KVStore, key: bytes, record: dict[str, Any]) -> None:
    # Not waited for: this runs inside vLLM's scheduling step, which a slow tier must not stall.
    write_record(store, key, record, SELFCHECK_LAYOUT, what="the namespace record", wait=0)


def run_selfcheck(store: KVStore, ns: KeyNamespace, hash_fn: Any, block_size: int) -> SelfCheck:
    """Compare this process's block hashing with the store's record (see the module docstring)."""
    probe = hash_probe(hash_fn, block_size)
    if not store.config.disk_path and not store.config.redis_url:
        return SelfCheck("skipped", probe)
    key = selfcheck_key(ns)
    # the namespace's fields too: the window engine names what differs on a thaw elsewhere
    record = {"probe": probe, "hash_algo": ns.hash_algo, "seed": _seed_source(),
              "namespace": asdict(ns)}
    stored = _read(store, key)
    if stored is None:
        _write(store, key, record)
        log.info("cwm connector self-check: first start for namespace %s, hash probe recorded",
                 ns.fingerprint)
        return SelfCheck("written", probe)
    if stored.get("probe") == probe:
        log.info("cwm connector self-check passed: vLLM's block hashes match the store's "
                 "(namespace %s)", ns.fingerprint)
        return SelfCheck("match", probe, stored)
    log.error(
        "cwm connector self-check FAILED: vLLM's block hashes for model %s and KV layout %s "
        "differ from those the store was filled with (then: hash algorithm %s, seed from %s; "
        "now: %s, seed from %s). The hash seed (PYTHONHASHSEED) or --prefix-caching-hash-algo "
        "changed, or vLLM's hashing did. Blocks saved before can never be found and none is "
        "served; new blocks are saved under the new hashes. Fix: restart with the previous "
        "PYTHONHASHSEED and hash algorithm to reach the stored blocks, or keep the new settings "
        "and reclaim the space of the old blocks (cwm store gc / eviction).",
        ns.model, ns.layout, stored.get("hash_algo"), stored.get("seed"), ns.hash_algo,
        _seed_source())
    _write(store, key, record)
    return SelfCheck("mismatch", probe, stored)
