"""A session's stored context: its records, moving it to another salt, erasing it.

:class:`SessionKV` works for the window engine on one store. The connector leaves a context
record per salted request (the latest, and the last few client turns by slot) and the sidecar a
conversation record per turn (:mod:`.conversation`); freeze reads them, thaw writes them for
the target session, a secret rotation moves them (and the blocks) to the session's new salt,
and ``clear_session`` erases a session's stored KV for a user who wants it gone.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

from cwm_plugin.connector import records
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.windows import hashing
from cwm_plugin.windows.conversation import (
    ConversationRecord,
    ConversationRecords,
    conversation_key,
)
from cwm_plugin.windows.rekey import BlockKeys

POLL_S = 0.1


class SessionKV:
    """Sessions' records and KV in ``store`` (see the module docstring)."""

    def __init__(self, store: KVStore, blocks: BlockKeys,
                 conversations: ConversationRecords) -> None:
        self.store = store
        self.blocks = blocks
        self.conversations = conversations

    def _context(self, salt: str, key: bytes) -> records.ContextRecord | None:
        t = self.store.get(key, salt=salt, primary=True)
        return records.ContextRecord.from_tensor(t) if t is not None else None

    def kept_turns(self, salt: str) -> list[int]:
        """The client turns whose context records the salt keeps, oldest first."""
        keys = [records.turn_record_key(salt, s) for s in range(self.conversations.keep)]
        found = self.store.get_many(keys, salt=salt, primary=True)
        return sorted({rec.turn for t in found if t is not None
                       and (rec := records.ContextRecord.from_tensor(t)).turn is not None})

    def record(self, salt: str, deadline: float, turn: int | None = None,
                coming: Mapping[int, float] | None = None
                ) -> tuple[records.ContextRecord, list[bytes]] | None:
        """The salt's latest context record (or turn ``turn``'s) and its verified block
        hashes. ``coming``: turn -> arrival (unix time) of the session's turns whose records
        may still be on their way (the sidecar knows them); only for those does it wait,
        until ``deadline`` (monotonic), for a record of that arrival or a later one. Anything
        else answers at once: what is stored, or None."""
        coming = coming or {}
        if turn is None:
            key, want = records.context_record_key(salt), max(coming.values(), default=None)
        else:
            key = records.turn_record_key(salt, turn % self.conversations.keep)
            want = coming.get(turn)
        while True:
            rec = self._context(salt, key)
            fits = rec is not None and (turn is None or rec.turn == turn)
            if fits and (want is None or rec.order >= want):
                break
            if want is None or time.monotonic() >= deadline:
                if not fits:
                    return None
                break  # the turn still coming never left a record: the one there stands
            time.sleep(POLL_S)
        hashes = rec.hashes()
        hashing.verified_chain(hashes, rec.tokens, salt=salt, block_size=rec.block_size,
                               hash_block_size=rec.hash_block_size, hash_algo=rec.hash_algo,
                               lora=rec.lora)
        return rec, hashes

    def write(self, salt: str, rec: records.ContextRecord,
                       conv: ConversationRecord | None) -> None:
        """A session's records, as the connector and the sidecar would have left them (as of
        a turn arriving now: the session's turns from here on replace them, none before)."""
        rec.arrived = time.time()
        if conv is not None:
            conv.arrived = rec.arrived
        keys = [records.context_record_key(salt)]
        if rec.turn is not None:
            keys.append(records.turn_record_key(salt, rec.turn % self.conversations.keep))
        futures = [self.store.put(k, rec.to_tensor(), layout=records.RECORD_LAYOUT, salt=salt,
                                  replace=True) for k in keys]
        if conv is not None:
            futures.append(self.conversations.write(salt, conv))
        for f in futures:
            f.result()

    def move_session(self, old_salt: str, new_salt: str) -> int:
        """Re-key a session's latest context from ``old_salt`` to ``new_salt`` (its salt after
        a secret rotation): the blocks stored from the first on get keys under the new salt
        (the same blobs, as a thaw does) and the new salt its records, so its next
        request hits them. The old keys stay a plain cache. Returns the blocks moved (0: no
        record or no stored first block under ``old_salt``, or the new salt has one)."""
        if self.store.where_many([records.context_record_key(new_salt)])[0] is not None:
            return 0  # moved before (by another process), or the session went on already
        found = self.record(old_salt, time.monotonic())
        if found is None:
            return 0
        rec, hashes = found
        keys = self.blocks.keys(rec.workers, hashes)
        n = self.blocks.restorable(keys, durable=False)  # the sidecar's store has no RAM tier
        if n == 0:
            return 0
        moved = self.blocks.chain(rec, rec.tokens, new_salt, n)
        self.blocks.rekey([ks[:n] for ks in keys], self.blocks.keys(rec.workers, moved),
                          old_salt, new_salt)
        conv = self.conversations.read(old_salt, rec.turn, rec.arrived) \
            if rec.turn is not None else None
        self.write(new_salt, replace(rec, block_hashes=[h.hex() for h in moved]), conv)
        return n

    def clear_session(self, salt: str) -> int:
        """Erase a session's stored KV: the blocks its kept records name and the records
        themselves (windows frozen from it keep their own keys). Returns the keys dropped."""
        found: list[records.ContextRecord] = []
        keep = self.conversations.keep
        rkeys = [records.context_record_key(salt), *(records.turn_record_key(salt, s)
                                             for s in range(keep))]
        for key in rkeys:
            t = self.store.get(key, salt=salt, primary=True)
            if t is not None:
                found.append(records.ContextRecord.from_tensor(t))
        blocks = {k for rec in found for ks in self.blocks.keys(rec.workers, rec.hashes())
                  for k in ks}
        conv = [conversation_key(salt, s) for s in range(keep)]
        dropped = self.store.delete_many([*blocks, *rkeys, *conv])
        return max((len(v) for v in dropped.values()), default=0)
