"""Content identities of KV blocks: the hash chain vLLM gives a request's tokens without its
cache_salt.

A block's KV is determined by its tokens (with the LoRA adapter, images and prompt embeddings
vLLM hashes alongside), not by the salt that isolates it, and a context window re-keys a
session's blocks under other salts by pointing the new keys at the same blobs. So each blob
names the content it holds and a read under another key of its group accepts it for that
content only (:mod:`cwm_plugin.store.binding`): a swapped blob file, or a key pointed at a
block of other tokens, is refused.

The identity is vLLM's own block hash of the request with no salt (vLLM's hasher, seed and
extra keys, so it is what the window engine computes from a window's tokens with
:func:`cwm_plugin.windows.hashing.chain` and ``salt=None``). A request without a salt has it
already (its block hashes); a salted one's chain is computed once per block, as the request
grows (a few microseconds a block, like vLLM's own hashing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cwm_plugin.connector.keys import kv_block_hashes


class _Unsalted:
    """A live request seen without its cache_salt, with the unsalted hashes computed so far
    (what vLLM's block hasher reads: it extends ``block_hashes`` to every full block)."""

    cache_salt = None

    def __init__(self, request: Any, hashes: list[bytes]) -> None:
        self._request = request
        self.block_hashes = hashes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class ContentChains:
    """Per request, the unsalted chain computed so far (the scheduler drops a finished
    request's with :meth:`forget`)."""

    def __init__(self, hash_fn: Any, hash_block_size: int, ratio: int) -> None:
        self.ratio = ratio
        self._hasher: Callable[[Any], list[bytes]] | None = None
        if hash_fn is not None:
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher

            self._hasher = get_request_block_hasher(hash_block_size, hash_fn)
        self._chains: dict[str, list[bytes]] = {}

    def of(self, request: Any, hashes: list[bytes], start: int = 0) -> list[bytes]:
        """The content identities of the request's KV blocks ``start..`` whose block hashes
        are ``hashes``; empty when they are those hashes (no salt), or could not be had (the
        blobs then name their salted hashes: a window's keys sharing them read as misses)."""
        if not getattr(request, "cache_salt", None) or self._hasher is None:
            return []
        n = start + len(hashes)
        chain = self._chains.setdefault(request.request_id, [])
        if len(chain) < n * self.ratio:
            chain.extend(self._hasher(_Unsalted(request, chain)))
        contents = kv_block_hashes(chain, n, self.ratio)[start:]
        return contents if len(contents) == len(hashes) else []

    def forget(self, req_id: str) -> None:
        self._chains.pop(req_id, None)


def each(contents: list[bytes], hashes: list[bytes]) -> list[bytes]:
    """A transfer's content identities, one per block hash (none given: the hashes are)."""
    return contents if contents else hashes
