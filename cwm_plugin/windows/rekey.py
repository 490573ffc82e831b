"""Keys of a window's blocks: vLLM's hash chain under a salt, re-keying, completeness.

:class:`BlockKeys` works on one store for the window engine and its session operations: the
chain of keys a token sequence has under a salt, how many blocks are restorable from the first
on, re-keying (``link_many``; with encryption at rest a re-seal per salt), and waiting until a
set of blocks is on every durable tier (copying what one lacks:
:mod:`cwm_plugin.store.replication`) or refusing with what each tier holds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from cwm_plugin.errors import CWMError
from cwm_plugin.store.blob import crypto
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.store.replication import presence, replicate
from cwm_plugin.windows import hashing
from cwm_plugin.windows.model import Manifest


class WindowIncomplete(CWMError):
    """Blocks a window needs are not (or no longer) stored."""

    code = "window_incomplete"
    http_status = 409


class BlockKeys:
    """The keys of blocks in ``store`` (see the module docstring); ``settle_s``: how long
    :meth:`complete` waits for write-behind before copying what a durable tier lacks."""

    def __init__(self, store: KVStore, settle_s: float = 3.0) -> None:
        self.store = store
        self.settle_s = settle_s

    def chain(self, m: Any, tokens: Sequence[int], salt: str | None,
               n: int) -> list[bytes]:
        """vLLM's hash chain of ``tokens`` under ``salt`` (None: the blocks' content
        identities, :mod:`cwm_plugin.connector.content`)."""
        return hashing.chain(tokens, salt=salt, block_size=m.block_size,
                             hash_block_size=m.hash_block_size, hash_algo=m.hash_algo,
                             lora=m.lora, num_blocks=n)

    @staticmethod
    def keys(workers: Sequence[tuple[str, int]], hashes: Sequence[bytes]) -> list[list[bytes]]:
        return [[bytes.fromhex(d) + int(r).to_bytes(2, "big") + h for h in hashes]
                for d, r in workers]

    def of_window(self, m: Manifest) -> list[list[bytes]]:
        """Per worker, the keys of window ``m``'s blocks (under its window salt)."""
        return self.keys(m.workers, [bytes.fromhex(h) for h in m.window_hashes])

    def restorable(self, keys: list[list[bytes]], *, durable: bool = True) -> int:
        """Blocks present for every worker, from the first block on (``durable``: on a
        durable tier, whatever faster tier holds them too)."""
        n = len(keys[0]) if keys else 0
        if not n:
            return 0
        tiers = (self.store.durable or self.store.tiers) if durable else self.store.tiers
        held = self.store.held_by([k for ks in keys for k in ks], tiers).values()
        ok = [all(any(there[w * n + i] for there in held) for w in range(len(keys)))
              for i in range(n)]
        return next((i for i, good in enumerate(ok) if not good), n)

    def rekey(self, src: list[list[bytes]], dst: list[list[bytes]], src_salt: str,
               dst_salt: str) -> None:
        """Point ``dst`` keys at ``src`` keys' blobs (per worker, one batch per tier)."""
        pairs = [(d, s) for ds, ss in zip(dst, src, strict=True)
                 for d, s in zip(ds, ss, strict=True)]
        flat = [k for ks in dst for k in ks]
        had = {k for k, w in zip(flat, self.store.where_many(flat), strict=True) if w}
        if self.store.config.encryption_key:
            self._reseal(pairs, src_salt, dst_salt)
        else:
            self.store.link_many(pairs)
        missing = sum(1 for ks in dst for k, w in zip(ks, self.store.where_many(ks),
                                                      strict=True) if w is None)
        if missing:  # take back what this call linked (a session's own KV stays)
            self.store.delete_many([k for k in flat if k not in had])
            raise WindowIncomplete(f"{missing} blocks vanished while being re-keyed",
                                   hint="they were evicted meanwhile; retry, or re-run the "
                                        "conversation so its blocks are saved again")

    def _reseal(self, pairs: list[tuple[bytes, bytes]], src_salt: str, dst_salt: str) -> None:
        master = crypto.parse_master_key(self.store.config.encryption_key or "")
        dst_c = crypto.BlobCipher.derive(master, dst_salt)
        futures = []
        for new, old in pairs:
            plain = self.store.get_plain(old, salt=src_salt)   # None unless it is old's own
            if plain is None:
                continue
            futures.append(self.store.put_blob(new, dst_c.seal(plain, key=new), replace=True))
        for f in futures:
            f.result()

    def complete(self, keys: list[list[bytes]], what: str, deadline: float, *,
                  block_size: int, tokens: int) -> None:
        """Wait until every durable tier serves every key (copying a block a tier lacks from
        one that has it once ``settle_s`` passed), else refuse saying what each tier holds."""
        flat = [k for ks in keys for k in ks]
        settle = time.monotonic() + min(self.settle_s, max(0.0, deadline - time.monotonic()))
        while True:
            if time.monotonic() >= settle:
                replicate(self.store, flat)
            held = presence(self.store, flat)
            if held and all(all(v) for v in held.values()):
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        n = len(keys[0]) if keys else 0
        per_tier = ", ".join(
            f"{t} holds {sum(all(v[w * n + i] for w in range(len(keys))) for i in range(n))}"
            for t, v in held.items()) or "no durable tier answers"
        got = self.restorable(keys)
        raise WindowIncomplete(
            f"{n - got} of {n} blocks of {what} are not on every durable tier ({per_tier}); "
            f"{got * block_size} of {tokens} tokens are restorable",
            hint="they were evicted, are still being written, or a tier is down; retry, or "
                 "re-send the conversation so its blocks are saved again")
