"""vLLM's own block hashing, outside vLLM: the hash chain of a window's tokens under a salt.

Thaw into another session and clone re-key a window: the same tokens under another
``cache_salt`` give another chain of vLLM block hashes (the salt is mixed into block 0), hence
other store keys, which are linked to the same blobs. The chain must be exactly the one vLLM
computes, so it is computed with vLLM's function (``hash_block_tokens``), its hash algorithm
and its seeded ``NONE_HASH``, and every re-key first recomputes the chain the window was saved
under and compares it with the recorded one: a different seed (``PYTHONHASHSEED``), algorithm
or vLLM hashing makes that check fail loudly instead of linking keys no request would use.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from cwm_plugin.connector.keys import kv_block_hashes
from cwm_plugin.errors import CWMError

_lock = threading.Lock()
_seeded: set[str] = set()


class HashingMismatch(CWMError):
    """This process does not hash blocks the way the vLLM that saved the window did."""

    code = "hashing_mismatch"
    http_status = 500


def _hash_fn(algo: str):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name(algo)
    with _lock:
        if algo not in _seeded or kv_cache_utils.NONE_HASH is None:
            kv_cache_utils.init_none_hash(fn)
            _seeded.clear()
            _seeded.add(algo)
    return fn


def chain(tokens: Sequence[int], *, salt: str | None, block_size: int, hash_block_size: int,
          hash_algo: str, lora: Sequence[str] | None, num_blocks: int) -> list[bytes]:
    """The rank-free KV-block hashes vLLM gives the first ``num_blocks`` blocks of
    ``tokens`` in a request with ``cache_salt=salt`` (and the LoRA adapter ``lora``)."""
    from vllm.v1.core import kv_cache_utils

    fn = _hash_fn(hash_algo)
    ratio = max(1, block_size // hash_block_size)
    lora_keys = [("lora", lora[0], lora[1])] if lora else []
    out: list[bytes] = []
    parent = None
    for i in range(num_blocks * ratio):
        block = tokens[i * hash_block_size:(i + 1) * hash_block_size]
        if len(block) < hash_block_size:
            break
        extra = lora_keys + ([("cache_salt", salt)] if i == 0 and salt else [])
        parent = kv_cache_utils.hash_block_tokens(fn, parent, block,
                                                  tuple(extra) if extra else None)
        out.append(bytes(parent))
    return kv_block_hashes(out, num_blocks, ratio)


def verified_chain(recorded: Sequence[bytes], tokens: Sequence[int], *, salt: str | None,
                   **settings) -> None:
    """Raise :class:`HashingMismatch` unless this process reproduces ``recorded``."""
    mine = chain(tokens, salt=salt, num_blocks=len(recorded), **settings)
    if list(mine) != [bytes(h) for h in recorded]:
        raise HashingMismatch(
            "this process hashes the window's tokens differently from the vLLM that saved them",
            hint="run it with vLLM's PYTHONHASHSEED and --prefix-caching-hash-algo "
                 f"({settings.get('hash_algo')}) and the same vLLM version")
