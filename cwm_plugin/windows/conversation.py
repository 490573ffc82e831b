"""The conversation behind a session's KV: what the sidecar sent, so a window is the conversation.

The connector's context record (:mod:`cwm_plugin.connector.records`) holds what vLLM computed:
token ids and block hashes. Only the sidecar knows the rest of a client turn -- the messages
as the client sent them (with the answer) and what it merged into the prompt (its memory
block, a compaction's cut and summary). After each client turn it leaves a
:class:`ConversationRecord` beside the connector's record, under the same salt group and the
same turn slot (``turn % keep``): a freeze takes both, so the window carries its messages and
its prompt state, and a thaw writes both for the target session, so the thawed session's next
turn is assembled to begin with the window's tokens (and can be frozen again at once).

A conversation record carries when its turn arrived (``arrived``, the same time the connector's
record of the turn carries): a freeze pairs the two only when they are of the same arrival, and,
like the connector's, a record never replaces one of a turn that arrived later.

Key: the salt's group + ``conv`` + the 2-byte slot. Sealed under the salt with encryption at
rest, like the connector's records.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

from cwm_plugin.connector import records

log = logging.getLogger(__name__)
LAYOUT = "cwm-conversation-record"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20


def conversation_key(salt: str, slot: int) -> bytes:
    return records.salt_group(salt) + b"conv" + int(slot).to_bytes(2, "big")


@dataclass
class ConversationRecord:
    turn: int
    messages: list[dict] | None = None  # the client's messages and the answer (None: too big)
    prompt: dict[str, Any] = field(default_factory=dict)  # what the sidecar merged in
    model: str = ""
    created: float = 0.0
    messages_dropped: bool = False  # they were over the size cap
    version: int = 1
    arrived: float | None = None  # unix time the turn arrived at the sidecar

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConversationRecord:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


def capped_messages(messages: list[dict] | None, max_bytes: int) -> tuple[list[dict] | None, bool]:
    """``messages`` if their JSON fits ``max_bytes``, else (None, True)."""
    if messages is None:
        return None, False
    size = len(json.dumps(messages, separators=(",", ":"), default=str))
    return (messages, False) if size <= max_bytes else (None, True)


class ConversationRecords:
    """Read and write a store's conversation records (``keep``: turns a session keeps)."""

    def __init__(self, store: Any, keep: int = 8) -> None:
        self.store = store
        self.keep = keep

    def write(self, salt: str, rec: ConversationRecord) -> Future:
        """Save ``rec`` under its turn's slot in the background (replacing the record of a
        turn that arrived before it, never one that arrived after); a failure is logged by
        the future's callback, never raised."""
        rec.created = rec.created or time.time()
        key, body = conversation_key(salt, rec.turn % self.keep), asdict(rec)
        fut = self.store.put(key, records.json_tensor(body), layout=LAYOUT, salt=salt,
                             replace=True, unless=records.newer_stored(
                                 self.store, key, salt, records.order_of(body)))

        def done(f: Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.warning("could not save a conversation record: %s", f.exception())
        fut.add_done_callback(done)
        return fut

    def read(self, salt: str, turn: int, arrived: float | None = None
             ) -> ConversationRecord | None:
        """The record of ``turn`` (None: none kept, or its slot holds another turn's, or with
        ``arrived``, another arrival's of that turn)."""
        key = conversation_key(salt, turn % self.keep)
        self.store.wait_keys([key], timeout=5.0)  # a write of this process still under way
        t = self.store.get(key, salt=salt, primary=True)
        if t is None:
            return None
        try:
            rec = ConversationRecord.from_dict(records.tensor_json(t))
        except (ValueError, TypeError) as exc:  # damaged: the KV still freezes without it
            log.warning("a conversation record could not be read: %s", exc)
            return None
        if rec.turn != turn or None not in (arrived, rec.arrived) and rec.arrived != arrived:
            return None
        return rec
